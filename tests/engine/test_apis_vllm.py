"""OpenAI's Responses API and Anthropic's Messages API through the gateway on a real `vllm serve` (CPU build, tiny
demo model), whose own response store is off: each SDK's own calls, its own exception classes, usage in the gateway's
counters, the Responses API's state kept by the gateway (a chain with a function call that outlives a killed engine
and a new gateway, a background response that outlives its gateway, each key's own), a client that leaves aborting
the generation, and what becomes of a tool call
under the presets' tool parser (the operator preset of test_nemotron_presets: Nemotron-Mini's template, a `/think`
line, the plugin's `nemotron_json` parser). One engine start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import (
    gateway_cli,
    generated_in_vllm,
    running_in_vllm,
    running_up,
    tokens_generated_since,
    up_settings,
    vllm_server_pid,
)
from tests.engine.test_nemotron_presets import OPERATOR_PRESETS, _plugin_path, _token_id
from tests.procs import REPO_ROOT, ServerProcess, free_port, wait_until
from tools import demo_model

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "nemotron"
STATE_DIR = CACHE_ROOT / "engine-tests-apis"
WORDS = {"max_output_tokens": 8, "temperature": 0}
MAX_CHAIN = 6
LONG = {"ignore_eos": True}


@dataclass
class Stack:
    proc: ServerProcess
    gateway: str
    engine: str
    key: str
    env: dict[str, str]

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=key or self.key, max_retries=0, timeout=120)

    def anthropic(self, key: str | None = None) -> anthropic.Anthropic:
        # The key as `x-api-key`, as Anthropic's API wants it (this SDK's `api_key` is sent as a Bearer token).
        headers = {"x-api-key": key or self.key}
        return anthropic.Anthropic(base_url=self.gateway, default_headers=headers, max_retries=0, timeout=120)

    def metric(self, name: str, labels: str) -> float:
        text = httpx.get(f"{self.gateway}/metrics", timeout=5).text
        found = re.findall(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} ([0-9.e+]+)", text, re.M)
        return float(found[0]) if found else 0.0

    def new_key(self, name: str, *limits: str) -> str:
        created = gateway_cli(self.env, "keys", "create", "--name", name, *limits)
        assert created.returncode == 0, created.stderr
        return created.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stack(demo_model_dir: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engine_port, gateway_port = free_port(), free_port()
    tmp = tmp_path_factory.mktemp("apis")
    (tmp / "operator.toml").write_text(OPERATOR_PRESETS)
    env = up_settings(
        demo_model_dir, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=STATE_DIR
    )
    env["NEMOTRON_RESPONSES__MAX_CHAIN"] = str(MAX_CHAIN)
    env["NEMOTRON_ENGINE__PROFILES_FILE"] = str(tmp / "operator.toml")
    env["NEMOTRON_RELAY__GENERATION_PROBE_TIMEOUT"] = "60"
    if (plugin_path := _plugin_path(tmp / "plugin")) is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugin_path, os.environ.get("PYTHONPATH")]))
    with running_up(env, "--preset", "demo-nemotron", key_prefix="apis") as (proc, key):
        yield Stack(proc, f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", key, env)


def test_openai_sdk_responses_create_streamed_and_not_with_instructions_and_reasoning(stack: Stack) -> None:
    before = stack.metric("nemotron_gateway_api_tokens_total", 'api="responses",kind="completion"')
    with stack.openai() as sdk:
        answer = sdk.responses.create(
            model=MODEL, input="Say hi", instructions="Answer briefly.", reasoning={"effort": "low"}, **WORDS
        )
        assert answer.status in ("completed", "incomplete") and isinstance(answer.output_text, str)
        assert answer.usage is not None and answer.usage.output_tokens > 0 and answer.usage.input_tokens > 0
        events = list(sdk.responses.create(model=MODEL, input="Say hi", instructions="Be brief.", stream=True, **WORDS))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert "response.output_text.delta" in kinds
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens > 0
    after = stack.metric("nemotron_gateway_api_tokens_total", 'api="responses",kind="completion"')
    assert after - before == answer.usage.output_tokens + final.usage.output_tokens


def test_responses_stream_keeps_vllms_event_framing(stack: Stack) -> None:
    body = {"model": MODEL, "input": "Hi", "stream": True, **WORDS}
    headers = {"Authorization": f"Bearer {stack.key}"}
    with httpx.stream("POST", f"{stack.gateway}/v1/responses", json=body, headers=headers, timeout=120) as reply:
        raw = reply.read().decode()
    assert reply.status_code == 200
    events = [block for block in raw.split("\n\n") if block.strip() and not block.startswith(":")]
    for block in events:
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]


def test_anthropic_sdk_messages_create_and_stream_with_x_api_key(stack: Stack) -> None:
    before = stack.metric("nemotron_gateway_api_tokens_total", 'api="messages",kind="completion"')
    with stack.anthropic() as sdk:
        message = sdk.messages.create(
            model=MODEL, max_tokens=8, system="Answer briefly.", messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.type == "message" and message.role == "assistant"
        assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0
        with sdk.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert isinstance(text, str) and final.usage.output_tokens > 0
        counted = sdk.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        assert counted.input_tokens > 0
    after = stack.metric("nemotron_gateway_api_tokens_total", 'api="messages",kind="completion"')
    assert after - before == message.usage.output_tokens + final.usage.output_tokens


def test_wrong_key_over_limit_key_and_bad_body_raise_each_sdks_own_exceptions(stack: Stack) -> None:
    wrong = "sk-" + "x" * 43
    with stack.openai(wrong) as sdk, pytest.raises(openai.AuthenticationError):
        sdk.responses.create(model=MODEL, input="Hi", **WORDS)
    with stack.anthropic(wrong) as sdk, pytest.raises(anthropic.AuthenticationError):
        sdk.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    limited = stack.new_key(f"apis-limited-{time.time_ns()}", "--rpm", "1")
    with stack.openai(limited) as sdk:
        sdk.responses.create(model=MODEL, input="Hi", **WORDS)
        with pytest.raises(openai.RateLimitError):
            sdk.responses.create(model=MODEL, input="Hi", **WORDS)
    with stack.anthropic(limited) as sdk, pytest.raises(anthropic.RateLimitError) as limited_error:
        sdk.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert limited_error.value.response.headers.get("retry-after")
    with stack.openai() as sdk, pytest.raises(openai.BadRequestError) as bad:
        sdk.responses.create(model=MODEL, input="Hi", max_output_tokens="many")  # type: ignore[arg-type]
    assert bad.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    with stack.anthropic() as sdk, pytest.raises(anthropic.BadRequestError) as wrong_role:
        sdk.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "User", "content": "Hi"}])  # type: ignore[typeddict-item]
    assert wrong_role.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with stack.anthropic() as sdk, pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])


def test_a_stored_response_is_readable_and_continued_only_with_the_key_that_made_it(stack: Stack) -> None:
    other = stack.new_key(f"apis-other-{time.time_ns()}")
    with stack.openai() as sdk:
        first = sdk.responses.create(model=MODEL, input="Remember 7", store=True, **WORDS)
        assert sdk.responses.retrieve(first.id).id == first.id
        follow = sdk.responses.create(model=MODEL, input="Which number?", previous_response_id=first.id, **WORDS)
        assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    with stack.openai(other) as sdk:
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model=MODEL, input="Which?", previous_response_id=first.id, **WORDS)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.cancel(first.id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.input_items.list(first.id)
    with stack.openai() as sdk:  # still there for its own key
        assert [item.type for item in sdk.responses.input_items.list(first.id).data] == ["message"]


def test_metadata_vllm_echoes_in_a_stream_neither_ends_its_accounting_nor_frees_its_slot(stack: Stack) -> None:
    # vLLM repeats the request's `metadata` in the stream's first events; planted to look like the end, it must not
    # end the key's accounting there.
    key = stack.new_key(f"apis-planted-{time.time_ns()}", "--max-concurrency", "1")
    body = {
        "model": MODEL,
        "input": "A long story",
        "stream": True,
        "max_output_tokens": 300,
        "ignore_eos": True,
        "metadata": {"type": "response.completed", "note": '"type":"response.completed"'},
    }
    headers = {"Authorization": f"Bearer {key}"}
    before = stack.metric("nemotron_gateway_api_tokens_total", 'api="responses",kind="completion"')
    with httpx.stream("POST", f"{stack.gateway}/v1/responses", json=body, headers=headers, timeout=120) as first:
        lines = first.iter_lines()
        assert next(lines) == "event: response.created"
        created = json.loads(next(lines)[6:])
        assert created["response"]["metadata"]["type"] == "response.completed"
        second = httpx.post(
            f"{stack.gateway}/v1/responses", json={**body, "stream": False}, headers=headers, timeout=120
        )
        assert second.status_code == 429, second.text  # the first stream still holds the key's one slot
        final = json.loads([line for line in lines if line.startswith("data: ")][-1][6:])
    assert final["type"] == "response.completed"
    after = stack.metric("nemotron_gateway_api_tokens_total", 'api="responses",kind="completion"')
    assert after - before == final["response"]["usage"]["output_tokens"] == 300
    with stack.openai(key) as sdk:  # and its owner was written at the real end
        assert sdk.responses.retrieve(final["response"]["id"]).id == final["response"]["id"]


def test_a_client_leaving_a_responses_or_messages_stream_aborts_the_generation_in_vllm(stack: Stack) -> None:
    budget, long = 1500, {"extra_body": {"ignore_eos": True}}
    before = generated_in_vllm(stack.engine)
    with stack.openai() as sdk:
        stream = sdk.responses.create(model=MODEL, input="A long story", stream=True, max_output_tokens=budget, **long)
        for index, _ in enumerate(stream):
            if index == 5:
                break
        stream.close()
    generated = tokens_generated_since(stack.engine, before)
    assert generated < budget, f"vLLM generated {generated:.0f} of {budget} tokens for a gone client"
    before = generated_in_vllm(stack.engine)
    with stack.anthropic() as sdk:
        with sdk.messages.stream(
            model=MODEL, max_tokens=budget, messages=[{"role": "user", "content": "A long story"}], **long
        ) as stream:
            for index, _ in enumerate(stream):
                if index == 5:
                    break
    generated = tokens_generated_since(stack.engine, before)
    assert generated < budget, f"vLLM generated {generated:.0f} of {budget} tokens for a gone client"


TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _tool_call_bias(model_dir: str) -> dict[str, int]:
    # The random model is made to emit the demo model's one-token tool call.
    return {str(_token_id(Path(model_dir), demo_model.TOOL_CALL_TEXT)): 100}


def test_a_tool_call_comes_back_as_a_function_call_item(stack: Stack, demo_model_dir: str) -> None:
    request = {"model": MODEL, "input": "Weather in Paris?", "tools": [TOOL], "max_output_tokens": 1}
    with stack.openai() as sdk:
        answer = sdk.responses.create(**request, extra_body={"logit_bias": _tool_call_bias(demo_model_dir)})  # type: ignore[arg-type]
        calls = [item for item in answer.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
        events = list(
            sdk.responses.create(**request, stream=True, extra_body={"logit_bias": _tool_call_bias(demo_model_dir)})  # type: ignore[arg-type]
        )
        kinds = [event.type for event in events]
        assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
        final = events[-1].response  # type: ignore[union-attr]
        assert [item.type for item in final.output] == ["function_call"]


def test_the_gpu_checker_script_passes_against_the_cpu_engine(stack: Stack) -> None:
    done = subprocess.run(
        [sys.executable, "tests/gpu/apis.py", "--url", stack.gateway, "--key", stack.key, "--max-tokens", "8"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["responses_stream"]["events"][0] == "response.created"
    assert report["messages_stream"]["events"][-1] == "message_stop"


def test_the_docs_snippets_run_as_printed(stack: Stack) -> None:
    page = (REPO_ROOT / "docs" / "api" / "responses-messages.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(snippets) == 2
    for snippet in snippets:
        done = subprocess.run(
            [sys.executable, "-c", snippet],
            env={**os.environ, "NEMOTRON_URL": stack.gateway, "NEMOTRON_KEY": stack.key},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0 and done.stdout.strip(), done.stderr


# --- the Responses API's state, kept by the gateway ---


def _serve(stack: Stack, port: int) -> ServerProcess:
    """A gateway of its own (`serve`) on the stack's engine and Redis: what a restarted gateway or another host is."""
    env = {**stack.env, "NEMOTRON_PORT": str(port), "NEMOTRON_ENGINE_URL": stack.engine}
    return ServerProcess(
        [sys.executable, "-m", "gateway", "serve"],
        env=env,
        ready_url=f"http://127.0.0.1:{port}/ready",
        start_timeout=120,
        stop_timeout=30,
        port=port,
    )


