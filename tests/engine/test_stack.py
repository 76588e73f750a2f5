"""The whole product on a real `vllm serve` (CPU build, tiny demo model): `nemotron-gateway up` spawns the
engine through the supervisor, the gateway serves the OpenAI SDK, a frozen engine core (SIGSTOP of the EngineCore
process only: the API server keeps answering /health 200) is refused within the gateway's stated bound and then
serves again, a killed engine is restarted, a stop leaves nothing behind. One engine start for the module (plus
the restarts).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gateway.supervisor.process import group_members, shared_memory_inodes, shared_memory_of
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import (
    engine_core_pid,
    gateway_cli,
    generated_in_vllm,
    running_in_vllm,
    running_up,
    tokens_generated_since,
    up_settings,
    vllm_server_pid,
)
from tests.procs import ServerProcess, free_port, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
logger = logging.getLogger(__name__)

MODEL = "nemotron"
# The engine's own key: the supervisor starts vLLM with it, the gateway and the supervisor's probe send it.
ENGINE_KEY = f"engine-{uuid.uuid4().hex}"
STATE_DIR = CACHE_ROOT / "engine-tests"
VERDICTS = "vllm-verdict-*.txt"  # the doctor's cache of vLLM's verdicts, in the state dir


@dataclass
class Stack:
    proc: ServerProcess
    gateway: str
    engine: str
    key: str
    env: dict[str, str]

    def status(self) -> dict[str, object]:
        return dict(json.loads((STATE_DIR / "engine.json").read_text()))

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=self.key, max_retries=0, timeout=120)

    def running_in_vllm(self) -> float:
        """vLLM's own gauge of requests it is generating for."""
        return running_in_vllm(self.engine)


