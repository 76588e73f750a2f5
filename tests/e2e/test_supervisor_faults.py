"""Engine faults the supervisor must tell apart, on the fake engine as a real process tree.

A frozen engine (/health still 200, no token) is restarted within `stall_timeout + health_interval`;
a busy one whose /health and /metrics answer late while tokens flow is never restarted; a hang kill
leaves no /dev/shm semaphore behind; `engine status` says which process vLLM is and why it restarted;
under `up`, a gateway that exits is restarted while the engine keeps running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from gateway.supervisor.process import held_inodes
from tests.e2e.supervised import engine_status_text, fake_shm_files, group_alive, start_supervisor, status
from tests.procs import ServerProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

STALL = 2.0
INTERVAL = 0.3
# The documented bound (stall_timeout + health_interval) plus room for a loaded 2-core machine.
RESTART_DEADLINE = STALL + INTERVAL + 20


def stream_in_background(port: int, tokens: int, token_delay: float) -> tuple[threading.Thread, list[int]]:
    """A streamed completion read to its end in a thread; the list gets how many chunks arrived."""
    received: list[int] = [0]

    def read() -> None:
        body = {"model": "nemotron", "prompt": "x", "max_tokens": tokens, "stream": True}
        body["fake_token_delay"] = token_delay
        # A killed engine cuts the stream: that ends the reading, it is not the test's failure.
        with contextlib.suppress(httpx.HTTPError):
            url = f"http://127.0.0.1:{port}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        received[0] += 1

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, received


@pytest.mark.parametrize("load", ["idle", "streaming"])
def test_frozen_generation_with_health_200_is_restarted(state_dir: Path, load: str) -> None:
    port = free_port()
    with start_supervisor(state_dir, port, NEMOTRON_ENGINE__STALL_TIMEOUT=str(STALL)):
        first = status(state_dir)
        if load == "streaming":
            _, received = stream_in_background(port, tokens=1000, token_delay=0.02)
            wait_until(lambda: received[0] > 5, timeout=10)
        # The engine core stops; the API server still answers /health 200 (vLLM with EngineCore stopped).
        httpx.post(f"http://127.0.0.1:{port}/_test/freeze", json={"frozen": True})
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=RESTART_DEADLINE)
        last = status(state_dir)["history"][-1]
        assert last["cause"] == "not generating"
        assert f"no progress for {STALL:.0f} s" in last["reason"] or "no progress for" in last["reason"]
        wait_until(lambda: not group_alive(int(str(first["group_pid"]))), timeout=10)
        wait_until(lambda: status(state_dir).get("state") == "ready", timeout=30)
        text = engine_status_text(state_dir)
        assert "not generating" in text
        assert f"engine pid      {status(state_dir)['engine_pid']} " in text


def test_busy_engine_with_slow_health_and_metrics_is_never_restarted(state_dir: Path) -> None:
    port = free_port()
    with start_supervisor(state_dir, port, NEMOTRON_ENGINE__STALL_TIMEOUT="3"):
        base = f"http://127.0.0.1:{port}"
        # A saturated API server: /health and /metrics answer after 1.5 s (3 x probe_timeout), tokens flow.
        httpx.post(f"{base}/_test/health", json={"status": 200, "delay": 1.5})
        scrapes = httpx.get(f"{base}/_test/stats").json()["metrics_scrapes"]
        thread, received = stream_in_background(port, tokens=200, token_delay=0.05)
        thread.join(timeout=60)
        assert received[0] >= 200, "the stream must finish: the engine was never killed under it"
        # The supervisor looked at the engine several times while it was slow, and left it alone.
        assert httpx.get(f"{base}/_test/stats").json()["metrics_scrapes"] - scrapes >= 3
        assert status(state_dir)["restarts"] == 0
        assert status(state_dir)["state"] == "ready"


def test_hang_kill_leaves_no_semaphore_in_dev_shm(state_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    report = tmp_path / "semaphore"
    extra = json.dumps(["--leak-semaphore", str(report)])
    with start_supervisor(state_dir, port, NEMOTRON_ENGINE__EXTRA_ARGS=extra):
        path = wait_until(lambda: report.exists() and report.read_text(), timeout=30)
        assert Path(path).exists()
        # Its creator is gone: no process maps or holds it; only the group's resource tracker knows it.
        wait_until(lambda: os.stat(path).st_ino not in held_inodes(), timeout=10)
        assert Path(path).exists()
        httpx.post(f"http://127.0.0.1:{port}/_test/freeze", json={"frozen": True, "api": True})
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=RESTART_DEADLINE)
        wait_until(lambda: not Path(path).exists(), timeout=10, message=f"{path} survived the hang kill")


def answers_ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
    except httpx.HTTPError:
        return False  # the restarted gateway is not listening yet


def gateway_server_pid(up_pid: int) -> int | None:
    """The `gateway serve` process under `up` (its reaper's child), if one runs."""
    for reaper in Path(f"/proc/{up_pid}/task/{up_pid}/children").read_text().split():
        try:
            children = Path(f"/proc/{reaper}/task/{reaper}/children").read_text().split()
            for child in children:
                if "serve" in Path(f"/proc/{child}/cmdline").read_text().split("\0"):
                    return int(child)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_up_restarts_an_exited_gateway_and_keeps_the_engine(
    up_stack: tuple[ServerProcess, int, int], state_dir: Path, sig: signal.Signals
) -> None:
    proc, _, gateway_port = up_stack
    engine_pid = status(state_dir)["engine_pid"]
    first = wait_until(lambda: gateway_server_pid(proc.pid), timeout=10)
    os.kill(first, sig)
    # The supervisor's word first: until the gateway's reaper has ended the killed gateway's workers, they
    # still answer on the port.
    wait_until(lambda: "restarting it in" in proc.log_text(), timeout=30)
    wait_until(lambda: gateway_server_pid(proc.pid) not in (None, first), timeout=30)
    wait_until(lambda: answers_ready(gateway_port), timeout=30)
    assert proc.running
    assert status(state_dir)["engine_pid"] == engine_pid, "the engine was not restarted"
    assert status(state_dir)["restarts"] == 0
    log = proc.log_text()
    # The supervisor's checks (every 0.3 s here) leave no trace in the log: no httpx line per request.
    assert "HTTP Request:" not in log


def test_up_ends_and_restarts_a_gateway_whose_reaper_was_killed(
    up_stack: tuple[ServerProcess, int, int], state_dir: Path
) -> None:
    # Killed alone, the gateway's reaper leaves its gateway and workers serving with nobody to end them: `up` ends
    # that group itself and starts a new gateway on the freed port, the engine untouched.
    proc, _, gateway_port = up_stack
    engine_pid = status(state_dir)["engine_pid"]
    first = wait_until(lambda: gateway_server_pid(proc.pid), timeout=10)
    reaper = os.getpgid(first)
    assert reaper != first and reaper != proc.pid
    os.kill(reaper, signal.SIGKILL)
    wait_until(lambda: "restarting it in" in proc.log_text(), timeout=30, message=proc.log_text()[-3000:])
    assert group_alive(reaper) == [], "the old gateway's processes must be gone before the restart"
    wait_until(lambda: gateway_server_pid(proc.pid) not in (None, first), timeout=30)
    wait_until(lambda: answers_ready(gateway_port), timeout=30)
    assert proc.running
    assert status(state_dir)["engine_pid"] == engine_pid, "the engine was not restarted"


def test_group_killed_from_outside_leaves_no_shared_memory(state_dir: Path) -> None:
    # `kill -9 -PGID` or the OOM killer takes the reaper too: the supervisor removes what the group held.
    port = free_port()
    before = fake_shm_files()
    with start_supervisor(state_dir, port, NEMOTRON_ENGINE__EXTRA_ARGS='["--spawn-child"]'):
        left = wait_until(lambda: fake_shm_files() - before, timeout=10)
        os.killpg(int(str(status(state_dir)["group_pid"])), signal.SIGKILL)
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=30)
        wait_until(lambda: not left & fake_shm_files(), timeout=10, message=f"{sorted(left)} survived the kill")
