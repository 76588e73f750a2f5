"""A bounded hypothesis fuzz of both completion routes: any JSON body gets 200 or a 4xx envelope, never a 5xx.

Against the real gateway process and the fake engine on loopback, streams read to their end. Bodies are
either any JSON at all, or plausible requests whose every known field may hold any JSON value.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.procs import FakeEngineControl, ServerProcess, run_gateway

pytestmark = pytest.mark.timeout(300)

MODEL = "nemotron-test"
ROUTES = ("/v1/chat/completions", "/v1/completions")
FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

GATEWAY_ENV = {
    "NEMOTRON_AUTH__ENABLED": "false",
    "NEMOTRON_MODEL_ALIASES": '["nemotron"]',
    # A small context keeps the fake engine's answers short (it generates max_tokens tokens).
    "NEMOTRON_CONTEXT_LENGTH": "64",
}

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Nesting that orjson parses but will not serialise again (~254 levels).
deep_values = st.integers(min_value=250, max_value=1000).map(lambda depth: {"deep": _nested(depth)})

_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "User", ""]) | json_values},
        optional={"content": st.text(max_size=20) | json_values, "name": json_values, "tool_calls": json_values},
    ),
    max_size=4,
)
_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "echo",
    "suffix",
    "user",
    "tools",
    "response_format",
)
_field_values = st.integers(min_value=-5, max_value=70) | st.booleans() | json_values
plausible = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "nemotron", "other"]) | json_values},
    optional={
        "messages": _messages | json_values,
        "prompt": st.text(max_size=20)
        | st.lists(st.integers(min_value=-3, max_value=2**32), max_size=4)
        | st.lists(st.lists(st.integers(min_value=-1, max_value=100), max_size=3), max_size=3)
        | json_values,
        "stream": st.booleans(),
        **dict.fromkeys(_FIELDS, _field_values),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
    },
)
bodies = json_values | plausible | deep_values


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _encode(body: Any) -> bytes:
    # Deep bodies are written by hand: orjson refuses to serialise the very nesting they must carry.
    return orjson.dumps(body) if not isinstance(body, dict) or "deep" not in body else _deep_json(body)


def _deep_json(body: dict[str, Any]) -> bytes:
    depth = 0
    value = body["deep"]
    while isinstance(value, list):
        depth += 1
        value = value[0]
    return b'{"model": "%s", "prompt": "x", "messages": [], "deep": %s0%s}' % (
        MODEL.encode(),
        b"[" * depth,
        b"]" * depth,
    )


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[ServerProcess]:
    with run_gateway(fake_engine.base_url, redis_url, env=GATEWAY_ENV) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as http:
        yield http


def _check(client: httpx.Client, route: str, raw: bytes) -> None:
    with client.stream("POST", route, content=raw, headers={"Content-Type": "application/json"}) as response:
        answer = response.read()
    status = response.status_code
    assert status < 500, f"{route} answered {status} to {raw[:300]!r}: {answer[:300]!r}"
    if status != 200:
        error = orjson.loads(answer)["error"]
        assert set(error) == {"message", "type", "param", "code"}, answer


@FUZZ
@given(body=bodies, route=st.sampled_from(ROUTES))
def test_any_json_body_gets_200_or_a_4xx_envelope(
    client: httpx.Client, gateway: ServerProcess, body: Any, route: str
) -> None:
    _check(client, route, _encode(body))


def test_a_valid_request_is_served_by_this_setup(client: httpx.Client, fake_engine: FakeEngineControl) -> None:
    # Else every fuzz example could pass by being refused (an engine that is not ready answers 503, though).
    answer = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 200
    assert fake_engine.requests()


@pytest.mark.parametrize(
    ("field", "value"),
    [("best_of", "x"), ("best_of", [1]), ("logit_bias", "x"), ("logit_bias", {"1": "x"})],
    ids=repr,
)
@pytest.mark.parametrize("route", ROUTES)
def test_a_wrong_type_in_a_field_the_gateway_reads_is_a_400_naming_it(
    client: httpx.Client, route: str, field: str, value: Any
) -> None:
    # Before: `best_of` was not declared for chat, so "x" reached the choice cap's comparison: a 500.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "prompt": "x", field: value}
    answer = client.post(route, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(field), error
