"""`python -m gateway.supervisor`: the engine command (`nemotron-engine`), without loading the HTTP app."""

import sys

from gateway.cli import engine_main

sys.exit(engine_main())
