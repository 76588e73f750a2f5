"""The `nemotron_json` tool parser on text: whole outputs and streams cut at every point (partial tags, several
calls, malformed JSON), against the installed vLLM's ToolParser API; and the plugin registering it."""

from __future__ import annotations

import json
import random
import warnings
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the cpu or gpu extra (vLLM) is not installed")

# Importing vLLM's tool parsers imports torch, which warns about its own deprecations (the suite makes warnings
# errors); they are torch's business, not this parser's.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.tool_parsers import ToolParserManager

    from engine_patches import plugin
    from engine_patches.toolcall import NemotronJsonToolParser

pytestmark = pytest.mark.timeout(60)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}


def block(*calls: dict[str, Any]) -> str:
    return f"<TOOLCALL>{json.dumps(list(calls))}</TOOLCALL>"


def parser() -> NemotronJsonToolParser:
    return NemotronJsonToolParser(tokenizer=object(), tools=None)


def whole(text: str) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    result = parser().extract_tool_calls(text, request=None)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls]
    assert result.tools_called == bool(calls)
    assert all(c.id and c.type == "function" for c in result.tool_calls)
    return result.content, calls


def streamed(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Feed `text` in pieces cut at `cuts`, as vLLM does; join the content and the calls that came out."""
    p = parser()
    content, calls, previous = "", [], ""
    indexes: list[int] = []
    for end in [*sorted(cuts), len(text)]:
        current = text[:end]
        if current == previous:
            continue
        delta = p.extract_tool_calls_streaming(previous, current, current[len(previous) :], [], [], [], request=None)
        previous = current
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            assert call.id and call.type == "function"
            indexes.append(call.index)
            calls.append((call.function.name, json.loads(call.function.arguments)))
    assert indexes == list(range(len(indexes)))
    # What vLLM appends at the end of a stream: nothing left unstreamed.
    assert p.get_remaining_unstreamed_args() == ""
    return content, calls


def every_cut(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    return [list(range(1, len(text))), [], *[rng.sample(range(1, len(text)), k=5) for _ in range(20)]]


CASES = [
    ("one call", block(WEATHER), None, [WEATHER]),
    ("text first", "Let me check.\n" + block(WEATHER), "Let me check.", [WEATHER]),
    ("two in one list", block(WEATHER, TIME), None, [WEATHER, TIME]),
    ("two blocks", block(WEATHER) + "\n" + block(TIME), None, [WEATHER, TIME]),
    ("no closing tag", f"<TOOLCALL>{json.dumps([WEATHER])}", None, [WEATHER]),
    (
        "arguments as a JSON string",
        '<TOOLCALL>[{"name": "f", "arguments": "{\\"a\\": 1}"}]</TOOLCALL>',
        None,
        [{"name": "f", "arguments": {"a": 1}}],
    ),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[c[0] for c in CASES])
def test_whole_output(name: str, text: str, content: str | None, calls: list[dict[str, Any]]) -> None:
    assert whole(text) == (content, [(c["name"], c["arguments"]) for c in calls])


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[c[0] for c in CASES])
def test_stream_cut_anywhere_gives_the_same_calls(
    name: str, text: str, content: str | None, calls: list[dict[str, Any]]
) -> None:
    for cuts in every_cut(text):
        got_content, got_calls = streamed(text, cuts)
        assert got_calls == [(c["name"], c["arguments"]) for c in calls], cuts
        assert got_content.strip() == (content or ""), cuts


@pytest.mark.parametrize(
    "text",
    [
        "<TOOLCALL>[{'name': 'f'}]</TOOLCALL>",  # single quotes: not JSON
        '<TOOLCALL>[{"name": "f", "arguments": {"a": 1}</TOOLCALL>',  # unbalanced
        '<TOOLCALL>[{"arguments": {}}]</TOOLCALL>',  # no name
        "<TOOLCALL>[]</TOOLCALL>",
    ],
)
def test_malformed_blocks_stay_content(text: str) -> None:
    assert whole(text) == (text, [])
    for cuts in every_cut(text):
        assert streamed(text, cuts) == (text, []), cuts


def test_text_that_only_looks_like_the_tag_is_content() -> None:
    text = "Use <TOOLS> or <TOOL or <b>bold</b>."
    assert whole(text) == (text, [])
    for cuts in every_cut(text):
        assert streamed(text, cuts) == (text, []), cuts


def test_a_possible_tag_start_is_held_back_until_it_is_decided() -> None:
    p = parser()
    first = p.extract_tool_calls_streaming("", "Hi <TOOL", "Hi <TOOL", [], [], [], request=None)
    assert first is not None and first.content == "Hi "
    assert p.extract_tool_calls_streaming("Hi <TOOL", "Hi <TOOLCA", "CA", [], [], [], request=None) is None
    after = p.extract_tool_calls_streaming("Hi <TOOLCA", "Hi <TOOLCAT", "T", [], [], [], request=None)
    assert after is not None and after.content == "<TOOLCAT"


def test_the_plugin_registers_the_parser_under_the_model_cards_name(capfd: pytest.CaptureFixture[str]) -> None:
    plugin.register()
    # vLLM calls it before configuring its logging: the line must reach stderr by the plugin's own handler.
    assert "nemotron engine_patches loaded: tool parser nemotron_json (<TOOLCALL>" in capfd.readouterr().err
    assert "nemotron_json" in ToolParserManager.list_registered()
    assert ToolParserManager.get_tool_parser("nemotron_json") is NemotronJsonToolParser


def test_the_plugin_keeps_a_parser_vllm_ships_itself(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    builtin = type("Builtin", (NemotronJsonToolParser,), {})
    monkeypatch.setitem(ToolParserManager.tool_parsers, "nemotron_json", builtin)
    monkeypatch.setattr(ToolParserManager, "lazy_parsers", dict(ToolParserManager.lazy_parsers))
    ToolParserManager.lazy_parsers.pop("nemotron_json", None)
    plugin.register()
    assert ToolParserManager.get_tool_parser("nemotron_json") is builtin
    assert "tool parser nemotron_json: vLLM's own kept" in capfd.readouterr().err
