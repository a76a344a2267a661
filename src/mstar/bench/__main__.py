"""`python -m mstar.bench`: the same as `mstar bench`."""

from __future__ import annotations

from mstar.cli.bench import main

raise SystemExit(main())
