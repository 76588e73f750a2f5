"""Several engine replicas under one `nemotron-gateway engine`: each restarts alone, each reports, each restarts on
an operator's request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from gateway.engine.supervisor_state import request_restart
from tests.e2e.supervised import engine_env, free_ports, group_alive, replica_status
from tests.procs import REPO_ROOT, ServerProcess, free_port, wait_until


def _engine_status(state_dir: Path) -> tuple[int, dict[str, object]]:
    answer = subprocess.run(
        [sys.executable, "-m", "gateway", "engine", "status", "--json"],
        env={**os.environ, "NEMOTRON_ENGINE__STATE_DIR": str(state_dir), "NEMOTRON_ENGINE__REPLICAS": "2"},
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    return answer.returncode, dict(json.loads(answer.stdout))


def _both_ready(state_dir: Path) -> bool:
    return all(replica_status(state_dir, i).get("state") == "ready" for i in (0, 1))


def test_two_replicas_restart_alone_report_and_restart_on_request(state_dir: Path) -> None:
    port, metrics_port = free_ports(2), free_port()
    supervisor = ServerProcess(
        [sys.executable, "-m", "gateway", "engine"],
        env=engine_env(state_dir, port, NEMOTRON_ENGINE__REPLICAS="2", NEMOTRON_ENGINE__METRICS_PORT=str(metrics_port)),
        ready_check=lambda: _both_ready(state_dir),
        start_timeout=30,
        stop_timeout=10,
        port=port,
    )
    with supervisor.start():
        code, answer = _engine_status(state_dir)
        assert code == 0 and answer["ready"] is True, answer
        replicas = answer["replicas"]
        assert isinstance(replicas, list)
        assert [(r["replica"], r["port"], r["engine_url"]) for r in replicas] == [
            (0, port, f"http://127.0.0.1:{port}"),
            (1, port + 1, f"http://127.0.0.1:{port + 1}"),
        ]
        assert replicas[0]["supervisor_pid"] == replicas[1]["supervisor_pid"] == supervisor.pid
        first, second = (int(str(replica_status(state_dir, i)["engine_pid"])) for i in (0, 1))
        for index in (0, 1):
            assert httpx.get(f"http://127.0.0.1:{port + index}/health").status_code == 200

        # kill -9 of replica 1's vLLM: it alone restarts, replica 0 keeps its engine and stays ready throughout.
        os.kill(second, signal.SIGKILL)
        seen_zero: set[object] = set()

        def replica_1_back() -> bool:
            seen_zero.add(replica_status(state_dir, 0).get("state"))
            one = replica_status(state_dir, 1)
            return one.get("restarts") == 1 and one.get("state") == "ready"

        wait_until(replica_1_back, timeout=20, message="replica 1 was not restarted")
        one = replica_status(state_dir, 1)
        assert one["engine_pid"] != second and one["history"][-1]["cause"] == "crash"  # type: ignore[index]
        zero = replica_status(state_dir, 0)
        assert seen_zero == {"ready"} and zero["engine_pid"] == first and zero["restarts"] == 0
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'nemotron_supervisor_engine_restarts_total{replica="1"} 1.0' in text
        assert 'nemotron_supervisor_engine_up{replica="0"} 1.0' in text
        assert 'nemotron_supervisor_engine_up{replica="1"} 1.0' in text

        # An operator's restart request for replica 0: acted on without a crash, replica 1 untouched.
        restarted = int(str(one["engine_pid"]))
        request = request_restart(state_dir)
        wait_until(lambda: not request.exists(), timeout=5, message="the restart request was not taken")
        wait_until(
            lambda: (
                replica_status(state_dir, 0).get("restarts") == 1
                and replica_status(state_dir, 0).get("state") == "ready"
            ),
            timeout=20,
            message="replica 0 was not restarted on request",
        )
        zero = replica_status(state_dir, 0)
        assert zero["engine_pid"] != first and zero["history"][-1]["cause"] == "requested"  # type: ignore[index]
        assert replica_status(state_dir, 1)["engine_pid"] == restarted
        assert "engine 0: restart requested by an operator" in supervisor.log_text()
        assert "engine 1 ready" in supervisor.log_text()  # each replica's lines are named

        groups = [int(str(replica_status(state_dir, i)["group_pid"])) for i in (0, 1)]
        supervisor.send_signal(signal.SIGTERM)
        wait_until(lambda: not supervisor.running, timeout=20, message="the supervisor did not exit on SIGTERM")
    assert supervisor.stop() == 0
    assert [group_alive(group) for group in groups] == [[], []]
    assert [replica_status(state_dir, i)["state"] for i in (0, 1)] == ["stopped", "stopped"]
    assert _engine_status(state_dir)[0] == 1
