"""The vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): what current vLLM still lacks
for Nemotron, registered the supported way instead of edits to site-packages.

vLLM calls `register()` once in every process it starts (API server, engine core, workers) before it parses its
flags, so `--tool-call-parser nemotron_json` passes vLLM's own check. Each patch is applied only where the
installed vLLM lacks it, and one log line says what was applied. Imports vLLM only.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from vllm.tool_parsers import ToolParserManager

__all__ = ["TOOL_PARSER", "register"]

# The name NVIDIA's model card and vLLM's cookbook use for the <TOOLCALL> format (vLLM issue #42065).
TOOL_PARSER = "nemotron_json"
# Where our parser lives, for vLLM's lazy registry: module path and class name.
_OWN_PARSER = ("engine_patches.toolcall", "NemotronJsonToolParser")
logger = logging.getLogger("engine_patches")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]  # generic only in typeshed, not at run time
    """Writes each record to the `sys.stderr` of that moment, not the one the handler was made with: a process that
    replaces `sys.stderr` after the plugin first loaded (a test's output capture, a redirecting launcher) still
    gets the line."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        """StreamHandler.__init__ assigns the stream; the property above ignores it."""


def _announce(message: str) -> None:
    """One INFO line on stderr. vLLM loads plugins while it builds its argument parser, before it configures its
    own logging, so a line sent through vLLM's loggers there would be dropped (Python's last-resort handler shows
    warnings only); the plugin's logger has a handler of its own instead."""
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("INFO %(asctime)s [engine_patches] %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.info("%s", message)


def register() -> None:
    """Register what the installed vLLM lacks and log one line saying what that was."""
    applied: list[str] = []
    # A second call in one process (the doctor's in-process config check loads plugins too) finds our own lazy
    # entry: that is ours again, not a parser vLLM ships.
    ours = ToolParserManager.lazy_parsers.get(TOOL_PARSER) == _OWN_PARSER
    if TOOL_PARSER in ToolParserManager.list_registered() and not ours:
        applied.append(f"tool parser {TOOL_PARSER}: vLLM's own kept")
    else:
        # Lazy: the parser's module (and vLLM's protocol classes) load only when a server asks for it.
        ToolParserManager.register_lazy_module(TOOL_PARSER, *_OWN_PARSER)
        applied.append(f"tool parser {TOOL_PARSER} (<TOOLCALL>[...]</TOOLCALL>, Nemotron-Nano-9B-v2)")
    _announce("nemotron engine_patches loaded: " + "; ".join(applied))
