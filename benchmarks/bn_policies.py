"""Batch-norm policies on the UNet recipe: final val IoU and wall time, by policy and accum_steps.

Each cell is one ``ga-train config=unet.yaml accum_steps=k batchnorm=<policy>`` run in a fresh
process (the recipe is seeded, so a run is deterministic). ``big_batch_<policy>`` is the same
effective batch without accumulation, ``accum_steps=1 micro_batch_size=8k batchnorm=<policy>``
(``big_batch_keep``: plain Keras BN on the big batch).

    python benchmarks/bn_policies.py [--policies keep precise big_batch_keep ...] [--k 4 8 16]

Results go to ``benchmarks/results/bn_policies.{md,json}`` (``--out`` renames them); cells already
in the JSON file are kept, so a run can add policies to an earlier one.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MICRO_BATCH_SIZE = 8  # the recipe's


def overrides(policy, k):
    if policy.startswith("big_batch_"):
        return [
            "accum_steps=1",
            f"micro_batch_size={MICRO_BATCH_SIZE * k}",
            f"batchnorm={policy[len('big_batch_') :]}",
        ]
    return [f"accum_steps={k}", f"batchnorm={policy}"]


def run(policy, k, extra):
    command = [
        os.path.join(os.path.dirname(sys.executable), "ga-train"),
        "config=unet.yaml",
        *overrides(policy, k),
        "progress=none",
        "checkpoint=false",
        *extra,
    ]
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        result = subprocess.run(
            command,
            cwd=directory,
            capture_output=True,
            text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        )
        seconds = time.perf_counter() - started
        if result.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")
        (found,) = Path(directory).glob("outputs/*/*/result.json")
        final = json.loads(found.read_text())
    return {
        "policy": policy,
        "k": k,
        "command": " ".join(command[1:]),
        "val_iou": final["val_iou"],
        "train_iou": final["iou"],
        "seconds": round(seconds, 1),
    }


def table(cells, policies, ks):
    by_key = {(cell["policy"], cell["k"]): cell for cell in cells}
    lines = [
        "| policy | " + " | ".join(f"k={k}: val IoU, time" for k in ks) + " |",
        "|---|" + "---:|" * len(ks),
    ]
    for policy in policies:
        row = []
        for k in ks:
            cell = by_key.get((policy, k))
            row.append("" if cell is None else f"{cell['val_iou']:.3f}, {cell['seconds']:.0f} s")
        lines.append(f"| {policy} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["keep", "accumulate", "precise", "big_batch_keep", "big_batch_precise"],
    )
    parser.add_argument("--k", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--out", default="bn_policies")
    parser.add_argument("extra", nargs="*", help="more ga-train overrides for every run")
    args = parser.parse_args()
    path = RESULTS / f"{args.out}.json"
    cells = json.loads(path.read_text()) if path.exists() else []
    for policy in args.policies:
        for k in args.k:
            cell = run(policy, k, args.extra)
            cells = [c for c in cells if (c["policy"], c["k"]) != (policy, k)] + [cell]
            print(json.dumps(cell), flush=True)
            path.write_text(json.dumps(cells, indent=2) + "\n")
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    ks = sorted({c["k"] for c in cells})
    (RESULTS / f"{args.out}.md").write_text(
        "UNet recipe (`ga-train config=unet.yaml`), final val IoU and wall time of the whole "
        "command, by batch-norm policy and accum_steps k (micro-batch 8, effective batch 8k; "
        "`big_batch_<policy>`: accum_steps=1, micro_batch_size=8k).\n\n"
        + table(cells, policies, ks)
        + "\n"
    )


if __name__ == "__main__":
    main()
