"""``python -m gacli.selfcheck``: gacli's own check of a machine's GPU (see
:mod:`gacli.runner.tools.selfcheck` and docs/guides/gpu.md)."""

import sys

from gacli.runner.tools.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
