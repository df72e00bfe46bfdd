"""Contract row D4: the batch arithmetic, resolved once, with errors that say what to type."""

import pytest

from gacli.runner.config.schema import ConfigError
from gacli.runner.plan.batch import resolve_batch


@pytest.mark.parametrize(
    "micro, accum, effective, replicas, given, expected",
    [
        (32, 4, None, 1, (), (32, 4, 128)),
        (16, None, 256, 1, (), (16, 16, 256)),
        (None, 8, 256, 2, (), (16, 8, 256)),
        (None, None, 256, 1, (), (32, 8, 256)),  # only the effective batch: micro defaults to 32
        (None, None, None, 1, (), (32, 1, 32)),
        (32, 4, 128, 1, (), (32, 4, 128)),  # all three agree
        # A recipe's micro 8 and accum 8, the command line's effective 256 and micro 16:
        (16, 8, 256, 1, ("effective_batch_size", "micro_batch_size"), (16, 16, 256)),
        # The command line's accum_steps=8 with a recipe's micro 8: effective derived.
        (8, 8, None, 4, ("accum_steps",), (8, 8, 256)),
        # The command line's effective 64 with a recipe's micro 8 and accum 4: micro kept.
        (8, 4, 64, 1, ("effective_batch_size",), (8, 8, 64)),
    ],
)
def test_any_two_determine_the_third(micro, accum, effective, replicas, given, expected):
    plan = resolve_batch(micro, accum, effective, replicas, given)
    assert (plan.micro_batch_size, plan.accum_steps, plan.effective_batch_size) == expected
    assert plan.effective_batch_size == plan.micro_batch_size * plan.accum_steps * replicas


@pytest.mark.parametrize(
    "micro, accum, effective, replicas, message",
    [
        # All three from config files: the one to set to null is named.
        (
            32,
            4,
            100,
            1,
            "= 128. Set the one to derive to null in your YAML, e.g. effective_batch_size: null",
        ),
        (16, None, 100, 1, "use e.g. effective_batch_size=96 or 112"),
        (16, None, 32, 4, "is not a multiple of micro_batch_size x replicas = 16 x 4 = 64"),
        (None, 3, 100, 1, "set micro_batch_size instead"),
        (0, 4, None, 1, "micro_batch_size=0 must be a whole number >= 1"),
        (8, True, None, 1, "accum_steps=True must be a whole number"),
    ],
)
def test_batch_errors_say_what_to_type(micro, accum, effective, replicas, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_batch(micro, accum, effective, replicas)
