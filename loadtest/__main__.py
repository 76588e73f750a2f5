"""`python -m loadtest`: the load tool's command line (see loadtest/cli.py)."""

from loadtest.cli import main

raise SystemExit(main())
