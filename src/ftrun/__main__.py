"""``python -m ftrun``."""

import sys

from ftrun.cli.main import main

sys.exit(main())
