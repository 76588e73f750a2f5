"""Run inside a venv with vLLM (scripts/install-vllm-check): its own plugin loader and argument parser over what the
gateway would hand it. Reads `{"argvs": [[flag, ...], ...]}` (each the flags after the launcher) on stdin and writes
one JSON object to the file named by its argument (vLLM logs on stdout):

- `plugins`: what `vllm.plugins.load_general_plugins()` left registered: whether `nemotron_json` is among vLLM's
  tool parsers, the class vLLM resolves that name to, and the calls that class reads out of a `<TOOLCALL>` block;
- `argvs`: for each argv, None where it passed what `vllm serve` runs before it loads a model (the parser of
  `make_arg_parser`, `validate_parsed_serve_args`, `validate_api_server_args`: the tool parser's name,
  `AsyncEngineArgs.from_cli_args`, the reasoning parser's name), else the error vLLM gave.

Imports vLLM, so never imported by the tests: they run it with the other venv's interpreter.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser, validate_api_server_args, validate_parsed_serve_args
from vllm.plugins import load_general_plugins
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser

TOOL_PARSER = "nemotron_json"
BLOCK = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'


def plugins() -> dict[str, Any]:
    """Load the general plugins as every vLLM process does, then what they registered."""
    load_general_plugins()
    registered = TOOL_PARSER in ToolParserManager.list_registered()
    found: dict[str, Any] = {"registered": registered, "class": None, "calls": None}
    if registered:
        parser_class = ToolParserManager.get_tool_parser(TOOL_PARSER)
        found["class"] = f"{parser_class.__module__}.{parser_class.__qualname__}"
        result = parser_class(tokenizer=object(), tools=None).extract_tool_calls(BLOCK, request=None)
        found["calls"] = [[call.function.name, json.loads(call.function.arguments)] for call in result.tool_calls]
    return found


def check(parser: FlexibleArgumentParser, argv: list[str]) -> str | None:
    """None where vLLM takes `argv`, else its complaint (argparse's message, or the validator's)."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
        validate_api_server_args(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        # The server checks the reasoning parser's name only once the engine merges it into its structured-outputs
        # config (a failed engine start, minutes later on a GPU): checked here the same way.
        reasoning = engine_args.create_structured_outputs_config().reasoning_parser
        if reasoning and reasoning not in ReasoningParserManager.list_registered():
            return f"invalid reasoning parser: {reasoning}"
    except SystemExit:  # argparse's refusal: its message went to stderr
        return errors.getvalue().strip().splitlines()[-1] if errors.getvalue().strip() else "exit"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> int:
    """Read the argvs, write the verdicts."""
    request = json.load(sys.stdin)
    found = plugins()
    # One parser for all (building it takes a second); argparse keeps nothing of one parse for the next.
    parser = make_arg_parser(FlexibleArgumentParser())
    answer = {"plugins": found, "argvs": [check(parser, list(argv)) for argv in request["argvs"]]}
    with open(sys.argv[1], "w") as out:
        json.dump(answer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
