"""``python -m gacli.report``: the same as ``ga-report``."""

import sys

from gacli.report.cli import main

sys.exit(main())