@pytest.fixture(scope="module")
def stack(demo_model_dir: str, redis_url: str) -> Iterator[Stack]:
    engine_port, gateway_port = free_port(), free_port()
    env = up_settings(
        demo_model_dir, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=STATE_DIR
    )
    env.update(
        {
            "NEMOTRON_ENGINE__BACKOFF_INITIAL": "0.5",
            "NEMOTRON_ENGINE__PROBE_INTERVAL": "1",
            # vLLM logs "Aborted request" only with this: the disconnect tests read it.
            "NEMOTRON_ENGINE__EXTRA_ARGS": '["--enable-log-requests"]',
            "NEMOTRON_ENGINE_API_KEY": ENGINE_KEY,
            "NEMOTRON_ENGINE__RUN_DOCTOR": "true",  # the default: vLLM's verdict beside the start
        }
    )
    for verdict in STATE_DIR.glob(VERDICTS):  # asked afresh, not read from an earlier run's cache
        verdict.unlink()
    with running_up(env, key_prefix="engine-tier") as (proc, key):
        yield Stack(proc, f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", key, env)


def test_sdk_chat_stream_and_completion_through_the_gateway(stack: Stack) -> None:
    with stack.sdk() as sdk:
        answer = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0
        )
        assert isinstance(answer.choices[0].message.content, str)
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        chunks = list(
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
            )
        )
        assert chunks and all(chunk.choices for chunk in chunks), "no usage-only chunk the client did not ask for"
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        with_usage = list(
            sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens > 0
        completion = sdk.completions.create(model=MODEL, prompt="The engine", max_tokens=4)
        assert completion.usage is not None and completion.usage.completion_tokens > 0
        assert [m.id for m in sdk.models.list()] == [MODEL]
    metrics = httpx.get(f"{stack.gateway}/metrics").text
    assert 'nemotron_gateway_tokens_total{kind="completion"}' in metrics


def test_vllms_verdict_on_the_command_line_is_asked_beside_the_start(stack: Stack) -> None:
    # The doctor's import of vLLM runs beside the engine's and may end after /ready; its answer is cached in the
    # state dir, what a hand-run `doctor` then reads.
    verdicts = wait_until(lambda: list(STATE_DIR.glob(VERDICTS)), timeout=240, interval=1, message="no verdict")
    answer = json.loads(verdicts[0].read_text())
    assert "argv_error" not in answer, answer
    assert answer["given"]["max_model_len"] == 2048 and answer["given"]["architecture"] == "NemotronForCausalLM"


def test_a_token_budget_is_reconciled_to_the_usage_vllm_reports(stack: Stack) -> None:
    name = f"budget-{uuid.uuid4().hex[:8]}"
    created = gateway_cli(stack.env, "keys", "create", "--name", name, "--daily-tokens", "100000")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    try:
        with openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key=key, max_retries=0, timeout=120) as sdk:
            answer = sdk.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
            )
            # Charged up front: the prompt estimate + max_tokens, before vLLM counted anything.
            assert 0 < 100_000 - int(answer.headers["x-budget-remaining-tokens-day"]) >= 8
            usage = answer.parse().usage
            streamed = list(
                sdk.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
        assert usage is not None and streamed[-1].usage is not None
        reported = [usage, streamed[-1].usage]
        shown = gateway_cli(stack.env, "keys", "show", name, "--json")
        assert json.loads(shown.stdout)["budget_used"]["day"] == sum(u.total_tokens for u in reported)
        billed = json.loads(gateway_cli(stack.env, "keys", "usage", name, "--json").stdout)
        assert [(row["api"], row["requests"], row["prompt_tokens"], row["completion_tokens"]) for row in billed] == [
            (
                "chat",
                2,
                sum(u.prompt_tokens for u in reported),
                sum(u.completion_tokens for u in reported),
            )
        ]
    finally:
        gateway_cli(stack.env, "keys", "revoke", name)


def test_the_engine_port_wants_the_engine_key_that_gateway_and_supervisor_send(stack: Stack) -> None:
    # Nothing else on the machine uses the engine's port: vLLM wants the key the supervisor gave it.
    assert httpx.get(f"{stack.engine}/v1/models", timeout=10).status_code == 401
    keyed = httpx.get(f"{stack.engine}/v1/models", headers={"Authorization": f"Bearer {ENGINE_KEY}"}, timeout=10)
    assert keyed.status_code == 200
    with stack.sdk() as sdk:  # the gateway sends it
        assert sdk.completions.create(model=MODEL, prompt="Key", max_tokens=2).choices[0].text is not None
    # The supervisor's idle generation probe carries it too (a refused probe is warned about), and the key is
    # in no log.
    log = stack.proc.log_text()
    assert "refused the idle generation probe" not in log
    assert ENGINE_KEY not in log


def test_an_fcfs_engine_gets_no_priority_from_the_gateway(stack: Stack) -> None:
    # This engine runs vLLM's default FCFS policy; the supervisor says so in its status file.
    assert stack.status()["scheduling_policy"] == "fcfs"
    name = f"engine-fcfs-{uuid.uuid4().hex[:8]}"
    created = gateway_cli(stack.env, "keys", "create", "--name", name, "--priority", "5")
    assert created.returncode == 0, created.stderr
    try:
        headers = {"Authorization": f"Bearer {created.stdout.strip().splitlines()[-1]}"}
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "priority": 7}
        response = httpx.post(f"{stack.gateway}/v1/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        metrics = httpx.get(f"{stack.gateway}/metrics", timeout=10).text
        assert re.search(
            r'^nemotron_gateway_priority_sent_total\{field="dropped",model="nemotron",replica="[^"]+",tier="2"\} [1-9]',
            metrics,
            re.M,
        )
        # Sent directly, the installed vLLM (0.32) takes a non-zero priority under FCFS and ignores it; vLLM's
        # older engine refused it ("Got priority 5 but Priority scheduling is not enabled."), which is why the
        # gateway never sends one to an FCFS engine.
        direct = httpx.post(
            f"{stack.engine}/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "priority": 5},
            headers={"Authorization": f"Bearer {ENGINE_KEY}"},
            timeout=120,
        )
        assert direct.status_code == 200, direct.text
    finally:
        gateway_cli(stack.env, "keys", "revoke", name)


def test_the_gateway_answers_what_vllm_would_get_wrong(stack: Stack) -> None:
    with stack.sdk() as sdk:
        with pytest.raises(openai.BadRequestError) as role:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "User", "content": "hi"}])
        assert role.value.body is not None and role.value.body["param"] == "messages[0].role"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="context length of 2048"):
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
        with pytest.raises(openai.AuthenticationError):
            with openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key="sk-" + "x" * 43, max_retries=0) as other:
                other.models.list()


