"""`python -m gateway.supervisor`: the engine supervisor in the foreground, without loading the HTTP app."""

import sys

from gateway.supervisor.cli import main

sys.exit(main())
