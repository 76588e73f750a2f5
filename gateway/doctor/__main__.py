"""`python -m gateway.doctor`: the preflight doctor alone, settings from the environment."""

from gateway.doctor.cli import main

raise SystemExit(main())