def test_client_disconnect_aborts_the_generation_in_vllm(stack: Stack) -> None:
    budget = 1500
    long = {"max_tokens": budget, "extra_body": {"ignore_eos": True}}
    before = generated_in_vllm(stack.engine)
    with stack.sdk() as sdk:
        stream = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell a long story"}], stream=True, **long
        )
        for index, _ in enumerate(stream):
            if index == 3:
                break
        stream.close()
    generated = tokens_generated_since(stack.engine, before)
    assert generated < budget, f"vLLM generated {generated:.0f} of {budget} tokens for a gone client"
    aborted_before = stack.proc.log_text().count("aborted")
    # Non-streamed: the client gives up after 1 s of a generation that would take far longer.
    with openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key=stack.key, max_retries=0, timeout=1.0) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell a long story"}], **long
            )
    wait_until(lambda: stack.running_in_vllm() == 0, timeout=5, message="vLLM kept a non-streamed request running")
    wait_until(lambda: stack.proc.log_text().count("aborted") > aborted_before, timeout=5)


# The gateway's defaults (RelaySettings) with this stack's probe interval: idle bound =
# generation_probe_timeout + 2 x probe_interval.
IDLE_BOUND = 10.0 + 2 * 0.5
# The supervisor's: the default stall_timeout (15 s) and this stack's health interval (1 s).
HANG_BOUND = 15.0 + 1.0
# Only the gateway's finding turns /ready 503 for a stopped core (vLLM's /health keeps answering 200), and only the
# supervisor's hang check restarts it: the waits for them only stop a hung test, and the bounds above are logged
# (tests/integration/test_engine_faults_gateway.py times the gateway's in perf tests).
HANG_GUARD = 300.0


def _ready(running: Stack) -> int:
    """The gateway's /ready status; 0 while it does not answer (`up` may be restarting it)."""
    try:
        return httpx.get(f"{running.gateway}/ready", timeout=10).status_code
    except httpx.TransportError:
        return 0


def _wait_ready(running: Stack, status: int, within: float) -> None:
    try:
        wait_until(lambda: _ready(running) == status, timeout=within, interval=0.25)
    except AssertionError:
        try:
            last = httpx.get(f"{running.gateway}/ready", timeout=10).text
        except httpx.TransportError as exc:
            last = repr(exc)
        raise AssertionError(f"/ready not {status} within {within:g} s: {last}\n{running.proc.tail(80)}") from None


