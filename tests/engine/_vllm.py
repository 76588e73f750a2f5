"""The tiny demo model for tests/engine, written once into the repo's .cache and reused while unchanged."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import shutil
import tempfile
from pathlib import Path

from tools import demo_model

_STAMP = ".demo-model-source"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def ensure_demo_model(cache_root: Path) -> Path:
    """`cache_root/demo-model`, written once and rewritten only when tools/demo_model.py changes."""
    target = cache_root / "demo-model"
    source = Path(demo_model.__file__).read_bytes()
    stamp = hashlib.sha256(source).hexdigest()
    if (target / _STAMP).is_file() and (target / _STAMP).read_text() == stamp:
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent test run never sees a half-written model.
    building = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=cache_root))
    demo_model.write_demo_model(building)
    (building / _STAMP).write_text(stamp)
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=".demo-model-stale-", dir=cache_root))
        with contextlib.suppress(FileNotFoundError):
            target.rename(stale / "model")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        building.rename(target)
    except OSError:  # another run renamed its copy first: use that one
        shutil.rmtree(building, ignore_errors=True)
    return target
