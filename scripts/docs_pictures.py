"""Redraw the site's pictures from real runs of this code, into docs/images/.

    python scripts/docs_pictures.py              # about 5 minutes on a 2-core CPU
    python scripts/docs_pictures.py --no-tensorboard

It runs the sweep the TensorBoard and ga-report guide shows (the UNet recipe as shipped, with
accum_steps=1,2,4,8, one job after another), then:

- ``ga-report`` on it: its table as a 240-column terminal prints it (``report_table.txt``, which
  the guide includes) and its three plots (``report_validation.png``, ``report_speed_memory.png``,
  ``report_loss_time.png``);
- the gradient noise scale over training of its accum_steps=4 job, which is the recipe's own
  ``ga-train config=unet.yaml`` (``unet_noise_scale.png``, by ``benchmarks/gns_plot.py``);
- TensorBoard on the sweep (``tensorboard --logdir``), its scalar cards screenshotted by headless
  Chromium (``tensorboard_scalars.png``; skipped, saying so, where no Chromium is installed:
  ``apt-get install chromium``).

It prints the figures the pages quote beside the pictures (final val IoU per job, the noise
scale's first and last value), so that the text can say what the picture shows.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
SWEEP = ["-m", "config=unet.yaml", "accum_steps=1,2,4,8", "progress=none"]
REPORT_PLOTS = ("validation", "speed_memory", "loss_time")


def environment():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", COLUMNS="240")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def run(command, cwd):
    """Run ``command`` in ``cwd``; its output, or SystemExit with it when the command fails."""
    print("$", " ".join(command), flush=True)
    result = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}"
        )
    return result.stdout


def sweep(work):
    """The sweep's directory, after running it in ``work``."""
    run(["ga-train", *SWEEP, "hydra.sweep.dir=sweep"], work)
    return work / "sweep"


def report(sweep_dir, images):
    """ga-report's table (as text) and plots, copied into ``images``."""
    table = run(["ga-report", str(sweep_dir)], sweep_dir.parent)
    lines = table.rstrip("\n").splitlines()
    written = next(i for i, line in enumerate(lines) if line.startswith("wrote "))
    (images / "report_table.txt").write_text("\n".join(lines[:written]).rstrip() + "\n")
    for name in REPORT_PLOTS:
        shutil.copyfile(sweep_dir / f"{name}.png", images / f"report_{name}.png")
    rows = json.loads((sweep_dir / "report.json").read_text())["runs"]
    for row in rows:
        print(f"  accum_steps={row.get('accum_steps')}: val_iou {row.get('val_iou')}")


def noise_scale(sweep_dir, images):
    """The accum_steps=4 job's noise scale over training (benchmarks/gns_plot.py)."""
    (job,) = [path for path in sweep_dir.iterdir() if path.name.startswith("2_accum_steps=4")]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gns_plot

    title = "ga-train config=unet.yaml: the gradient noise scale over training"
    steps, noise, effective = gns_plot.plot(job, images / "unet_noise_scale.png", title)
    print(
        f"  noise scale over {len(steps)} updates: first {noise[0]:.3g}, last {noise[-1]:.3g}, "
        f"max {max(noise):.3g}; effective batch {effective:g}"
    )


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def chromium():
    return next(
        (shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None
    )


def screenshot(browser, url, out, size="1400,1000"):
    """A headless Chromium screenshot of ``url`` into ``out`` (scripts may run for 15 s)."""
    with tempfile.TemporaryDirectory() as profile:
        command = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            "--virtual-time-budget=15000",
            f"--screenshot={out}",
            url,
        ]
        subprocess.run(command, capture_output=True, timeout=180, check=True)


def tensorboard_cards(sweep_dir, images):
    """TensorBoard's scalar cards of the sweep, as a browser shows them."""
    browser = chromium()
    if browser is None:
        print("  no Chromium: tensorboard_scalars.png not redrawn (apt-get install chromium)")
        return
    port = free_port()
    server = subprocess.Popen(
        # The logdir relative to where TensorBoard runs: the page shows it, not this machine's path.
        ["tensorboard", "--logdir", sweep_dir.name, "--host", "127.0.0.1", f"--port={port}"],
        cwd=sweep_dir.parent,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "data/runs", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        filtered = url + "?darkMode=false#scalars&tagFilter=val%2F%7Ctrain%2F&_smoothingWeight=0"
        screenshot(browser, filtered, images / "tensorboard_scalars.png", size="1400,900")
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tensorboard", action="store_true", help="skip the screenshot")
    parser.add_argument("--work", help="a directory to run in (default: a new temporary one)")
    arguments = parser.parse_args(argv)
    IMAGES.mkdir(parents=True, exist_ok=True)
    work = Path(arguments.work or tempfile.mkdtemp(prefix="gacli-pictures-"))
    work.mkdir(parents=True, exist_ok=True)
    sweep_dir = work / "sweep" if (work / "sweep" / "multirun.yaml").exists() else sweep(work)
    report(sweep_dir, IMAGES)
    noise_scale(sweep_dir, IMAGES)
    if not arguments.no_tensorboard:
        tensorboard_cards(sweep_dir, IMAGES)
    print(f"pictures in {IMAGES.relative_to(ROOT)}; the runs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