def test_frozen_engine_core_is_refused_then_restarted_by_the_supervisor(stack: Stack) -> None:
    _wait_ready(stack, 200, 120)
    first = stack.status()
    vllm, group, restarts = int(str(first["engine_pid"])), int(str(first["group_pid"])), int(str(first["restarts"]))
    # Below `nemotron-gateway up`: the supervisor, vllm serve, its EngineCore.
    core = wait_until(lambda: engine_core_pid(stack.proc.pid), timeout=60, message="no EngineCore process")
    held = shared_memory_inodes(group_members(group))
    os.kill(core, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        _wait_ready(stack, 503, HANG_GUARD)
        took = time.monotonic() - frozen_at
        reason = httpx.get(f"{stack.gateway}/ready", timeout=10).json()["engine"]["reason"]
        # The gateway's own finding, or (if the supervisor's hang check came first) its restart of the engine.
        assert reason in ("engine not generating", "connection refused")
        with stack.sdk() as sdk, pytest.raises(openai.InternalServerError) as refused:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert refused.value.status_code == 503 and "retry-after" in refused.value.response.headers
        logger.warning("frozen EngineCore refused after %.1f s (bound %g s, %s)", took, IDLE_BOUND, reason)
        # vLLM's /health keeps answering 200 for a stopped core: the supervisor's hang check (no token and no answer
        # to its one-token probe) restarts the engine within stall_timeout + health_interval.
        wait_until(lambda: stack.status()["restarts"] == restarts + 1, timeout=HANG_GUARD, interval=0.5)
        logger.warning(
            "frozen EngineCore restarted after %.1f s (bound %g s)", time.monotonic() - frozen_at, HANG_BOUND
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
    history = stack.status()["history"]
    assert isinstance(history, list) and history[-1]["cause"] == "not generating", history
    wait_until(lambda: not group_members(group), timeout=30, message="the stopped engine's group lingered")
    assert not held & _shm_inodes_now(), "a /dev/shm file of the stopped engine (vLLM's sem.mp-* included) survived"
    status_text = gateway_cli({"NEMOTRON_ENGINE__STATE_DIR": str(STATE_DIR)}, "engine", "status").stdout
    assert "not generating" in status_text, status_text
    _wait_ready(stack, 200, 300)
    assert stack.status()["engine_pid"] != vllm
    with stack.sdk() as sdk:
        answer = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices[0].message.content is not None
    # The supervisor's checks (/health while starting, /metrics every second) leave no access line in vLLM's log.
    engine_log = [line for line in stack.proc.log_text().splitlines() if line.startswith("engine |")]
    assert not [line for line in engine_log if '"GET /health HTTP' in line or '"GET /metrics HTTP' in line]


def _shm_inodes_now() -> set[int]:
    inodes = set()
    for entry in os.scandir("/dev/shm"):
        with contextlib.suppress(OSError):
            inodes.add(entry.inode())
    return inodes


def test_killed_engine_gives_503s_then_is_restarted_and_serves(stack: Stack) -> None:
    guard = int(str(stack.status()["group_pid"]))
    restarts = int(str(stack.status()["restarts"]))  # the frozen-core test's restart came before
    os.kill(vllm_server_pid(guard), signal.SIGKILL)
    wait_until(lambda: httpx.get(f"{stack.gateway}/ready").status_code == 503, timeout=10)
    with stack.sdk() as sdk:
        with pytest.raises(openai.InternalServerError) as down:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert down.value.status_code == 503
        assert "retry-after" in down.value.response.headers
        wait_until(lambda: not group_members(guard), timeout=15, message="the killed engine's group lingered")
        # The status file says READY until the supervisor has seen the exit: wait for the restart it records.
        wait_until(lambda: stack.status()["restarts"] == restarts + 1, timeout=30, message="no restart recorded")
        wait_until(lambda: stack.status().get("state") == "ready", timeout=300, interval=1.0)
        assert stack.status()["restarts"] == restarts + 1
        wait_until(lambda: httpx.get(f"{stack.gateway}/ready").status_code == 200, timeout=10)
        answer = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert answer.choices[0].message.content is not None


def test_stop_leaves_no_engine_process_and_no_shared_memory(stack: Stack) -> None:
    guard = int(str(stack.status()["group_pid"]))
    members = group_members(guard)
    assert len(members) >= 2, "guard and vllm serve (and its engine core)"
    held = shared_memory_of(members)
    stack.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not stack.proc.running, timeout=60, message="`up` did not exit on SIGTERM")
    assert group_members(guard) == []
    assert [path for path in held if Path(path).exists()] == []
    assert stack.status()["state"] == "stopped"


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--profile", "warp-speed"], "unknown engine profile 'warp-speed'"),
        (["--model", "/nonexistent/model"], "model directory"),
        # Dropped by this vLLM; reported only after ~35 s of imports if vLLM is left to find it.
        (["--extra", '["--disable-log-requests"]'], "does not accept --disable-log-requests"),
    ],
)
def test_bad_profile_missing_model_and_unknown_flag_fail_fast(
    stack: Stack, args: list[str], phrase: str, tmp_path: Path
) -> None:
    # The engine's interpreter answers the quick probe of which vLLM is installed (`python -c`) but notes, and
    # refuses, any start of vLLM's server (`python -m`): its start and its `--help=all` (a flag list read from it).
    started_vllm = tmp_path / "vllm-started"
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\ncase "$1" in -c) exec {shlex.quote(sys.executable)} "$@";; esac\n'
        f'echo "$@" >>{shlex.quote(str(started_vllm))}\nexit 97\n'
    )
    python.chmod(0o755)
    env = {**stack.env, "NEMOTRON_ENGINE__PORT": str(free_port()), "NEMOTRON_ENGINE__PYTHON": str(python)}
    if args[0] == "--extra":
        env["NEMOTRON_ENGINE__EXTRA_ARGS"], args = args[1], []
    result = gateway_cli(env, "engine", *args)
    assert result.returncode == 2
    assert phrase in result.stderr
    assert "Traceback" not in result.stderr
    # The flag list is the one shipped for the pinned vLLM; nothing waits for vLLM to load.
    assert not started_vllm.exists(), started_vllm.read_text()
