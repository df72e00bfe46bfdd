"""Contract rows D1 and D3 under MirroredStrategy with 1 and 2 replicas (logical CPU devices):
both wrappers and a custom loop match a single-device big-batch run, ragged data included. The
custom loop is written the three ways users write a replica's loss (its mean, a keras.losses.Loss,
tf.nn.compute_average_loss)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import MEASURED

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def distributed_results():
    result = subprocess.run([sys.executable, os.path.join(HERE, "distributed_cases.py")],
                            capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[0][len("RESULTS "):])


CASES = [
    f"{kind}-{optimizer}"
    for kind in ("model-2replicas-ragged", "model-1replica-ragged", "optimizer-2replicas",
                 "custom-loop-local-mean-2replicas-ragged", "custom-loop-keras-loss-2replicas-ragged",
                 "custom-loop-compute-average-loss-2replicas-ragged",
                 "model-2replicas-ragged-steps_per_execution")
    for optimizer in ("momentum", "adam")
] + [
    f"{kind}-{clipping}"
    for kind in ("model-2replicas-ragged", "optimizer-2replicas")
    for clipping in ("momentum-global-clipnorm", "momentum-clipvalue", "sgd-agc")
]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_d1_d3_mirrored_matches_single_device_big_batch(distributed_results, case):
    difference = distributed_results[case]
    MEASURED.setdefault(f"test_d1_d3_mirrored[{case}]", []).append(difference)
    assert difference <= (1e-5 if "adam" in case else 1e-6)
