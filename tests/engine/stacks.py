"""What the engine-tier modules share to run `nemotron-gateway up` on the CPU build of vLLM: its settings, the CLI,
and the running stack with a key of its own."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.engine.conftest import CACHE_ROOT
from tests.procs import REPO_ROOT, ServerProcess, wait_until


def gateway_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`nemotron-gateway ARGS` with `env` over this process's environment; the caller checks the outcome."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        check=False,
    )


def up_settings(
    model: str | Path, redis_url: str, *, engine_port: int, gateway_port: int, state_dir: Path
) -> dict[str, str]:
    """The settings every engine-tier stack starts from (a module adds or overrides its own)."""
    return {
        "NEMOTRON_ENGINE__MODEL": str(model),
        "NEMOTRON_ENGINE__PROFILE": "cpu-dev",
        "NEMOTRON_ENGINE__PORT": str(engine_port),
        # A module's own state dir: a supervisor finds the running engine of another module in a shared one.
        "NEMOTRON_ENGINE__STATE_DIR": str(state_dir),
        "NEMOTRON_ENGINE__METRICS_PORT": "0",
        "NEMOTRON_PORT": str(gateway_port),
        # One gateway process: the CPU engine needs this machine's cores more than the gateway does.
        "NEMOTRON_WORKERS": "1",
        "NEMOTRON_REDIS_URL": redis_url,
        "NEMOTRON_RELAY__PROBE_INTERVAL": "0.5",
        # vLLM's verdict on the command line is one more import of vLLM beside each start (20-60 s of a core):
        # test_stack.py, the whole product, asks it; the modules that test something else do not.
        "NEMOTRON_ENGINE__RUN_DOCTOR": "false",
        "VLLM_CACHE_ROOT": str(CACHE_ROOT / "vllm"),
        "HF_HUB_OFFLINE": "1",
    }


def running_in_vllm(engine: str) -> float:
    """vLLM's own gauge of the requests it is generating for (`engine`: its URL), summed over its engines. It is set
    from the engine core's stats, which reach the API server a step or more behind the tokens: wait for a value,
    never read it once."""
    return _vllm_stats(engine)[0]


def _vllm_stats(engine: str) -> tuple[float, float]:
    """vLLM's running-requests gauge and generated-tokens counter, from one read of its /metrics."""
    text = httpx.get(f"{engine}/metrics", timeout=5).text
    running = sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text, re.M))
    generated = sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)", text, re.M))
    return running, generated


def generated_in_vllm(engine: str) -> float:
    """vLLM's own count of the tokens it has generated (`engine`: its URL), summed over its engines."""
    return _vllm_stats(engine)[1]


def tokens_generated_since(engine: str, before: float, timeout: float = 30) -> float:
    """The tokens vLLM generated since its counter read `before`, once what began since is over: the counter has
    counted some and the running gauge, set from the same stats, reads 0. An abort shows as fewer than asked for;
    a generation that went on for a gone client is waited out and shows all of them. Reading the gauge alone
    flakes both ways: a fast generation can be over before a poll sees it running."""

    def ended() -> float:
        running, generated = _vllm_stats(engine)
        return generated - before if generated > before and running == 0 else 0.0

    return wait_until(ended, timeout=timeout, message="vLLM counted no tokens or is still generating")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc; the ones gone meanwhile left out."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                    found += [int(child), *descendants(int(child))]
    return found


def engine_core_pid(root: int) -> int | None:
    """vLLM's EngineCore process below `root`, once it exists: its title (VLLM::EngineCore) is in its cmdline
    (comm cuts it to "VLLM::EngineCor")."""
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def vllm_server_pid(guard_pid: int) -> int:
    """The `vllm serve` process of a supervisor's engine: the only child of its guard (`group_pid` in its status)."""
    children = Path(f"/proc/{guard_pid}/task/{guard_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@contextlib.contextmanager
def running_up(
    env: dict[str, str],
    *up_args: str,
    key_prefix: str,
    rpm: int = 1000,
    tpm: int = 10_000_000,
    key_flags: tuple[str, ...] = (),
) -> Iterator[tuple[ServerProcess, str]]:
    """`nemotron-gateway up UP_ARGS` with `env`, ready, and a key of its own (`keys create` with `key_flags` too;
    revoked afterwards)."""
    name = f"{key_prefix}-{uuid.uuid4().hex[:8]}"
    created = gateway_cli(env, "keys", "create", "--name", name, "--rpm", str(rpm), "--tpm", str(tpm), *key_flags)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    gateway_port = env["NEMOTRON_PORT"]
    proc = ServerProcess(
        [sys.executable, "-m", "gateway", "up", *up_args],
        env=env,
        ready_url=f"http://127.0.0.1:{gateway_port}/ready",
        start_timeout=420,
        stop_timeout=30,
        port=int(gateway_port),
    )
    try:
        with proc.start():
            yield proc, key
    finally:
        gateway_cli(env, "keys", "revoke", name)
