"""MkDocs hooks of the documentation site (mkdocs.yml names this file).

The performance page links the benchmark results where the benchmarks write them, in
benchmarks/results/ beside the code, not a copy under docs/ that could drift: this hook adds
those files (reports, charts, and the diffs of variants of the engine that were measured and not
kept) to the site at the same relative place, so that docs/performance.md links
``benchmarks/results/mlp.md`` and the built site has it.
"""

import os

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("benchmarks", "results")


def on_files(files, config):
    for name in sorted(os.listdir(os.path.join(ROOT, RESULTS))):
        if name.endswith((".md", ".png", ".patch")):
            path = f"{RESULTS}/{name}"
            files.append(File(path, ROOT, config["site_dir"], config["use_directory_urls"]))
    return files
