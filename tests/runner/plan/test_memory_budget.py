"""micro_batch_size=auto under auto_batch.memory_budget_mib: a size whose measured peak is above
the budget does not fit, and where that keeps the micro-batch below what the fewest passes need,
the probe tries recomputation (remat=every) and keeps it where it needs fewer passes.

The job: a stack of six convolution blocks on 64x64 images, whose activations (not its 3,000
weights) fill the memory. The peaks are measured here first, with the probe's own functions, and
the budget set between them: on a CPU they are TensorFlow's CPU allocator's (docs/guides/
batch-probe.md says why not the process's resident memory)."""

import json
import os

import pytest

from gacli.errors import ConfigError
from gacli.runner.plan.auto_micro_batch import (
    Probe,
    ProbeHooks,
    ProbeTarget,
    choose,
    find_micro_batch_size,
    recompute_in,
    search,
    settle_plan,
)
from gacli.runner.plan.batch import AutoPlan
from gacli.runner.training.run import train
from helpers import compose_config, event_tags, scalars

EFFECTIVE = 16
JOB = (
    "dataset=shapes",
    "dataset.image_size=64",
    "dataset.num_samples=48",
    "model=cnn",
    "model.filters=[8,8,8,8,8,8]",
    "optimizer=sgd",
    "micro_batch_size=auto",
    f"effective_batch_size={EFFECTIVE}",
    "auto_batch.timed_calls=1",
    "steps_per_execution=1",
    "epochs=1",
    "steps_per_epoch=1",
    "checkpoint=false",
)
AUTO = ("micro_batch_size", "effective_batch_size")
MIB = 2**20


@pytest.fixture(scope="module")
def peaks():
    """{remat: {size: peak bytes}} at micro-batches 8 and 16, without recomputation and with
    remat=every, as the probe measures them."""
    from gacli.runner.builders.data import load_dataset
    from gacli.runner.builders.job import build_job
    from gacli.runner.cluster.strategy import make_strategy
    from gacli.runner.plan.job_plan import PlanSettings
    from gacli.runner.plan.steps import plan_steps

    cfg = compose_config(*JOB)
    strategy = make_strategy(cfg.strategy)
    data = load_dataset(cfg.dataset, cfg.seed)
    plan = AutoPlan(None, EFFECTIVE, 1)
    first = plan.with_micro_batch_size(EFFECTIVE)
    job = build_job(
        cfg, first, data, plan_steps(PlanSettings.of(cfg), first, data.train_size), strategy
    )
    hooks = ProbeHooks(cfg, plan, job)
    measured = {}
    for remat in (None, "every"):
        if remat is not None:
            recompute_in(job.model, remat)
        target = ProbeTarget(job.model, strategy, data.train)
        _, probes = find_micro_batch_size(target, [8, 16], cfg.auto_batch, hooks)
        measured[remat] = {size: probe.peak_bytes for size, probe in probes.items()}
    print(f"peaks (MiB): { {r: {s: b / MIB for s, b in p.items()} for r, p in measured.items()} }")
    return measured


@pytest.fixture(scope="module")
def budget_mib(peaks):
    """A budget between the peak at 16 with recomputation and the peak at 16 without it."""
    low, high = peaks["every"][16], peaks[None][16]
    assert high - low > 4 * MIB, peaks  # recomputation saves memory on this model
    budget = round((low + high) / 2 / MIB)
    assert peaks[None][8] < budget * MIB, peaks  # 8 without recomputation fits
    return budget


def test_over_budget_is_not_out_of_memory_and_takes_no_margin():
    """A size over the budget was measured against it: the largest size within it is chosen,
    with no margin taken off (the margin is for the unmeasured device limit)."""
    candidates = AutoPlan(None, 96, 1).candidates(96)

    def probe(size):
        return Probe(size, size <= 40, 1000.0, over_budget=size > 40)

    probes = search(probe, candidates)
    assert probes[48].row().split()[1:3] == ["over", "budget"]
    assert choose(probes, candidates, "largest", 0.4) == 32  # with the margin: 24 (test_autobatch)


