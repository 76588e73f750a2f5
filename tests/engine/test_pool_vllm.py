"""The replica pool on real vLLM (CPU build, the demo model): `nemotron-gateway up` with two managed replicas of one
model, and a replica of a second model that its own `nemotron-gateway engine` runs and the watched file brings in.

A replica written into the file serves within seconds; a key limited to one model is refused the other; a
conversation's turns land on one replica and only that replica's prefix-cache hits rise; a burst of one
conversation spills past the affinity bound; a drained replica gets nothing new; `kill -9` of one replica under load
fails only the requests it had and it comes back; a rolling restart under load fails nothing. Three engine starts
for the module, plus the restarts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.supervised import free_ports, replica_status, status
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import gateway_cli, running_up, up_settings, vllm_server_pid
from tests.procs import REPO_ROOT, ServerProcess, free_port, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MODEL = "nemotron"
SECOND_MODEL = "nemotron-second"
ENGINE_KEY = f"engine-{uuid.uuid4().hex}"
STATE_DIR = CACHE_ROOT / "engine-pool-tests"
SECOND_STATE_DIR = CACHE_ROOT / "engine-pool-tests-second"
# A system prompt of some hundred tokens: whole blocks of vLLM's prefix cache that a conversation's later turns hit.
SYSTEM = " ".join(f"Rule {n}: answer briefly, cite the manual, and keep to the subject." for n in range(24))


@dataclass
class Pool:
    up: ServerProcess
    gateway: str
    replicas: list[str]  # the managed replicas, in index order
    second: str  # the second model's replica
    replicas_file: Path
    key: str
    env: dict[str, str]

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=key or self.key, max_retries=0, timeout=120)

    def ready(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.gateway}/ready", timeout=10).json()
        return body

    def replica_state(self, url: str) -> dict[str, Any]:
        return next(entry for entry in self.ready()["replicas"] if entry["url"] == url)

    def access_line(self, request_id: str) -> dict[str, Any]:
        """The request's access-log line (written once the answer is over)."""

        def logged() -> dict[str, Any] | None:
            for line in self.up.log_text().splitlines():
                if f'"request_id":"{request_id}"' in line:
                    found: dict[str, Any] = json.loads(line[line.index("{") :])
                    return found
            return None

        line = wait_until(logged, timeout=10, message=f"no access line for {request_id}")
        assert line is not None
        return line

    def replica_of(self, request_id: str) -> str:
        """The replica the access log names for the request."""
        return str(self.access_line(request_id)["replica"])

    def served_span(self, request_id: str) -> tuple[float, float]:
        """When the gateway began and ended the request (epoch seconds, from its access line)."""
        line = self.access_line(request_id)
        end = datetime.fromisoformat(line["time"]).timestamp()
        return end - float(line["duration_ms"]) / 1000, end


