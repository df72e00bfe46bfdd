"""micro_batch_size=auto: the probe's search and choice, and a probed run that ends with the
weights of a run given the chosen size by hand (GACLI_FAKE_OOM_ABOVE stands in for a device's
memory: the real tf.errors.ResourceExhaustedError, raised from inside the compiled step). On the
default job, where nothing runs out of memory, the sizes stop at the training set's bound."""

import glob
import json
import os
import re
import signal

import pytest

from gacli.runner.config.schema import ConfigError
from gacli.runner.plan.auto_micro_batch import Probe, choose, ladder, search
from gacli.runner.plan.batch import AutoPlan, resolve_batch
from gacli.runner.training.run import train
from helpers import (
    compose_config,
    final_weights,
    ga_train,
    record,
    run_dir_of,
    start_ga_train,
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
    # The margin comes off the first failure (0.9 x 48 = 43.2), not off 32, which ran.
    assert choose(probes, candidates, "largest", 0.1) == 32
    assert choose(probes, candidates, "largest", 0.4) == 24  # <= 0.6 x 48 = 28.8
    assert choose(probes, candidates, "fastest", 0.1) == 16  # 12+ all run at the same speed
    everything = search(fits_up_to(1000), candidates)
    # No failure: the largest of the sizes within 3% of the fastest (12 up run at one speed).
    assert choose(everything, candidates, "largest", 0.1) == 96
    assert choose(search(fits_up_to(0), candidates), candidates, "largest", 0.1) is None


@pytest.mark.slow  # about 20 s: out of the in-process lane
def test_auto_ends_with_the_weights_of_the_chosen_size_given_by_hand(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GACLI_FAKE_OOM_ABOVE", "40")
    probed = train(
        compose_config(*JOB, "micro_batch_size=auto", "effective_batch_size=128"),
        str(tmp_path / "auto"),
        given=AUTO,
    )
    output = capsys.readouterr().out
    record_ = json.load(open(tmp_path / "auto" / "batch_plan.json"))
    assert (record_["micro_batch_size"], record_["accum_steps"]) == (32, 4)
    assert {p["micro_batch_size"]: p["fits"] for p in record_["probes"]} == {
        1: True, 2: True, 4: True, 8: True, 16: True, 32: True, 64: False
    }  # fmt: skip
    # The fault counts samples, not memory: recomputation is tried and fits no larger size.
    assert (
        "32: 4 passes; with recomputation (every block) no micro-batch that needs fewer fits"
        in (output)
    )
    assert (
        "micro_batch_size=auto: the largest that fits, at most 90% of the first size that failed "
        "(64)" in output
    )
    assert [p["fits"] for p in record_["probes_with_recomputation"]] == [True, False]
    # On a CPU the peaks are TensorFlow's CPU allocator's (docs/guides/batch-probe.md).
    assert "micro-batch  result         samples/s  peak CPU memory" in output
    assert "64  out of memory" in output
    result = json.load(open(tmp_path / "auto" / "result.json"))
    assert (result["micro_batch_size"], result["accum_steps"]) == (32, 4)

    monkeypatch.delenv("GACLI_FAKE_OOM_ABOVE")
    by_hand = train(
        compose_config(*JOB, "micro_batch_size=32", "accum_steps=4"), str(tmp_path / "hand")
    )
    assert probed == by_hand  # every final metric
    hand = json.load(open(tmp_path / "hand" / "result.json"))
    assert result["weights_sha256"] == hand["weights_sha256"]


def test_a_resumed_run_keeps_the_probed_size_without_probing(tmp_path, monkeypatch):
    from gacli.runner.plan import auto_micro_batch as autobatch_module

    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    saved = {"micro_batch_size": 8, "accum_steps": 16, "replicas": 1, "why": "test"}
    (run_dir / "batch_plan.json").write_text(json.dumps(saved))
    monkeypatch.setattr(
        autobatch_module, "find_micro_batch_size", lambda *a, **k: pytest.fail("probed again")
    )
    cfg = compose_config(*JOB, "micro_batch_size=auto", "effective_batch_size=128", "resume=true")
    plan, lines = autobatch_module.settle_plan(
        cfg, AutoPlan(None, 128, 1), None, None, str(run_dir)
    )
    assert (plan.micro_batch_size, plan.accum_steps) == (8, 16)
    assert "as before" in lines["micro-batch"]


@pytest.mark.slow
@pytest.mark.distributed
def test_auto_under_two_replicas(tmp_path):
    """Per replica: the fault counts a replica's samples, so 2 x 16 fit where 2 x 32 do not, and
    the 10% margin off the failure (0.9 x 32) keeps 2 x 16."""
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
    assert (plan["micro_batch_size"], plan["accum_steps"]) == (16, 4)
    assert [p["fits"] for p in plan["probes"]] == [True] * 5 + [False]  # 1..16 run, 32 does not
    code, output = ga_train(*arguments, "micro_batch_size=16", cwd=tmp_path)
    assert code == 0, output
    measured = record(
        weights_difference(final_weights(probed), final_weights(run_dir_of(output))),
        "test_auto_under_two_replicas (auto vs by hand)",
    )
    assert measured == 0.0


def test_the_issues_example_keeps_32_where_48_is_the_ceiling():
    """GACLI_FAKE_OOM_ABOVE=48, effective_batch_size=256: 32 runs and 64 does not, and no divisor
    of 256 lies between them, so 32 (0.9 x 64 = 57.6), not 16."""
    candidates = AutoPlan(None, 256, 1).candidates(256)
    probes = search(fits_up_to(48), candidates)
    assert max(size for size, probe in probes.items() if probe.fits) == 32
    assert choose(probes, candidates, "largest", 0.1) == 32


def test_where_peak_memory_is_measured_the_margin_is_taken_off_memory():
    """Sizes up to 50 (accum_steps kept); 45 runs, 46 does not. Off the size, the margin allows
    0.9 x 46 = 41.4; off the memory, with a fixed 9,000 bytes besides 100 bytes a sample, it allows
    sizes needing at most 0.9 x 13,600 bytes: 32.4 samples."""
    candidates = AutoPlan(4, None, 1).candidates(50)

    def measured(fixed):
        def probe(size):
            fits = size <= 45
            return Probe(size, fits, 1000.0, fixed + 100 * size if fits else None)

        return search(probe, candidates)

    assert choose(search(fits_up_to(45), candidates), candidates, "largest", 0.1) == 41
    assert choose(measured(9000), candidates, "largest", 0.1) == 32
    assert choose(measured(0), candidates, "largest", 0.1) == 41  # memory in proportion: the same


def test_with_nothing_out_of_memory_largest_prefers_the_fastest_within_a_few_percent():
    candidates = [8, 16, 32, 64]
    speeds = {8: 500.0, 16: 1000.0, 32: 1020.0, 64: 900.0}
    probes = {size: Probe(size, True, speed) for size, speed in speeds.items()}
    assert choose(probes, candidates, "largest", 0.1) == 32  # 64 is 12% slower than 32
    probes[64] = Probe(64, True, 1000.0)  # 2% slower: as fast, and larger
    assert choose(probes, candidates, "largest", 0.1) == 64
    from gacli.runner.config.schema import AutoBatchConfig
    from gacli.runner.plan.auto_micro_batch import Choice, probe_lines

    plan = AutoPlan(None, 64, 1)
    (why, header, *rows) = probe_lines(Choice(64, probes), plan, AutoBatchConfig())
    assert "nothing ran out of memory, so the largest size within 3% of the fastest" in why
    assert header.split() == ["micro-batch", "result", "samples/s", "peak", "device", "memory"]


def test_the_sizes_are_bounded_by_the_data_and_the_noise_scale_before_probing():
    from gacli.runner.plan.auto_micro_batch import auto_candidates

    cfg = compose_config("micro_batch_size=auto", "effective_batch_size=128")
    plan = AutoPlan(None, 128, 1)
    assert auto_candidates(cfg, plan, 1438)[0][-1] == 128
    gns = compose_config("micro_batch_size=auto", "effective_batch_size=128", "monitor.gns=true")
    candidates, bounds = auto_candidates(gns, plan, 1438)
    assert candidates[-1] == 64 and "monitor.gns needs two or more micro-batches" in bounds[0]
    kept = AutoPlan(4, None, 1)  # accum_steps kept: 1617 samples / 4
    candidates, bounds = auto_candidates(cfg, kept, 1617)
    assert candidates[-1] == 404 and "1617 training samples / accum_steps 4" in bounds[0]
    with pytest.raises(ConfigError, match="effective_batch_size = 6468 is larger than the train"):
        auto_candidates(cfg, AutoPlan(None, 6468, 1), 1617)


@pytest.mark.slow
def test_a_run_that_stops_on_its_input_before_probing_leaves_no_directory(tmp_path):
    code, output = ga_train("micro_batch_size=auto", "effective_batch_size=4096", cwd=tmp_path)
    assert code == 2 and "Traceback" not in output, output
    assert "ga-train: effective_batch_size = 4096 is larger than the training set" in output
    assert "fits" not in output  # nothing probed
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"


@pytest.mark.slow
def test_sigterm_while_probing_ends_with_143_one_line_and_no_directory(tmp_path):
    # Many timed calls a size: the probe is still running when the signal comes.
    process = start_ga_train(
        "micro_batch_size=auto",
        "effective_batch_size=1024",
        "auto_batch.timed_calls=2000",
        cwd=tmp_path,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("micro-batch  result"):
            break
    process.send_signal(signal.SIGTERM)
    output = "".join(lines) + process.communicate(timeout=120)[0]
    assert process.returncode == 128 + signal.SIGTERM, output
    said = [line for line in output.splitlines() if line.startswith("ga-train:")]
    assert said == [
        "ga-train: stopped by SIGTERM while micro_batch_size=auto was probing micro-batch sizes: "
        "nothing was trained, and the run directory is removed. Run the same command again to "
        "start over."
    ], output
    assert not glob.glob(str(tmp_path / "outputs" / "*" / "*")), "the run's directory is removed"


@pytest.mark.slow
def test_micro_batch_size_auto_on_the_default_job_fits_the_training_set(tmp_path):
    code, output = ga_train("micro_batch_size=auto", "epochs=1", "progress=none", cwd=tmp_path)
    assert code == 0, output[-3000:]
    # Nothing runs out of memory on a CPU: the choice is the largest size as fast as the fastest
    # (docs/guides/batch-probe.md), so it moves with the timings; its bound does not.
    assert "sizes up to 359: 1438 training samples / accum_steps 4" in output, output
    assert "        359  fits" in output and "        360  " not in output
    (effective, micro) = re.search(
        r"effective batch  (\d+) = micro_batch_size (\d+) x accum_steps 4", output
    ).groups()
    assert 1 <= int(micro) <= 359 and int(effective) == 4 * int(micro)