@pytest.mark.slow  # about 20 s with the peaks measured: out of the in-process lane
def test_recomputation_gives_the_fewest_passes_within_the_budget(
    tmp_path, capsys, peaks, budget_mib
):
    run_dir = tmp_path / "run"
    train(
        compose_config(*JOB, f"auto_batch.memory_budget_mib={budget_mib}"),
        str(run_dir),
        given=AUTO,
    )
    output = capsys.readouterr().out
    plan = json.load(open(run_dir / "batch_plan.json"))
    assert (plan["micro_batch_size"], plan["accum_steps"], plan["remat"]) == (16, 1, "every")
    assert [p["fits"] for p in plan["probes"]] == [True] * 4 + [False]  # 1, 2, 4, 8 | 16
    assert plan["probes"][-1]["over_budget"]
    assert [(p["micro_batch_size"], p["fits"]) for p in plan["probes_with_recomputation"]] == [
        (8, True),
        (16, True),
    ]
    peak = plan["probes_with_recomputation"][-1]["peak_cpu_bytes"] / MIB
    line = (
        f"16 with recomputation (every block): 1 pass instead of 2 without; peak {peak:,.0f} MiB "
        f"of a {budget_mib} MiB budget"
    )
    why = "micro_batch_size=auto: the largest size, which fits with recomputation"
    assert f"micro-batch      {line}" in output and why in output, output
    assert "16  over budget" in output
    assert "every block of the model, in the backward pass (remat=every, chosen by" in output

    result = json.load(open(run_dir / "result.json"))
    assert (result["micro_batch_size"], result["accum_steps"], result["remat"]) == (16, 1, "every")
    choice = result["auto_batch"]
    assert (choice["passes"], choice["passes_without_recomputation"]) == (1, 2)
    assert choice["memory_budget_mib"] == budget_mib and choice["why"] == f"{line}; {why}"
    _, events = event_tags(str(run_dir))
    assert scalars(events, "batch/recompute") == [1.0]
    assert scalars(events, "batch/micro_size") == [16.0]


@pytest.mark.slow
def test_with_recomputation_off_the_choice_is_the_smaller_micro_batch(tmp_path, capsys, budget_mib):
    run_dir = tmp_path / "run"
    train(
        compose_config(*JOB, f"auto_batch.memory_budget_mib={budget_mib}", "auto_batch.remat=off"),
        str(run_dir),
        given=AUTO,
    )
    output = capsys.readouterr().out
    assert "8: 2 passes; recomputation not tried (auto_batch.remat=off); peak" in output, output
    result = json.load(open(run_dir / "result.json"))
    assert (result["micro_batch_size"], result["accum_steps"], result["remat"]) == (8, 2, None)
    assert not result["auto_batch"]["recomputation_tried"]
    _, events = event_tags(str(run_dir))
    assert scalars(events, "batch/recompute") == [0.0]


def test_a_budget_nothing_fits_says_what_to_type(tmp_path):
    with pytest.raises(ConfigError) as raised:
        train(
            # Wider blocks: one sample needs several MiB even with recomputation.
            compose_config(*JOB, "model.filters=[64,64,64]", "auto_batch.memory_budget_mib=1"),
            str(tmp_path / "run"),
            given=AUTO,
        )
    message = str(raised.value)
    assert message.startswith(
        "auto_batch.memory_budget_mib=1: not even a micro-batch of 1 fits the budget: even with "
        "recomputation (remat=every), its peak was "
    ), message
    assert "auto_batch.memory_budget_mib=null" in message and "\n" not in message


def test_a_resumed_run_keeps_the_recomputation_without_probing(tmp_path, monkeypatch):
    from gacli.runner.plan import auto_micro_batch

    os.makedirs(tmp_path / "run")
    saved = {"micro_batch_size": 16, "accum_steps": 1, "replicas": 1, "remat": "every"}
    (tmp_path / "run" / "batch_plan.json").write_text(json.dumps({**saved, "why": "test"}))
    monkeypatch.setattr(auto_micro_batch, "find_plan", lambda *a, **k: pytest.fail("probed"))
    cfg = compose_config(*JOB, "resume=true")
    plan, lines = settle_plan(cfg, AutoPlan(None, EFFECTIVE, 1), None, None, str(tmp_path / "run"))
    assert (plan.micro_batch_size, plan.accum_steps, plan.remat) == (16, 1, "every")
    assert lines["micro-batch"] == "16 with recomputation (every block), as before (test)"
