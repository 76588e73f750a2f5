"""The engine flags shared by `engine` (also `nemotron-engine`) and `up`, and the settings they set.

Standard library only: the `nemotron-gateway` parser imports it for every verb, so it must cost nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

# flag attribute -> field of the `engine` settings group
_FIELDS = {
    "model": "model",
    "profile": "profile",
    "preset": "preset",
    "served_model_name": "served_model_name",
    "engine_port": "port",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `engine` and `up` (each also an environment variable)."""
    parser.add_argument("--model", help="model directory or hub id (NEMOTRON_ENGINE__MODEL)")
    parser.add_argument("--profile", help="engine profile (NEMOTRON_ENGINE__PROFILE, default balanced)")
    parser.add_argument("--preset", help="model preset (NEMOTRON_ENGINE__PRESET, default generic)")
    parser.add_argument("--served-model-name", help="name clients send (NEMOTRON_ENGINE__SERVED_MODEL_NAME)")
    parser.add_argument("--engine-port", type=int, help="engine port on 127.0.0.1 (NEMOTRON_ENGINE__PORT)")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `engine` settings group fields the flags set."""
    return {field: getattr(args, flag) for flag, field in _FIELDS.items() if getattr(args, flag, None) is not None}
