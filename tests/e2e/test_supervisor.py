"""The engine supervisor as a real process, supervising the fake engine through its vllm-serve-shaped CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.supervised import engine_env, fake_shm_files, group_alive, start_supervisor, status
from tests.procs import REPO_ROOT, ServerProcess, free_port, wait_until


def test_ready_then_restarted_after_a_crash(state_dir: Path) -> None:
    port = free_port()
    with start_supervisor(state_dir, port) as supervisor:
        first_pid = status(state_dir)["engine_pid"]
        cmdline = Path(f"/proc/{first_pid}/cmdline").read_text()
        assert "tests.fakes.fake_engine" in cmdline and "gateway.supervisor" not in cmdline, "vLLM, not its reaper"
        cli = subprocess.run(
            [sys.executable, "-m", "gateway", "engine", "status", "--json"],
            env={**os.environ, "NEMOTRON_ENGINE__STATE_DIR": str(state_dir)},
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            check=False,
        )
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert json.loads(cli.stdout)["state"] == "ready"
        # vLLM exits 0 when its engine core dies at request time: still a crash.
        httpx.post(f"http://127.0.0.1:{port}/_test/exit", json={"code": 0})
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=10)
        wait_until(lambda: status(state_dir).get("state") == "ready", timeout=15)
        assert status(state_dir)["engine_pid"] != first_pid
        assert status(state_dir)["last_exit_code"] == 0, json.dumps(status(state_dir))
        assert status(state_dir)["history"][-1]["cause"] == "crash"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert "engine exited" in supervisor.log_text() or "restart 1" in supervisor.log_text()


def test_the_nemotron_engine_script_supervises_and_reports_alike(state_dir: Path) -> None:
    """`nemotron-engine`, the engine unit's ExecStart, runs the same supervisor and its `status` answers alike."""
    script = str(Path(sys.executable).with_name("nemotron-engine"))
    port = free_port()
    with start_supervisor(state_dir, port, "--served-model-name", "nemo", command=(script,)):
        answers = [
            subprocess.run(
                [*command, "status", "--json"],
                env={**os.environ, "NEMOTRON_ENGINE__STATE_DIR": str(state_dir)},
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
                check=False,
            )
            for command in ([script], [sys.executable, "-m", "gateway", "engine"])
        ]
        assert answers[0].returncode == answers[1].returncode == 0, answers[0].stderr + answers[1].stderr
        assert answers[0].stdout == answers[1].stdout
        assert json.loads(answers[0].stdout)["state"] == "ready"
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["nemo"]  # the flag reached the engine


def test_hung_engine_is_killed_and_restarted(state_dir: Path) -> None:
    port = free_port()
    with start_supervisor(state_dir, port):
        old_group = int(str(status(state_dir)["group_pid"]))
        # Every answer hangs: a stopped API server.
        httpx.post(f"http://127.0.0.1:{port}/_test/freeze", json={"frozen": True, "api": True})
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=30)
        assert status(state_dir)["history"][-1]["cause"] == "unresponsive"
        wait_until(lambda: not group_alive(old_group), timeout=10)
        wait_until(lambda: status(state_dir).get("state") == "ready", timeout=30)


def test_stop_leaves_no_process_and_no_shared_memory(state_dir: Path) -> None:
    port = free_port()
    before = fake_shm_files()
    supervisor = start_supervisor(state_dir, port, NEMOTRON_ENGINE__EXTRA_ARGS='["--spawn-child"]')
    try:
        group = int(str(status(state_dir)["group_pid"]))
        assert len(group_alive(group)) == 3, "reaper, engine and its SIGTERM-deaf helper"
        assert fake_shm_files() - before
        supervisor.send_signal(signal.SIGTERM)
        wait_until(lambda: not supervisor.running, timeout=15, message="the supervisor did not exit on SIGTERM")
    finally:
        code = supervisor.stop()
    assert code == 0
    assert group_alive(group) == []
    assert fake_shm_files() - before == set(), "the helper's /dev/shm file must be removed"
    assert status(state_dir)["state"] == "stopped"


