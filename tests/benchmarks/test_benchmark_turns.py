"""benchmarks/turns.py: configurations that take turns never train at the same time.

The workers here are stand-ins without TensorFlow: each records when its turns began and ended,
and the turns of different workers must not overlap. The real benchmark's turns are run by
tests/benchmarks/test_benchmarks.py.
"""

import json
import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from turns import run_in_turns  # noqa: E402

WORKER = f"""
import json, sys, time
sys.path.insert(0, {str(BENCHMARKS)!r})
from turns import READY, TURN_DONE, Baton

spec = json.loads(sys.argv[-1])
baton = Baton(spec["baton"]["go_fd"], spec["baton"]["done_fd"], 1)
if spec.get("fail"):
    sys.exit(3)  # dies in its warm-up: the others go on without it
time.sleep(spec["warmup_s"])
baton.wait_for_turn(READY)
turns = []
for index in range(spec["turns"]):
    began = time.monotonic()
    while time.monotonic() - began < 0.01:  # trains
        pass
    turns.append((began, time.monotonic()))
    if index < spec["turns"] - 1:
        baton.wait_for_turn(TURN_DONE)
baton.window_done()
with open(spec["out"], "w") as handle:
    json.dump(turns, handle)
"""


def test_workers_take_turns_and_a_failed_one_is_left_out(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    specs, dirs = [], []
    for index, warmup_s in enumerate([0.3, 0.0, 0.1, 0.0]):
        job_dir = tmp_path / f"job{index}"
        job_dir.mkdir()
        dirs.append(str(job_dir))
        specs.append(
            {
                "baton": {"turn_updates": 1},
                "warmup_s": warmup_s,
                "turns": 5,
                "fail": index == 3,
                "out": str(job_dir / "turns.json"),
            }
        )
    outcomes = run_in_turns(
        [[sys.executable, str(script)]] * 4, specs, dirs, dict(os.environ), 60, seed=0
    )

    assert [code for code, _ in outcomes] == [0, 0, 0, 3]
    turns = [json.loads((Path(d) / "turns.json").read_text()) for d in dirs[:3]]
    assert [len(t) for t in turns] == [5, 5, 5]
    spans = sorted((began, ended, worker) for worker, t in enumerate(turns) for began, ended in t)
    for (_, ended, _), (began, _, _) in zip(spans, spans[1:]):
        assert began >= ended  # one worker trains at a time
    # No turn started before the slowest warm-up was over: all are timed in the same minutes.
    order = [worker for _, _, worker in spans]
    assert sorted(order[:3]) == [0, 1, 2]
