"""micro_batch_size=auto: the probe's search and choice, and a probed run that ends with the
weights of a run given the chosen size by hand (GACLI_FAKE_OOM_ABOVE stands in for a device's
memory: the real tf.errors.ResourceExhaustedError, raised from inside the compiled step)."""

import json
import os

import pytest

from gacli.runner.autobatch import Probe, choose, ladder, search
from gacli.runner.config import AutoPlan, ConfigError, resolve_batch
from gacli.runner.train import train
from helpers import (
    compose_config,
    final_weights,
    ga_train,
    record,
    run_dir_of,
    weights_difference,
)

# The default job's digits MLP, one epoch, momentum SGD (no adaptive state to hide a difference).
JOB = ("optimizer=momentum", "optimizer.learning_rate=0.05", "epochs=1", "checkpoint=false")
AUTO = ("micro_batch_size", "effective_batch_size")


def fits_up_to(limit):
    return lambda size: Probe(size, size <= limit, 1000.0 * min(size, 12), None)


def test_candidates_keep_the_effective_batch_exactly():
    assert AutoPlan(None, 96, 2).candidates(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert AutoPlan(4, None, 1).candidates(5) == [1, 2, 3, 4, 5]
    assert AutoPlan(None, 96, 2).with_micro_batch_size(12).accum_steps == 4
    assert resolve_batch("auto", 4, None, 1, given=("micro_batch_size",)) == AutoPlan(4, None, 1)
    plan = resolve_batch("auto", 4, 256, 1, given=("micro_batch_size", "effective_batch_size"))
    assert plan == AutoPlan(None, 256, 1)
    with pytest.raises(ConfigError, match="effective_batch_size=256"):
        resolve_batch(
            "auto", 4, 256, 1, given=("micro_batch_size", "accum_steps", "effective_batch_size")
        )
    with pytest.raises(ConfigError, match="multiple of the 2 replicas"):
        resolve_batch("auto", None, 97, 2, given=AUTO)


def test_search_climbs_a_ladder_then_bisects_and_the_margin_steps_back():
    candidates = AutoPlan(None, 96, 1).candidates(96)
    assert ladder(candidates) == [1, 2, 4, 8, 16, 32, 96]
    probes = search(fits_up_to(40), candidates)
    # 32 ran and 96 did not: 48 is tried between them, and fails.
    assert [size for size, probe in probes.items() if not probe.fits] == [48, 96]
    assert choose(probes, candidates, "largest", 0.0) == 32
    assert choose(probes, candidates, "largest", 0.1) == 24  # <= 0.9 x 32, a divisor of 96
    assert choose(probes, candidates, "fastest", 0.1) == 16  # 12+ all run at the same speed
    everything = search(fits_up_to(1000), candidates)
    assert choose(everything, candidates, "largest", 0.1) == 96  # no failure, no margin
    assert choose(search(fits_up_to(0), candidates), candidates, "largest", 0.1) is None


def test_auto_ends_with_the_weights_of_the_chosen_size_given_by_hand(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GACLI_FAKE_OOM_ABOVE", "40")
    probed = train(
        compose_config(*JOB, "micro_batch_size=auto", "effective_batch_size=128"),
        str(tmp_path / "auto"),
        given=AUTO,
    )
    output = capsys.readouterr().out
    record_ = json.load(open(tmp_path / "auto" / "batch_plan.json"))
    assert (record_["micro_batch_size"], record_["accum_steps"]) == (16, 8)
    assert {p["micro_batch_size"]: p["fits"] for p in record_["probes"]} == {
        1: True, 2: True, 4: True, 8: True, 16: True, 32: True, 64: False
    }  # fmt: skip
    assert "16 (micro_batch_size=auto: the largest that fits, at most 90%" in output
    assert "64  out of memory" in output
    result = json.load(open(tmp_path / "auto" / "result.json"))
    assert (result["micro_batch_size"], result["accum_steps"]) == (16, 8)

    monkeypatch.delenv("GACLI_FAKE_OOM_ABOVE")
    by_hand = train(
        compose_config(*JOB, "micro_batch_size=16", "accum_steps=8"), str(tmp_path / "hand")
    )
    assert probed == by_hand  # every final metric
    hand = json.load(open(tmp_path / "hand" / "result.json"))
    assert result["weights_sha256"] == hand["weights_sha256"]


def test_a_resumed_run_keeps_the_probed_size_without_probing(tmp_path, monkeypatch):
    from gacli.runner import train as train_module

    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    saved = {"micro_batch_size": 8, "accum_steps": 16, "replicas": 1, "why": "test"}
    (run_dir / "batch_plan.json").write_text(json.dumps(saved))
    monkeypatch.setattr(
        train_module, "find_micro_batch_size", lambda *a, **k: pytest.fail("probed again")
    )
    cfg = compose_config(*JOB, "micro_batch_size=auto", "effective_batch_size=128", "resume=true")
    plan, lines = train_module.settle_plan(cfg, AutoPlan(None, 128, 1), None, None, str(run_dir))
    assert (plan.micro_batch_size, plan.accum_steps) == (8, 16)
    assert "as before" in lines["micro-batch"]


@pytest.mark.slow
@pytest.mark.distributed
def test_auto_under_two_replicas(tmp_path):
    """Per replica: the fault counts a replica's samples, so 2 x 16 fit where 2 x 32 do not, and
    the 10% margin steps back to 2 x 8 (the largest divisor of 64 at most 0.9 x 16)."""
    arguments = [
        *JOB,
        "checkpoint=true",
        "strategy=mirrored",
        "strategy.logical_cpus=2",
        "effective_batch_size=128",
    ]
    code, output = ga_train(
        *arguments, "micro_batch_size=auto", cwd=tmp_path, env={"GACLI_FAKE_OOM_ABOVE": "20"}
    )
    assert code == 0, output
    probed = run_dir_of(output)
    plan = json.load(open(os.path.join(probed, "batch_plan.json")))
    assert (plan["micro_batch_size"], plan["accum_steps"]) == (8, 8)
    assert [p["fits"] for p in plan["probes"]] == [True] * 5 + [False]  # 1..16 run, 32 does not
    code, output = ga_train(*arguments, "micro_batch_size=8", cwd=tmp_path)
    assert code == 0, output
    measured = record(
        weights_difference(final_weights(probed), final_weights(run_dir_of(output))),
        "test_auto_under_two_replicas (auto vs by hand)",
    )
    assert measured == 0.0
