"""`python -m tools.vllm_flags`: write the flag list of the installed vLLM into the gateway's shipped lists
(`gateway/engine/vllm_flags/<distribution-version>.txt`), read from its server's `--help=all`.

The supervisor checks every flag of the engine's command line against that list before the slow start. Without a
shipped list for the installed release it reads the help itself on the first start (15-35 s on a CPU machine, all of
vLLM imported) and caches it in the state dir; with one, a fresh machine starts the engine that much sooner. Run this
after changing the vLLM the project pins (`pyproject.toml`'s `cpu` extra); the tests hold the pinned CPU build's
list to what its help says.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from gateway.engine.launch import SHIPPED_FLAG_LISTS, installed_vllm, read_flag_list

# The shipped lists, in this source tree.
SHIPPED_DIR = Path(str(resources.files("gateway.engine").joinpath(SHIPPED_FLAG_LISTS)))


def main(argv: Sequence[str] | None = None) -> int:
    """Write the installed vLLM's flag list; print its path."""
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_flags", description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter that has vLLM (default: this one)")
    parser.add_argument(
        "--out", type=Path, default=SHIPPED_DIR, help=f"the folder to write it to (default: {SHIPPED_DIR})"
    )
    args = parser.parse_args(argv)
    version, launcher = installed_vllm(args.python)
    path = args.out / f"{version}.txt"
    path.write_text(read_flag_list(launcher, version) + "\n")
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
