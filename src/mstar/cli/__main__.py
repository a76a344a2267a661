"""`python -m mstar.cli`: the `mstar` command."""

import sys

from mstar.cli import main

sys.exit(main())