def _client(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


def _vllm_server_pid() -> int:
    # The supervisor's status file names the engine's process group leader (its guard), whose one child is vLLM.
    return vllm_server_pid(int(json.loads((STATE_DIR / "engine.json").read_text())["group_pid"]))


def test_a_chain_with_a_function_call_outlives_a_killed_engine_and_continues_on_a_new_gateway(
    stack: Stack, demo_model_dir: str
) -> None:
    bias = {"logit_bias": _tool_call_bias(demo_model_dir)}
    with stack.openai() as sdk:
        asked = sdk.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=[TOOL],
            max_output_tokens=1,
            extra_body=bias,  # type: ignore[list-item]
        )
        call = next(item for item in asked.output if item.type == "function_call")
        answered = sdk.responses.create(
            model=MODEL,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
            previous_response_id=asked.id,
            tools=[TOOL],  # type: ignore[list-item]
            **WORDS,  # type: ignore[arg-type]
        )
        assert answered.previous_response_id == asked.id and answered.store is True
    # The engine goes down hard and comes back with nothing in its memory: the chain lives in Redis.
    os.kill(_vllm_server_pid(), signal.SIGKILL)
    wait_until(lambda: httpx.get(f"{stack.gateway}/ready").status_code == 503, timeout=30)
    wait_until(lambda: httpx.get(f"{stack.gateway}/ready").status_code == 200, timeout=400, interval=1.0)
    with stack.openai() as sdk:
        third = sdk.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=answered.id, **WORDS)  # type: ignore[arg-type]
    # Each turn was sent the whole conversation: the call, its output and the answers before it.
    usage = [r.usage.input_tokens for r in (asked, answered, third)]  # type: ignore[union-attr]
    assert usage[0] < usage[1] < usage[2], usage
    port = free_port()
    with _serve(stack, port) as fresh:
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=stack.key, max_retries=0, timeout=120
        ) as sdk:
            fourth = sdk.responses.create(model=MODEL, input="Thanks.", previous_response_id=third.id, **WORDS)  # type: ignore[arg-type]
            assert fourth.usage.input_tokens > usage[2]  # type: ignore[union-attr]
            assert sdk.responses.retrieve(asked.id).output[0].type == "function_call"
            items = sdk.responses.input_items.list(answered.id).data
            assert [item.type for item in items] == ["function_call_output"]
        assert fresh.pid is not None


