"""`python -m gateway`: the same as the `nemotron-gateway` console script."""

import sys

from gateway.cli import main

sys.exit(main())
