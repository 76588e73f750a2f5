"""The supervisor as a real process over the fake engine: its environment, status file and process group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.procs import REPO_ROOT, ServerProcess, free_port

FAKE_LAUNCHER = [sys.executable, "-m", "tests.fakes.fake_engine", "serve"]


def engine_env(state_dir: Path, port: int, **extra: str) -> dict[str, str]:
    return {
        "NEMOTRON_ENGINE__LAUNCHER": json.dumps(FAKE_LAUNCHER),
        "NEMOTRON_ENGINE__MODEL": "/models/fake",
        "NEMOTRON_ENGINE__PORT": str(port),
        "NEMOTRON_ENGINE__PROFILE": "cpu-dev",
        "NEMOTRON_ENGINE__STATE_DIR": str(state_dir),
        "NEMOTRON_ENGINE__METRICS_PORT": "0",
        "NEMOTRON_ENGINE__HEALTH_INTERVAL": "0.3",
        "NEMOTRON_ENGINE__PROBE_TIMEOUT": "0.5",
        "NEMOTRON_ENGINE__PROBE_FAILURES": "2",
        "NEMOTRON_ENGINE__STALL_TIMEOUT": "2",
        "NEMOTRON_ENGINE__BACKOFF_INITIAL": "0.2",
        "NEMOTRON_ENGINE__STOP_GRACE": "1.5",
        # The fake engine needs no model directory; the preflight has its own test below.
        "NEMOTRON_ENGINE__RUN_DOCTOR": "false",
        **extra,
    }


def engine_status_text(state_dir: Path) -> str:
    """What `nemotron-gateway engine status` prints for the supervisor of `state_dir`."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "engine", "status"],
        env={**os.environ, "NEMOTRON_ENGINE__STATE_DIR": str(state_dir)},
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    return result.stdout


def up_process(env: dict[str, str], gateway_port: int) -> ServerProcess:
    """`nemotron-gateway up` over the fake engine with `env` (from `engine_env`), ready once the gateway's /ready
    answers 200; not started."""
    return ServerProcess(
        [sys.executable, "-m", "gateway", "up"],
        env=env,
        ready_url=f"http://127.0.0.1:{gateway_port}/ready",
        start_timeout=30,
        stop_timeout=15,
        port=gateway_port,
    )


def status(state_dir: Path) -> dict[str, object]:
    try:
        return dict(json.loads((state_dir / "engine.json").read_text()))
    except (OSError, ValueError):
        return {}


def group_alive(pgid: int) -> list[int]:
    """Pids still alive in a process group (zombies excluded)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                alive.append(int(entry.name))
    return alive


def fake_shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("fake-engine-")}


# The engine command as `nemotron-gateway engine` runs it; `nemotron-engine` is the same command by another name.
GATEWAY_ENGINE = (sys.executable, "-m", "gateway", "engine")


def start_supervisor(
    state_dir: Path, port: int, *verb_args: str, command: tuple[str, ...] = GATEWAY_ENGINE, **extra: str
) -> ServerProcess:
    proc = ServerProcess(
        [*command, *verb_args],
        env=engine_env(state_dir, port, **extra),
        ready_check=lambda: status(state_dir).get("state") == "ready",
        start_timeout=30,
        stop_timeout=10,
        port=port,
    )
    return proc.start()


def free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that nothing listens on now (a base port whose
    replicas take the ones after it)."""
    for _ in range(50):
        base = free_port()
        if base + count <= 65535 and all(port_free(base + offset) for offset in range(1, count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def replica_status(state_dir: Path, index: int) -> dict[str, object]:
    """The status file of replica `index` of the supervisor whose state dir is `state_dir`."""
    return status(state_dir if index == 0 else state_dir / f"replica-{index}")