def test_a_background_response_outlives_the_gateway_running_it(stack: Stack) -> None:
    port = free_port()
    budget = 600
    with _serve(stack, port) as first:
        with _client(port, stack.key) as sdk:
            queued = sdk.responses.create(
                model=MODEL,
                input="A long story",
                background=True,
                max_output_tokens=budget,
                extra_body={"ignore_eos": True},
            )
            assert queued.status == "queued" and queued.background is True
        # SIGTERM at once: the gateway lets go of its run, and the stack's own gateway resumes it.
        first.stop()
    with stack.openai() as sdk:
        # vLLM calls an answer cut at its length `incomplete`, as OpenAI does.
        finished = ("completed", "incomplete")
        wait_until(lambda: sdk.responses.retrieve(queued.id).status in finished, timeout=300, interval=0.5)
        done = sdk.responses.retrieve(queued.id)
        assert done.usage is not None and done.usage.output_tokens == budget
        assert done.output and done.output[-1].type == "message"
        events = list(sdk.responses.retrieve(queued.id, stream=True, starting_after=2))
        assert events[0].sequence_number == 3 and events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.status == done.status  # type: ignore[union-attr]
        sdk.responses.delete(queued.id)  # the SDK reads no body back
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(queued.id)
    assert f"resuming background response {queued.id}" in stack.proc.log_text()