def test_sigkill_of_the_supervisor_takes_the_engine_group_down(state_dir: Path) -> None:
    port = free_port()
    before = fake_shm_files()
    supervisor = start_supervisor(state_dir, port, NEMOTRON_ENGINE__EXTRA_ARGS='["--spawn-child"]')
    try:
        group = int(str(status(state_dir)["group_pid"]))
        os.kill(supervisor.pid, signal.SIGKILL)
        # The reaper sees its stdin pipe close, and tears the group down (grace 1.5 s, then SIGKILL).
        wait_until(lambda: not group_alive(group), timeout=10, message="engine group survived its supervisor")
    finally:
        supervisor.stop()
    assert fake_shm_files() - before == set()


def test_crash_loop_ends_in_failed_with_a_nonzero_exit(state_dir: Path) -> None:
    launcher = [sys.executable, "-c", "import sys; print('engine boom: CUDA error'); sys.exit(3)"]
    env = engine_env(state_dir, free_port(), NEMOTRON_ENGINE__CRASH_LIMIT="3")
    env["NEMOTRON_ENGINE__LAUNCHER"] = json.dumps(launcher)
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "engine"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 1
    final = status(state_dir)
    assert final["state"] == "failed"
    assert final["restarts"] == 2 and final["last_exit_code"] == 3
    assert "engine boom: CUDA error" in result.stdout + result.stderr, "start-up failures show the engine's output"


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        ({"NEMOTRON_ENGINE__PROFILE": "turbo"}, "unknown engine profile 'turbo'; choose one of"),
        ({"NEMOTRON_ENGINE__MODEL": ""}, "no model configured"),
        (
            {"NEMOTRON_ENGINE__RUN_DOCTOR": "true", "NEMOTRON_ENGINE__MODEL": "/nonexistent/model"},
            "preflight checks failed",
        ),
    ],
)
def test_bad_configuration_fails_fast_with_a_clear_message(state_dir: Path, extra: dict[str, str], phrase: str) -> None:
    # "Fast": before any engine start, bounded by the subprocess timeout rather than a wall-clock assertion.
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "engine"],
        env={**os.environ, **engine_env(state_dir, free_port()), **extra},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 2
    assert phrase in result.stderr
    assert "Traceback" not in result.stderr
    assert not status(state_dir), "no engine was started"


def test_supervisor_metrics(state_dir: Path) -> None:
    port, metrics_port = free_port(), free_port()
    with start_supervisor(state_dir, port, NEMOTRON_ENGINE__METRICS_PORT=str(metrics_port)):
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    assert 'nemotron_supervisor_engine_state{replica="0",state="ready"} 1.0' in text
    assert 'nemotron_supervisor_engine_up{replica="0"} 1.0' in text


def test_up_serves_survives_an_engine_crash_and_stops_cleanly(
    up_stack: tuple[ServerProcess, int, int], state_dir: Path
) -> None:
    proc, engine_port, gateway_port = up_stack
    with openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused", max_retries=0) as sdk:
        answer = sdk.chat.completions.create(
            model="nemotron", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert answer.choices[0].message.content == "tok0 tok1"
        httpx.post(f"http://127.0.0.1:{engine_port}/_test/exit", json={"code": 1})
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{gateway_port}/ready").status_code == 503, timeout=10)
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.chat.completions.create(model="nemotron", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 503
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{gateway_port}/ready").status_code == 200, timeout=20)
        answer = sdk.chat.completions.create(
            model="nemotron", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        assert answer.choices[0].message.content == "tok0"
    wait_until(lambda: status(state_dir).get("state") == "ready", timeout=15)
    engine_group = int(str(status(state_dir)["group_pid"]))
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not proc.running, timeout=20)
    assert group_alive(engine_group) == []
    log = proc.log_text()
    assert log.index("gateway | ") < log.rindex("engine stopped")
