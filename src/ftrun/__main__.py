"""``python -m ftrun``."""

import sys

from ftrun.cli import main

sys.exit(main())