def test_a_background_response_is_cancelled_and_a_broken_chain_is_refused(stack: Stack) -> None:
    with stack.openai() as sdk:
        running = sdk.responses.create(
            model=MODEL, input="A long story", background=True, max_output_tokens=2000, extra_body=LONG
        )
        with pytest.raises(openai.BadRequestError, match="continue it once it is finished"):
            sdk.responses.create(model=MODEL, input="Go on", previous_response_id=running.id, **WORDS)  # type: ignore[arg-type]
        assert sdk.responses.cancel(running.id).status == "cancelled"
        wait_until(lambda: running_in_vllm(stack.engine) == 0, timeout=60, message="the cancelled run went on")
        assert sdk.responses.retrieve(running.id).status == "cancelled"
        chain = sdk.responses.create(model=MODEL, input="One", **WORDS)  # type: ignore[arg-type]
        for turn in range(MAX_CHAIN):  # a chain of MAX_CHAIN + 1 responses
            chain = sdk.responses.create(model=MODEL, input=f"Turn {turn}", previous_response_id=chain.id, **WORDS)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="more than 6 responses") as too_long:
            sdk.responses.create(model=MODEL, input="Too far", previous_response_id=chain.id, **WORDS)  # type: ignore[arg-type]
        assert too_long.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown", **WORDS)  # type: ignore[arg-type]
