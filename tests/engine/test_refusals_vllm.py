"""What the relayed routes depend on in vLLM itself:
- where each route's engine reads a request's priority, from the installed vLLM's own request models (its Messages
  API has no `priority` field and reads the X-Vllm-Priority header);
- on the real `vllm serve` (CPU build, demo model) under `nemotron-gateway up`, vLLM's own error answers (its
  request validation answers OpenAI's envelope on every path) reach the Anthropic SDK in Anthropic's envelope.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import pytest

from gateway.api import SERVED
from gateway.api.relayed import PRIORITY_HEADER
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import running_up, up_settings
from tests.procs import REPO_ROOT, free_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "nemotron"
HI = [{"role": "user", "content": "Hi"}]


@dataclass
class Stack:
    gateway: str
    engine: str
    env: dict[str, str]
    key: str

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.gateway, default_headers={"x-api-key": key}, max_retries=0, timeout=120
        )


@pytest.fixture(scope="module")
def stack(demo_model_dir: str, redis_url: str) -> Iterator[Stack]:
    engine_port, gateway_port = free_port(), free_port()
    env = up_settings(
        demo_model_dir,
        redis_url,
        engine_port=engine_port,
        gateway_port=gateway_port,
        state_dir=CACHE_ROOT / "engine-tests-refusals",
    )
    with running_up(env, key_prefix="refusals") as (_, key):
        yield Stack(f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", env, key)


# The installed vLLM's request model of each relayed route, and whether it has a `priority` field; asked in a child
# process (importing vLLM here would run its import-time warnings through this suite's warnings-as-errors).
_ASK_VLLM = """
import json
from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from vllm.entrypoints.generate.base.serving import PRIORITY_HEADER
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
models = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": AnthropicMessagesRequest,
    "/v1/messages/count_tokens": AnthropicCountTokensRequest,
}
print(json.dumps({"header": PRIORITY_HEADER, "field": {p: "priority" in m.model_fields for p, m in models.items()}}))
"""


def test_each_relayed_route_sends_a_priority_where_the_installed_vllms_request_model_reads_it() -> None:
    # vLLM's Messages API converts its request (no `priority` field: a body one is dropped) into a chat request and
    # takes the priority from the X-Vllm-Priority header, which every generating route reads before the body.
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _ASK_VLLM],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    vllm = json.loads(done.stdout.strip().splitlines()[-1])
    relayed = {route.path: route.relayed for route in SERVED if route.relayed is not None}
    assert set(relayed) == set(vllm["field"])
    for path, has_field in vllm["field"].items():
        assert relayed[path].priority_header is not has_field, path
    assert vllm["header"] == PRIORITY_HEADER


def test_vllms_own_validation_errors_reach_the_anthropic_sdk_in_anthropics_envelope(stack: Stack) -> None:
    # `output_config` is vLLM's to check: its request validation answers OpenAI's envelope, even on /v1/messages.
    bad = {"output_config": {"effort": "enormous"}}
    with stack.anthropic(stack.key) as sdk:
        with pytest.raises(anthropic.BadRequestError) as created:
            sdk.messages.create(model=MODEL, max_tokens=4, messages=HI, extra_body=bad)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError) as counted:
            sdk.messages.count_tokens(model=MODEL, messages=HI, extra_body=bad)  # type: ignore[arg-type]
    for caught in (created, counted):
        body = caught.value.body
        assert isinstance(body, dict) and set(body) == {"type", "error"}, body
        assert body["error"]["type"] == "invalid_request_error" and "effort" in body["error"]["message"], body
