"""ga-train's ``remat`` setting: the model wrapper recomputes activations in the backward pass,
and the run ends with the weights it ends with without recomputation (contract row M1, here
through the config); a choice the model cannot take is one paragraph before training."""

import json
import os

import pytest

from gacli.errors import ConfigError
from helpers import compose_config

SHORT = ("epochs=1", "steps_per_epoch=3", "checkpoint=false")
# Dropout (seed generators) in the MLP; batch norm's moving statistics in the UNet.
JOBS = {
    "mlp with dropout": ("model=mlp", "model.dropout=0.3"),
    "unet with batch norm": ("model=unet", "dataset=shapes", "micro_batch_size=8"),
}


def _weights_sha(tmp_path, name, *overrides, capsys=None):
    from gacli.runner.training.run import train

    run_dir = tmp_path / name
    train(compose_config(*SHORT, *overrides), str(run_dir))
    with open(os.path.join(run_dir, "result.json")) as handle:
        return json.load(handle)["weights_sha256"]


# The UNet's two runs take about 13 s: out of the in-process lane, in the full suite.
@pytest.mark.parametrize(
    "job",
    [pytest.param(job, marks=[pytest.mark.slow] if "unet" in job else []) for job in sorted(JOBS)],
)
def test_remat_every_trains_the_weights_of_the_run_without_it(job, tmp_path, capsys):
    without = _weights_sha(tmp_path, "off", *JOBS[job])
    capsys.readouterr()
    with_remat = _weights_sha(tmp_path, "on", *JOBS[job], "remat=every")
    assert "recompute" in capsys.readouterr().out  # the panel says what is recomputed
    assert with_remat == without


def test_a_block_the_model_does_not_have_is_refused_before_training(tmp_path):
    from gacli.runner.training.run import train

    with pytest.raises(ConfigError) as refused:
        train(compose_config(*SHORT, "remat=[dense_9]"), str(tmp_path / "run"))
    assert str(refused.value).startswith("remat names layer 'dense_9', which model 'mlp'")
    # What to type instead, as the command line takes it (not Python's list of strings).
    assert "'remat=[dense" in str(refused.value) and "remat=['" not in str(refused.value)
    assert not (tmp_path / "run" / "result.json").exists()
