"""`nemotron-gateway replicas`: list, drain, restore and the rolling restart, against two replicas under a real
supervisor, real Redis, and a stand-in for the gateway's /ready (its `replicas` array, as the gateway answers it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.pool.drain import DRAINED_KEY
from tests.e2e.supervised import engine_env, free_ports, replica_status
from tests.procs import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.timeout(90)


class StandInGateway:
    """/ready as the gateway answers it: each local replica's readiness (its /health), drain (Redis) and requests in
    flight (set by the test). Every answer's drained URLs are kept, to see that replicas were drained one at a time."""

    def __init__(self, urls: list[str], redis_url: str) -> None:
        self.urls = urls
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5.0)
        self.in_flight = dict.fromkeys(urls, 0)
        self.drained_seen: list[frozenset[str]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                body = json.dumps({"replicas": stand_in.replicas()}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def replicas(self) -> list[dict[str, Any]]:
        drained = {url.decode() for url in self.redis.hkeys(DRAINED_KEY)}
        self.drained_seen.append(frozenset(drained))
        entries = []
        for url in self.urls:
            try:
                ready = httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                ready = False
            entries.append(
                {
                    "url": url,
                    "model": "nemotron",
                    "ready": ready,
                    "drained": url in drained,
                    "reason": None if ready else "no answer",
                    "in_flight": self.in_flight[url],
                }
            )
        return entries

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.redis.close()


@pytest.fixture
def two_replicas(state_dir: Path, redis_clean: str) -> Iterator[tuple[dict[str, str], StandInGateway]]:
    port = free_ports(2)
    env = engine_env(state_dir, port, NEMOTRON_ENGINE__REPLICAS="2", NEMOTRON_REDIS_URL=redis_clean)
    supervisor = ServerProcess(
        [sys.executable, "-m", "gateway", "engine"],
        env=env,
        ready_check=lambda: all(replica_status(state_dir, i).get("state") == "ready" for i in (0, 1)),
        start_timeout=30,
        stop_timeout=10,
        port=port,
    )
    gateway = StandInGateway([f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"], redis_clean)
    gateway.thread.start()
    try:
        with supervisor.start():
            yield {**env, "NEMOTRON_PORT": str(gateway.port)}, gateway
    finally:
        gateway.close()


def _replicas(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "replicas", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )


def test_list_drain_restore_and_a_rolling_restart(
    two_replicas: tuple[dict[str, str], StandInGateway], state_dir: Path
) -> None:
    env, gateway = two_replicas
    first, second = gateway.urls
    listed = _replicas(env, "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split() == ["URL", "MODEL", "READY", "DRAINED", "IN", "FLIGHT", "REASON"]
    assert f"{second}  nemotron  yes    no       0" in listed.stdout
    drained = _replicas(env, "drain", "1")
    assert drained.returncode == 0 and f"{second}: drained" in drained.stdout, drained.stderr
    as_json = [json.loads(line) for line in _replicas(env, "list", "--json").stdout.splitlines()]
    assert [(entry["url"], entry["drained"]) for entry in as_json] == [(first, False), (second, True)]
    assert _replicas(env, "restore", second).stdout == f"{second}: restored\n"
    assert _replicas(env, "restore", "1").stdout == f"{second}: was not drained\n"
    wrong = _replicas(env, "drain", "2")
    assert wrong.returncode == 2 and "replica 2 is not one of this host's 2 (0 to 1)" in wrong.stderr

    pids = [replica_status(state_dir, i)["engine_pid"] for i in (0, 1)]
    gateway.drained_seen.clear()
    restart = _replicas(env, "restart", "--ready-timeout", "30")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    assert "replica 0: ready again and restored" in restart.stdout
    assert restart.stdout.index("replica 0: ready again") < restart.stdout.index("replica 1 (")
    for index in (0, 1):
        now = replica_status(state_dir, index)
        assert now["engine_pid"] != pids[index] and now["history"][-1]["cause"] == "requested"  # type: ignore[index]
    # One at a time: never both drained, each drained at some point, none left drained.
    assert {frozenset({first}), frozenset({second})} <= set(gateway.drained_seen)
    assert frozenset({first, second}) not in gateway.drained_seen
    assert gateway.redis.hkeys(DRAINED_KEY) == []


def test_a_restart_whose_requests_do_not_finish_fails_and_restores_the_replica(
    two_replicas: tuple[dict[str, str], StandInGateway], state_dir: Path
) -> None:
    env, gateway = two_replicas
    gateway.in_flight[gateway.urls[1]] = 1  # a long stream that outlives the drain timeout
    pid = replica_status(state_dir, 1)["engine_pid"]
    restart = _replicas(env, "restart", "1", "--drain-timeout", "1")
    assert restart.returncode == 1
    assert "replica 1: requests still in flight after 1 s (--drain-timeout)" in restart.stderr
    assert "Traceback" not in restart.stderr
    assert gateway.redis.hkeys(DRAINED_KEY) == []  # restored
    assert replica_status(state_dir, 1)["engine_pid"] == pid  # never restarted
    assert not (state_dir / "replica-1" / "restart.request").exists()
