"""benchmarks/bench.py runs end to end on tiny models and writes its three reports.

Only the structure is checked: speed targets are measured by a full run, never asserted in tests.
"""

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
CONFIGS = ["A", "gacli_model", "ga_train"]  # a library path, the model wrapper and the CLI


@pytest.mark.slow
def test_quick_benchmark_writes_table_json_and_chart(tmp_path):
    command = [
        sys.executable,
        str(BENCH),
        "--quick",
        "--reps",
        "1",
        "--models",
        "mlp",
        "--jit",
        "off",
        "--configs",
        *CONFIGS,
        "--results-dir",
        str(tmp_path),
        "--out",
        "smoke",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    raw = json.loads((tmp_path / "smoke.json").read_text())
    assert [run["config"] for run in sorted(raw["runs"], key=lambda r: r["config"])] == sorted(
        CONFIGS
    )
    for run in raw["runs"]:
        assert run["status"] == "ok", run.get("error")
        assert run["samples"] == raw["runs"][0]["samples"]  # equal work in the timed window
        assert run["params"] == raw["runs"][0]["params"]
        assert run["peak_rss_bytes"] > 0 and run["wall_s"] > 0
        # The process's peak covers the warm-up (trace, compile) and the timed window.
        assert run["window_peak_rss_bytes"] > 0
        assert run["peak_rss_bytes"] >= max(
            run["warmup_peak_rss_bytes"], run["window_peak_rss_bytes"]
        )
    spec = raw["meta"]["models"]["mlp"]
    updates = {run["config"]: run["updates_in_window"] for run in raw["runs"]}
    assert updates == {
        "A": spec["measure_updates"] * spec["accum_steps"],
        "gacli_model": spec["measure_updates"],
        "ga_train": spec["measure_updates"],
    }
    assert sorted(s["kind"] for s in raw["startup"]) == ["config_error", "help"]
    assert {s["kind"]: s["returncode"] for s in raw["startup"]} == {"help": 0, "config_error": 2}

    table = (tmp_path / "smoke.md").read_text()
    assert "| ga-train (CLI) |" in table and "| gacli wrap_model |" in table
    assert "## Targets" in table and "MLP, jit off: gacli samples/s >= 0.75x B" in table
    assert "ga-train --help < 2 s" in table
    if find_spec("matplotlib") is not None:
        assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "pip install -e '.[benchmark]'" in done.stderr


@pytest.mark.slow
def test_configurations_taking_turns_time_the_same_window(tmp_path):
    """--turns: the configurations of a repetition train side by side, one at a time; each is
    timed over its own turns, which cover its whole timed window."""
    configs = ["A", "A_again", "ga_train"]
    command = [sys.executable, str(BENCH), "--quick", "--reps", "1", "--models", "mlp"]
    command += ["--jit", "off", "--turns", "2", "--configs", *configs]
    command += ["--results-dir", str(tmp_path), "--out", "turns"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    raw = json.loads((tmp_path / "turns.json").read_text())
    assert raw["meta"]["turns"] == 2
    spec = raw["meta"]["models"]["mlp"]
    runs = {run["config"]: run for run in raw["runs"]}
    assert sorted(runs) == sorted(configs)
    for run in runs.values():
        assert run["status"] == "ok", run.get("error")
        assert run["samples"] == runs["A"]["samples"] and run["wall_s"] > 0
        # A turn at the window's start, then one every 2 updates but the window's last.
        assert run["turns"] == spec["measure_updates"] // 2
    assert runs["A_again"]["updates_in_window"] == runs["A"]["updates_in_window"]
    assert "took turns" in (tmp_path / "turns.md").read_text()


@pytest.mark.slow
def test_rss_phases_prints_every_phase_of_every_configuration(tmp_path):
    script = BENCH.parent / "rss_phases.py"
    command = [
        sys.executable,
        str(script),
        "--quick",
        "--reps",
        "1",
        "--models",
        "mlp",
        "--jit",
        "off",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == [
        "A: fit, batch b",
        "C: Keras gradient_accumulation_steps",
        "gacli wrap_model",
        "gacli GradientAccumulateOptimizer",
    ]
    for row in rows:
        start, first, held, live, window, freed = (
            float(cell.replace(",", "")) for cell in row.split("|")[2:8]
        )
        # (Other threads allocate between the reads: only orderings that cannot race are checked.)
        assert 0 < start <= first and held > 0 and live > 0 and window > 0
        assert abs(freed - (held - live)) <= 1  # each cell rounded on its own


def _run_at_commit(tmp_path, old, configs):
    """(raw results, table) of bench.py --quick running ``configs`` once, with --commit ``old``
    (skipped where the clone lacks it: a shallow clone)."""
    repository = BENCH.parents[1]
    if subprocess.run(["git", "-C", str(repository), "cat-file", "-e", old]).returncode != 0:
        pytest.skip(f"commit {old} is not in this clone's history (a shallow clone)")
    command = [sys.executable, str(BENCH), "--quick", "--reps", "1", "--models", "mlp"]
    command += ["--jit", "off", "--turns", "2", "--configs", *configs]
    command += ["--commit", old, "--results-dir", str(tmp_path), "--out", "at"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp_path / "at.json").read_text()), (tmp_path / "at.md").read_text()


@pytest.mark.slow
def test_ga_train_at_an_earlier_commit_runs_that_commits_gacli(tmp_path):
    """ga_train_at --commit REV: ga-train as the engine at REV ran it, from a git worktree made
    for the run and forgotten after it; REV here is from before the runner had its own package
    (gacli.cli, gacli.train), the oldest layout the benchmark reads."""
    repository = BENCH.parents[1]
    old = "3d13afc"
    raw, table = _run_at_commit(tmp_path, old, ["ga_train", "ga_train_at"])
    assert raw["meta"]["commit"] == old
    runs = {run["config"]: run for run in raw["runs"]}
    assert runs["ga_train_at"]["status"] == "ok", runs["ga_train_at"].get("error")
    assert runs["ga_train_at"]["gacli_path"].endswith("/at_commit/gacli")
    assert not runs["ga_train"]["gacli_path"].endswith("/at_commit/gacli")
    assert runs["ga_train_at"]["samples"] == runs["ga_train"]["samples"]
    assert f"ga_train_at and ga_train_gns_at ran gacli at commit {old}." in table
    assert "ga-train no slower than at --commit (ga_train / ga_train_at >= 1.00)" in table
    worktrees = subprocess.run(
        ["git", "-C", str(repository), "worktree", "list"], capture_output=True, text=True
    ).stdout
    tree = str(Path(runs["ga_train_at"]["gacli_path"]).parent)
    assert tree not in worktrees and not Path(tree).exists()


@pytest.mark.slow
def test_ga_train_gns_at_an_earlier_commit_measures_the_noise_scale_there(tmp_path):
    """ga_train_gns_at --commit REV: ga-train with monitor.gns as the engine at REV ran it,
    paired with today's ga_train_gns in the table's targets."""
    old = "33dc632"  # the noise scale's engine before |G_B|^2 came from the update's gradient
    raw, table = _run_at_commit(tmp_path, old, ["ga_train_gns", "ga_train_gns_at"])
    runs = {run["config"]: run for run in raw["runs"]}
    assert runs["ga_train_gns_at"]["status"] == "ok", runs["ga_train_gns_at"].get("error")
    assert runs["ga_train_gns_at"]["gacli_path"].endswith("/at_commit/gacli")
    assert not runs["ga_train_gns"]["gacli_path"].endswith("/at_commit/gacli")
    assert (
        "ga-train with monitor.gns no slower than at --commit "
        "(ga_train_gns / ga_train_gns_at >= 1.00)"
    ) in table


def test_ga_train_at_needs_a_commit_and_a_commit_needs_it(tmp_path):
    for words in (
        ["--configs", "ga_train_at"],
        ["--configs", "ga_train_gns_at"],
        ["--commit", "HEAD", "--configs", "ga_train"],
    ):
        done = subprocess.run(
            [sys.executable, str(BENCH), "--quick", *words],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2
        assert "ga_train_at or ga_train_gns_at and --commit REV go together" in done.stderr


def test_ga_train_at_with_a_commit_git_does_not_know_says_so(tmp_path):
    command = [sys.executable, str(BENCH), "--quick", "--reps", "1", "--models", "mlp"]
    command += ["--jit", "off", "--configs", "ga_train_at", "--commit", "no-such-revision"]
    command += ["--results-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "bench.py: --commit no-such-revision is not a commit of the repository" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing run, nothing written


def test_the_noise_scales_cost_is_set_beside_two_ga_train_processes():
    """ga_train_again (ga_train in a second process): the report gives the method's own spread
    (ga_train_again / ga_train) and ga_train_gns against each ga-train process and against both
    (their geometric mean), repetition by repetition; the arithmetic is checked here by hand."""
    sys.path.insert(0, str(BENCH.parent))
    import bench

    speeds = {  # repetition: (ga_train, ga_train_again, ga_train_gns) samples/s
        1: (100.0, 104.0, 98.0),
        2: (110.0, 99.0, 101.0),
        3: (90.0, 90.0, 89.0),
    }
    runs = [
        dict(rep=rep, model_key="mlp", jit=True, config=config, status="ok", samples_per_s=speed)
        for rep, row in speeds.items()
        for config, speed in zip(("ga_train", "ga_train_again", "ga_train_gns"), row)
    ]
    runs.append(  # a failed repetition pairs with nothing
        dict(rep=4, model_key="mlp", jit=True, config="ga_train_gns", status="failed")
    )
    lines = "\n".join(bench.control_report(runs, ["mlp"], [True]))
    spread = sorted(again / first for first, again, _ in speeds.values())
    both = sorted(gns / (first * again) ** 0.5 for first, again, gns in speeds.values())
    assert (
        f"| MLP, jit_compile=True: ga_train_again / ga_train (the method's spread) "
        f"| {spread[1]:.3f}x ({spread[0]:.3f}-{spread[2]:.3f}) | 3 | 2 of 3 >= 1.00 |"
    ) in lines
    assert (
        f"| MLP, jit_compile=True: ga_train_gns / both (geometric mean) "
        f"| {both[1]:.3f}x ({both[0]:.3f}-{both[2]:.3f}) | 3 | "
        f"{sum(b >= 0.97 for b in both)} of 3 >= 0.97 |"
    ) in lines
    assert "| MLP, jit_compile=True: ga_train_gns / ga_train | 0.980x (0.918-0.989) | 3 |" in lines
    # Without ga_train_again there is no such section.
    assert (
        bench.control_report([r for r in runs if r["config"] != "ga_train_again"], ["mlp"], [True])
        == []
    )


@pytest.mark.slow
def test_remat_memory_measures_every_mode_and_micro_batch(tmp_path):
    """benchmarks/remat_memory.py --quick: each (remat mode, micro-batch) of the tiny UNet in its
    own process, the same effective batch and samples for each, and the report's ratios."""
    script = BENCH.parent / "remat_memory.py"
    command = [sys.executable, str(script), "--quick", "--models", "unet"]
    command += ["--results-dir", str(tmp_path), "--out", "smoke"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    raw = json.loads((tmp_path / "smoke.json").read_text())
    spec = raw["meta"]["models"]["unet"]
    runs = {(run["mode"], run["micro_batch_size"]): run for run in raw["runs"]}
    assert sorted(runs) == sorted(
        (mode, micro) for mode in spec["modes"] for micro in spec["micro_batch_sizes"]
    )
    for (_, micro), run in runs.items():
        assert run["status"] == "ok", run.get("error")
        assert micro * (spec["effective_batch_size"] // micro) == spec["effective_batch_size"]
        assert run["updates_in_window"] == spec["measure_updates"]
        assert run["samples"] == spec["measure_updates"] * spec["effective_batch_size"]
        # fit's peak is measured from the baseline on, and the process's covers it.
        assert 0 < run["baseline_rss_bytes"] <= run["warmup_peak_rss_bytes"]
        assert run["peak_rss_bytes"] >= run["window_peak_rss_bytes"] > 0
    table = (tmp_path / "smoke.md").read_text()
    small, large = spec["pair"]
    assert f"Memory that micro-batch {large} adds over {small}" in table
    assert "| every | " in table and "Largest micro-batch whose process peak fits" in table