def vllm_counter(url: str, name: str) -> float:
    """A counter or gauge of a replica's own /metrics, summed over its label sets."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M))


@pytest.fixture(scope="module")
def pool(demo_model_dir: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    base, second_port, gateway_port = free_ports(2), free_port(), free_port()
    replicas_file = tmp_path_factory.mktemp("pool") / "replicas"
    replicas_file.write_text("# further replicas, one URL a line\n")
    env = up_settings(demo_model_dir, redis_url, engine_port=base, gateway_port=gateway_port, state_dir=STATE_DIR)
    env.update(
        {
            "NEMOTRON_ENGINE__REPLICAS": "2",
            "NEMOTRON_ENGINE_API_KEY": ENGINE_KEY,
            "NEMOTRON_ENGINE__BACKOFF_INITIAL": "0.5",
            "NEMOTRON_ENGINE__PROBE_INTERVAL": "1",
            "NEMOTRON_REPLICAS_FILE": str(replicas_file),
            "NEMOTRON_ROUTING__FILE_POLL_INTERVAL": "0.5",
            "NEMOTRON_LOG_FORMAT": "json",
        }
    )
    second_env = {
        **up_settings(
            demo_model_dir, redis_url, engine_port=second_port, gateway_port=gateway_port, state_dir=SECOND_STATE_DIR
        ),
        "NEMOTRON_ENGINE__SERVED_MODEL_NAME": SECOND_MODEL,
        "NEMOTRON_ENGINE_API_KEY": ENGINE_KEY,
    }
    # The second model's engine side alone, as on another machine: it starts beside the pool's two.
    second = ServerProcess(
        [sys.executable, "-m", "gateway", "engine"],
        env=second_env,
        ready_check=lambda: status(SECOND_STATE_DIR).get("state") == "ready",
        start_timeout=420,
        stop_timeout=30,
        port=second_port,
    )
    second.start(wait=False)
    try:
        # A key with room for the bursts below (the default allows 8 in flight).
        with running_up(env, key_prefix="pool-tier", key_flags=("--max-concurrency", "64")) as (up, key):
            # /ready is 200 once the model has one ready replica: wait for the other too.
            wait_until(
                lambda: all(r["ready"] for r in httpx.get(f"http://127.0.0.1:{gateway_port}/ready").json()["replicas"]),
                timeout=300,
                interval=1.0,
            )
            second.wait_ready()
            yield Pool(
                up,
                f"http://127.0.0.1:{gateway_port}",
                [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"],
                f"http://127.0.0.1:{second_port}",
                replicas_file,
                key,
                env,
            )
    finally:
        second.stop()


def _chat(
    pool: Pool, messages: list[dict[str, str]], request_id: str, model: str = MODEL, max_tokens: int = 4, **extra: Any
) -> str:
    """One chat through the gateway; its answer's text."""
    with pool.sdk() as sdk:
        answer = sdk.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            extra_headers={"X-Request-Id": request_id},
            **extra,
        )
    return answer.choices[0].message.content or ""


