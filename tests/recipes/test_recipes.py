"""Every shipped recipe, run exactly as its header comment says, ends where the header says.

Each row is a command a user copies from a recipe's header and the final metric the header
promises; the test runs that command (nothing shortened) and reads ``result.json``. The runs are
seeded and deterministic on one machine; the margin covers another CPU's floating-point order
(the UNet's val IoU after 10 epochs moved from 0.951 to 0.966 on a CPU whose oneDNN kernels take
another path, and to 0.937 with oneDNN off: its margin is 0.02).
"""

import json
import os
from importlib import resources

import pytest

from helpers import ga_train, run_dir_of, shipped

# (the arguments after ga-train, the result.json key, the header's words for it, value, margin)
PROMISES = [
    (("config=unet.yaml",), "val_iou", "val IoU", 0.95, 0.02),
    (("config=unet.yaml", "accum_steps=8"), "val_iou", "val IoU", 0.93, 0.02),
    (("config=digits_cnn.yaml",), "val_accuracy", "val accuracy", 0.981, 0.01),
    (("config=digits_resnet_mirrored.yaml",), "val_accuracy", "val accuracy", 0.997, 0.01),
    # Per byte, from gacli.recipes.text_lm.Perplexity. Its margin is a guess at another CPU's and
    # another Python's help text (a different corpus and split), not a measured spread.
    (("config=text_lm.yaml",), "val_perplexity", "val perplexity", 4.76, 0.3),
]
# MirroredStrategy over 2 logical CPUs.
DISTRIBUTED = {"config=digits_resnet_mirrored.yaml"}


def header(recipe):
    text = (resources.files("gacli.recipes") / f"{recipe}.yaml").read_text()
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


def promise_text(arguments, words, value, margin):
    return f"ga-train {' '.join(arguments)}", f"{words} {value} +- {margin}"


def test_every_recipe_header_states_the_promises_tested_here():
    promised = {arguments[0][len("config=") : -len(".yaml")] for arguments, *_ in PROMISES}
    assert promised == set(shipped("gacli.recipes"))
    for arguments, _, words, value, margin in PROMISES:
        command, result = promise_text(arguments, words, value, margin)
        text = header(arguments[0][len("config=") : -len(".yaml")])
        # The command on a line of its own, the promise in the lines after it.
        assert f"# {command}\n" in text + "\n", (command, text)
        assert result in text.split(f"# {command}\n", 1)[1].split("# ga-train ")[0], (result, text)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arguments, key, words, value, margin",
    [
        pytest.param(
            *promise,
            id=" ".join(promise[0]),
            marks=[pytest.mark.distributed] if promise[0][0] in DISTRIBUTED else [],
        )
        for promise in PROMISES
    ],
)
def test_recipe_run_as_shipped_keeps_its_promise(arguments, key, words, value, margin, tmp_path):
    code, output = ga_train(*arguments, cwd=tmp_path, timeout=900)
    assert code == 0, output
    if arguments[0] in DISTRIBUTED:
        assert "x replicas 2" in output and "mirrored (2 replicas)" in output
    result = json.loads(open(os.path.join(run_dir_of(output), "result.json")).read())
    assert result[key] == pytest.approx(value, abs=margin), (key, result[key])