def _conversation(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{topic}. {SYSTEM}"}, {"role": "user", "content": f"Tell me of {topic}."}]


def test_a_replica_written_into_the_watched_file_serves_within_seconds_and_a_key_limited_to_one_model_gets_403(
    pool: Pool,
) -> None:
    ready = pool.ready()
    assert ready["models"] == [MODEL]
    assert [(r["url"], r["model"], r["ready"]) for r in ready["replicas"]] == [
        (url, MODEL, True) for url in pool.replicas
    ]

    pool.replicas_file.write_text(f"# the second model\n{pool.second}\n")
    # The gateway looks at the file every 0.5 s here and probes a new replica at once.
    wait_until(lambda: pool.ready()["models"] == [MODEL, SECOND_MODEL], timeout=15, interval=0.25)
    assert pool.replica_state(pool.second)["ready"] is True
    with pool.sdk() as sdk:
        assert [model.id for model in sdk.models.list()] == [MODEL, SECOND_MODEL]
        assert sdk.models.retrieve(SECOND_MODEL).id == SECOND_MODEL
    _chat(pool, _conversation("the second model"), "second-model-1", model=SECOND_MODEL)
    assert pool.replica_of("second-model-1") == pool.second

    name = f"pool-one-model-{uuid.uuid4().hex[:8]}"
    created = gateway_cli(pool.env, "keys", "create", "--name", name, "--models", MODEL)
    assert created.returncode == 0, created.stderr
    limited = created.stdout.strip().splitlines()[-1]
    try:
        with pool.sdk(limited) as sdk:
            assert [model.id for model in sdk.models.list()] == [MODEL]
            with pytest.raises(openai.PermissionDeniedError) as refused:
                sdk.chat.completions.create(
                    model=SECOND_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert refused.value.code == "model_not_allowed"
            answer = sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert answer.model == MODEL
    finally:
        gateway_cli(pool.env, "keys", "revoke", name)


def test_a_conversations_turns_land_on_one_replica_and_only_its_prefix_cache_hits_rise(pool: Pool) -> None:
    hits = {url: vllm_counter(url, "vllm:prefix_cache_hits_total") for url in pool.replicas}
    messages = _conversation(f"conversation {uuid.uuid4().hex}")
    homes = []
    for turn in range(3):
        request_id = f"turn-{uuid.uuid4().hex[:8]}-{turn}"
        answer = _chat(pool, messages, request_id)
        homes.append(pool.replica_of(request_id))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And then {turn}?"}]
    assert len(set(homes)) == 1, homes
    home = homes[0]
    other = next(url for url in pool.replicas if url != home)
    # The two later turns each hit at least the system prompt's blocks (some hundred tokens) on their replica
    # (vLLM's counters reach its /metrics a step behind the tokens: waited for). The gateway's and the supervisors'
    # one-token probes reach both replicas meanwhile: their short prompts hit next to nothing.
    wait_until(lambda: vllm_counter(home, "vllm:prefix_cache_hits_total") - hits[home] >= 200, timeout=15)
    assert vllm_counter(other, "vllm:prefix_cache_hits_total") - hits[other] < 50


def test_a_burst_of_one_conversation_spills_past_the_affinity_bound_to_the_other_replica(pool: Pool) -> None:
    messages = _conversation(f"burst {uuid.uuid4().hex}")
    ids = [f"burst-{uuid.uuid4().hex[:8]}-{n}" for n in range(12)]
    # Twelve at once, each long enough on this CPU that all are outstanding together: the preferred replica takes
    # what the bound allows (2 x the other's + 4), the rest spill. The clients are made first and released together:
    # on a busy machine, making them one by one spread the burst over seconds.
    clients = [pool.sdk() for _ in ids]
    together = threading.Barrier(len(ids))

    def send(request_id: str, sdk: openai.OpenAI) -> None:
        with sdk:
            together.wait(timeout=60)
            sdk.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=160,
                extra_headers={"X-Request-Id": request_id},
                extra_body={"ignore_eos": True},
            )

    with ThreadPoolExecutor(len(ids)) as threads:
        list(threads.map(send, ids, clients))
    spans = [pool.served_span(rid) for rid in ids]
    assert max(start for start, _ in spans) < min(end for _, end in spans), f"not a burst: {spans}"
    where = [pool.replica_of(rid) for rid in ids]
    counts = {url: where.count(url) for url in pool.replicas}
    assert all(counts.values()), counts
    assert max(counts.values()) >= 6, counts  # affinity first: the preferred one carries more
    metrics = httpx.get(f"{pool.gateway}/metrics").text
    assert re.search(r'nemotron_gateway_routed_total\{how="spill",model="nemotron"\} [1-9]', metrics), metrics


def test_a_drained_replica_gets_nothing_new_and_is_put_back(pool: Pool) -> None:
    drained, kept = pool.replicas[1], pool.replicas[0]
    drain = gateway_cli(pool.env, "replicas", "drain", drained)
    assert drain.returncode == 0, drain.stderr
    try:
        wait_until(lambda: pool.replica_state(drained)["drained"] is True, timeout=10)
        assert pool.ready()["status"] == "ready"  # the model has its other replica
        ids = [f"drained-{uuid.uuid4().hex[:8]}-{n}" for n in range(8)]
        for rid in ids:
            _chat(pool, _conversation(f"topic {rid}"), rid)
        assert {pool.replica_of(rid) for rid in ids} == {kept}
    finally:
        restore = gateway_cli(pool.env, "replicas", "restore", drained)
    assert restore.returncode == 0, restore.stderr
    wait_until(lambda: pool.replica_state(drained)["drained"] is False, timeout=10)
    ids = [f"restored-{uuid.uuid4().hex[:8]}-{n}" for n in range(8)]
    for rid in ids:
        _chat(pool, _conversation(f"topic {rid}"), rid)
    assert drained in {pool.replica_of(rid) for rid in ids}


def _stream(pool: Pool, request_id: str, topic: str, max_tokens: int) -> bool:
    """A streamed chat read to its end: True when it ended with [DONE] and no error event."""
    body = {
        "model": MODEL,
        "messages": _conversation(topic),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {pool.key}", "X-Request-Id": request_id}
    try:
        with httpx.stream("POST", f"{pool.gateway}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
            if r.status_code != 200:
                return False
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError:
        return False
    return bool(lines) and lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)


def test_kill_9_of_one_replica_under_load_fails_only_its_own_requests_and_it_comes_back(pool: Pool) -> None:
    victim, survivor = pool.replicas[1], pool.replicas[0]
    restarts = int(str(replica_status(STATE_DIR, 1)["restarts"]))
    ids = [f"kill-{uuid.uuid4().hex[:8]}-{n}" for n in range(10)]
    with ThreadPoolExecutor(len(ids)) as threads:
        # Long streams, ten distinct conversations: both replicas carry some when the victim dies.
        outcomes = [threads.submit(_stream, pool, rid, f"topic {rid}", 400) for rid in ids]
        # Both replicas generating (tokens flowing: the victim's streams have sent their first bytes).
        generated = {url: vllm_counter(url, "vllm:generation_tokens_total") for url in pool.replicas}

        def both_generating() -> bool:
            return vllm_counter(victim, "vllm:num_requests_running") >= 1 and all(
                vllm_counter(url, "vllm:generation_tokens_total") > generated[url] + 20 for url in pool.replicas
            )

        wait_until(both_generating, timeout=60, interval=0.2)
        os.kill(vllm_server_pid(int(str(replica_status(STATE_DIR, 1)["group_pid"]))), signal.SIGKILL)
        # New requests while it is down: each one served by the survivor (a refused connection is tried again
        # there before the first byte, and the probe soon takes the victim out).
        during = [f"during-{uuid.uuid4().hex[:8]}-{n}" for n in range(6)]
        for rid in during:
            _chat(pool, _conversation(f"topic {rid}"), rid)
        results = {rid: outcome.result() for rid, outcome in zip(ids, outcomes, strict=True)}
    where = {rid: pool.replica_of(rid) for rid in ids}
    failed = [rid for rid, ok in results.items() if not ok]
    assert failed, "the victim had streams in flight"
    assert {where[rid] for rid in failed} == {victim}, (failed, where)
    assert all(ok for rid, ok in results.items() if where[rid] == survivor)
    assert {pool.replica_of(rid) for rid in during} <= {survivor, victim}

    # The supervisor restarts it and the gateway takes it back.
    wait_until(lambda: int(str(replica_status(STATE_DIR, 1)["restarts"])) == restarts + 1, timeout=30)
    wait_until(lambda: replica_status(STATE_DIR, 1).get("state") == "ready", timeout=300, interval=1.0)
    wait_until(lambda: pool.replica_state(victim)["ready"] is True, timeout=15)
    ids = [f"back-{uuid.uuid4().hex[:8]}-{n}" for n in range(8)]
    for rid in ids:
        _chat(pool, _conversation(f"topic {rid}"), rid)
    assert victim in {pool.replica_of(rid) for rid in ids}


def test_a_rolling_restart_of_every_replica_under_load_fails_no_request(pool: Pool) -> None:
    restarts = [int(str(replica_status(STATE_DIR, i)["restarts"])) for i in (0, 1)]
    stop = threading.Event()
    outcomes: list[tuple[str, bool]] = []

    def load(worker: int) -> None:
        for n in range(2000):  # bounded; the restart ends it long before
            if stop.is_set():
                return
            rid = f"rolling-{worker}-{n}-{uuid.uuid4().hex[:6]}"
            outcomes.append((rid, _stream(pool, rid, f"topic {rid}", 16)))

    threads = [threading.Thread(target=load, args=(worker,), daemon=True) for worker in range(3)]
    for thread in threads:
        thread.start()
    try:
        restart = subprocess.run(
            [sys.executable, "-m", "gateway", "replicas", "restart"],
            env={**os.environ, **pool.env},
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO_ROOT,
            check=False,
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=150)
    assert restart.returncode == 0, restart.stdout + restart.stderr
    assert [int(str(replica_status(STATE_DIR, i)["restarts"])) for i in (0, 1)] == [r + 1 for r in restarts]
    assert len(outcomes) >= 20, "the load ran through the restart"
    assert [rid for rid, ok in outcomes if not ok] == []
    served = {pool.replica_of(rid) for rid, _ in outcomes}
    assert served == set(pool.replicas), served
    # The command waited for each replica to be ready again and put it back.
    assert all(entry["ready"] and not entry["drained"] for entry in pool.ready()["replicas"])
