"""The shipped units under a real systemd: installed by deploy/install.sh into a booted Debian
container (tests/deploy/container.py), Redis and nginx inside, the fake engine as vLLM.

One container for the module, in the order an operator meets things: install (twice: idempotent), the
units verified, a streamed request, `systemctl restart nemotron-gateway` under load, nginx with the gateway
gone, `systemctl stop nemotron-engine`, `kill -9` of the supervisor, uninstall. Needs root; `make test-deploy`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.container import Container, nspawn_usable
from tests.procs import REPO_ROOT, wait_until

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

WHEELHOUSE = REPO_ROOT / ".cache" / "deploy-wheels"
RESULTS = REPO_ROOT / ".cache" / "deploy-results.json"
GRACE = 5.0
ENV = "/etc/nemotron-gateway/env"
CLI = "/opt/nemotron-gateway/.venv/bin/nemotron-gateway"
# The only settings the test adds to the env file install.sh writes: the fake engine as vLLM.
LAUNCHER = '["/opt/nemotron-gateway/.venv/bin/python", "/opt/nemotron-test/fake_engine.py", "serve", "--spawn-child"]'
TEST_SETTINGS = f"""
NEMOTRON_ENGINE__LAUNCHER='{LAUNCHER}'
NEMOTRON_ENGINE__MODEL=/srv/models/fake
NEMOTRON_ENGINE__PROFILE=cpu-dev
NEMOTRON_ENGINE__RUN_DOCTOR=false
NEMOTRON_SHUTDOWN_GRACE={GRACE:g}
"""
# `systemd-analyze security` exposure of the units before they were hardened (engine 9.2 UNSAFE, gateway 8.5 EXPOSED);
# the shipped ones must not be worse (they score 3.4 and 1.5).
EXPOSURE_BEFORE = {"nemotron-engine.service": 9.2, "nemotron-gateway.service": 8.5}
FIGURES: dict[str, object] = {}
LONG_STREAMS: list[dict[str, Any]] = []


def _build(stage: Path) -> None:
    """The project's wheel, the deploy folder, the fake engine and the load script, for the container."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(stage), "."],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    if not any(WHEELHOUSE.glob("async_timeout-*.whl")):
        # The dependencies, once (the container has no network): from the same indexes the venv came from.
        # Debian 12's Python is 3.11.2, where redis also needs async-timeout (its marker: python_full_version
        # < "3.11.3"), which a resolution on this newer Python leaves out.
        for what in (
            ["wheel", "-w", str(WHEELHOUSE), "."],
            ["download", "-d", str(WHEELHOUSE), "async-timeout>=4.0.3"],
        ):
            subprocess.run(
                [sys.executable, "-m", "pip", *what, "--quiet"], cwd=REPO_ROOT, check=True, capture_output=True
            )
    shutil.copytree(REPO_ROOT / "deploy", stage / "deploy")
    shutil.copy(REPO_ROOT / "tests" / "fakes" / "fake_engine.py", stage)
    shutil.copy(REPO_ROOT / "tests" / "deploy" / "restart_load.py", stage)


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = nspawn_usable()
    if reason is not None:
        pytest.skip(f"the real-systemd tier {reason}")
    stage = tmp_path_factory.mktemp("stage")
    _build(stage)
    return stage


@pytest.fixture(scope="module")
def box(stage: Path) -> Iterator[Container]:
    built = subprocess.run([REPO_ROOT / "scripts" / "deploy-root"], check=True, capture_output=True, text=True)
    root = REPO_ROOT / built.stdout.strip().splitlines()[-1]
    with Container(root, binds=[(stage, "/mnt/stage"), (WHEELHOUSE, "/mnt/wheels")]) as box:
        yield box
    if FIGURES:
        RESULTS.write_text(json.dumps(FIGURES, indent=2))


def _install(box: Container) -> str:
    """deploy/install.sh as an operator runs it, from the wheel and offline (the container has no network)."""
    install = "/mnt/stage/deploy/install.sh --package /mnt/stage/nemotron_gateway-*.whl --wheelhouse /mnt/wheels"
    return box.run(f"{install} --extra none", timeout=600).stdout


def _ready(box: Container, base: str = "http://127.0.0.1:8000") -> bool:
    return box.run(f"curl -s -o /dev/null -w '%{{http_code}}' {base}/ready", check=False).stdout == "200"


def _engine_pids(box: Container) -> list[int]:
    """Processes of the fake engine (the vLLM stand-in and its helper), wherever they are in the container."""
    out = box.run("ps -eo pid=,args=", check=False).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "fake_engine.py" in line and "ps -eo" not in line]


@pytest.fixture(scope="module")
def key(box: Container) -> str:
    out = _install(box)
    assert "Next steps" in out and "keys create" in out, out
    box.run(f"cat >> {ENV}", input=TEST_SETTINGS)
    box.run("install -D -m 0644 /mnt/stage/fake_engine.py /opt/nemotron-test/fake_engine.py")
    box.run(
        "install -d -m 0750 /etc/nemotron-gateway/tls && openssl req -x509 -newkey rsa:2048 -nodes -days 1 "
        "-subj /CN=localhost -keyout /etc/nemotron-gateway/tls/privkey.pem "
        "-out /etc/nemotron-gateway/tls/fullchain.pem 2>/dev/null"
    )
    box.run("ln -sf /etc/nginx/sites-available/nemotron-gateway /etc/nginx/sites-enabled/nemotron-gateway")
    box.run("systemctl start redis-server nginx nemotron-engine nemotron-gateway")
    wait_until(
        lambda: _ready(box), timeout=90, message=box.journal("nemotron-engine") + box.journal("nemotron-gateway")
    )
    # The load must meet no per-key limit: 0 is unlimited.
    create = f"{CLI} keys create --name first --rpm 0 --tpm 0 --max-concurrency 0 --env-file {ENV}"
    created = box.run(create).stdout.strip().splitlines()[-1]
    assert created.startswith("sk-"), created
    return created


def test_install_twice_changes_nothing_and_keeps_the_secret(box: Container, key: str) -> None:
    secrets = box.run(f"grep -E '^NEMOTRON_(AUTH__SECRET|ENGINE_API_KEY)=' {ENV}").stdout
    assert [len(line.split("=", 1)[1]) for line in secrets.splitlines()] == [64, 64]
    out = _install(box)
    assert "keeping /etc/nemotron-gateway/env" in out, out
    assert box.run(f"grep -E '^NEMOTRON_(AUTH__SECRET|ENGINE_API_KEY)=' {ENV}").stdout == secrets
    wait_until(lambda: _ready(box), timeout=60, message=box.journal("nemotron-gateway"))
    # Every setting is in the file, commented, with its description.
    text = box.run(f"cat {ENV}").stdout
    for name in (
        "#NEMOTRON_SHUTDOWN_GRACE=30.0",
        "#NEMOTRON_REDIS__COMMAND_TIMEOUT=",
        "#NEMOTRON_ENGINE__STALL_TIMEOUT=",
    ):
        assert name in text, name
    assert box.run(f"stat -c '%a %U:%G' {ENV}").stdout.strip() == "640 root:nemotron"


def test_units_pass_systemd_analyze_verify_and_security(box: Container, key: str) -> None:
    units = (
        "/etc/systemd/system/nemotron-engine.service /etc/systemd/system/nemotron-gateway.socket "
        "/etc/systemd/system/nemotron-gateway.service"
    )
    verify = box.run(f"systemd-analyze verify {units} 2>&1", check=False)
    complaints = [line for line in verify.stdout.splitlines() if "nemotron" in line]
    assert verify.returncode == 0 and not complaints, verify.stdout
    for unit, before in EXPOSURE_BEFORE.items():
        out = box.run(f"systemd-analyze security --no-pager {unit}").stdout
        score = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
        FIGURES[f"exposure.{unit}"] = score
        assert score <= before, f"{unit} exposure {score} is worse than before ({before})"
    assert box.show("nemotron-gateway.service", "NoNewPrivileges") == "yes"
    assert box.show("nemotron-engine.service", "LimitNOFILE") == "65536"
    # The per-replica template: installed, not enabled; an instance is its replica, hardened as the single engine.
    assert "NEMOTRON_ENGINE__REPLICA=1" in box.show("nemotron-engine@1.service", "Environment")
    for prop in ("NoNewPrivileges", "ProtectSystem", "DevicePolicy", "KillMode", "LimitNOFILE"):
        assert box.show("nemotron-engine@1.service", prop) == box.show("nemotron-engine.service", prop), prop
    assert box.show("nemotron-engine@1.service", "UnitFileState") in ("disabled", "indirect")
    # Not supported, and says so, instead of doing something half-way.
    assert box.run("systemctl reload nemotron-gateway", check=False).returncode != 0
    assert box.show("nemotron-gateway.service", "ActiveState") == "active"


def test_a_stream_through_the_gateway_and_nginx(box: Container, key: str) -> None:
    body = '{"model":"nemotron","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}'
    for base in ("http://127.0.0.1:8000", "https://127.0.0.1"):
        out = box.run(
            f"curl -ksN {base}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'Content-Type: application/json' -d '{body}'"
        ).stdout
        assert out.count("data: ") == 7 and out.rstrip().endswith("data: [DONE]"), out  # role, 5 tokens, [DONE]


def _restart_under_load(box: Container, key: str, *flags: str) -> dict[str, Any]:
    """tests/deploy/restart_load.py inside the container; asserts what every restart must keep."""
    engine_pid, engine_procs = box.show("nemotron-engine.service", "MainPID"), _engine_pids(box)
    old_gateway = box.show("nemotron-gateway.service", "MainPID")
    load = "/opt/nemotron-gateway/.venv/bin/python /mnt/stage/restart_load.py"
    run = box.run(
        f"{load} --direct http://127.0.0.1:8000 --nginx https://127.0.0.1 --key {key} --grace {GRACE:g} "
        + " ".join(flags),
        timeout=300,
    )
    report: dict[str, Any] = json.loads(run.stdout)
    assert report["restart_exit"] == 0
    assert box.show("nemotron-gateway.service", "MainPID") != old_gateway, "the gateway was not restarted"
    assert report["failed"] == [], [(r["target"], r["status"], r["error"]) for r in report["failed"]][:20]
    assert report["answered_after_restart"] > 0
    for stream in report["streams"]:
        if stream["kind"] == "short":
            assert stream["done"] and stream["error_events"] == 0 and stream["error"] is None, stream
    assert box.show("nemotron-engine.service", "MainPID") == engine_pid, "the engine supervisor was restarted"
    assert _engine_pids(box) == engine_procs, "the engine (the model) was restarted"
    return report


def test_restart_under_load_drops_nothing_and_keeps_the_engine(box: Container, key: str) -> None:
    # Non-streamed requests and streams that end within the grace in flight: the usual restart.
    FIGURES["restart"] = _restart_under_load(box, key)


def test_restart_with_streams_past_the_grace_drops_nothing(box: Container, key: str) -> None:
    # Streams that outlast NEMOTRON_SHUTDOWN_GRACE hold the old process for the whole grace, then end with the
    # error event the gateway writes at the grace's end (systemd's kill at TimeoutStopSec would cut them bare).
    FIGURES["restart_long_streams"] = report = _restart_under_load(box, key, "--long-streams")
    long = [stream for stream in report["streams"] if stream["kind"] == "long"]
    assert long and all(stream["error_events"] == 1 and not stream["done"] for stream in long), long
    LONG_STREAMS.extend(long)


def test_streams_past_the_grace_end_with_one_sse_error_event(box: Container, key: str) -> None:
    assert LONG_STREAMS, "test_restart_with_streams_past_the_grace_drops_nothing did not run"
    for stream in LONG_STREAMS:
        assert stream["error_events"] == 1 and not stream["done"] and stream["error"] is None, stream


def test_nginx_answers_in_the_openai_envelope_while_the_gateway_is_gone(box: Container, key: str) -> None:
    box.run("systemctl stop nemotron-gateway.socket nemotron-gateway.service")
    try:
        out = box.run("curl -ks -D - https://127.0.0.1/v1/models").stdout
        head, _, body = out.partition("\n\n")  # text mode: curl's CRLFs arrive as newlines
        assert head.startswith("HTTP/2 502") or head.startswith("HTTP/1.1 502"), out
        assert re.search(r"(?im)^retry-after: \d+", head), head
        assert json.loads(body)["error"]["code"] == "gateway_unavailable", body
    finally:
        box.run("systemctl start nemotron-gateway.socket nemotron-gateway.service")
    wait_until(lambda: _ready(box), timeout=60, message=box.journal("nemotron-gateway"))


def test_stopping_the_engine_leaves_no_process_and_no_shm_file(box: Container, key: str) -> None:
    assert _engine_pids(box), "the fake engine is not running"
    assert box.run("ls /dev/shm").stdout.count("fake-engine-") >= 1
    box.run("systemctl stop nemotron-engine", timeout=120)
    assert _engine_pids(box) == []
    assert "fake-engine-" not in box.run("ls /dev/shm").stdout


def test_kill_9_of_the_supervisor_is_restarted_by_systemd_without_an_orphan(box: Container, key: str) -> None:
    box.run("systemctl start nemotron-engine")
    wait_until(lambda: _ready(box), timeout=90, message=box.journal("nemotron-engine"))
    supervisor, old = box.show("nemotron-engine.service", "MainPID"), set(_engine_pids(box))
    restarts = int(box.show("nemotron-engine.service", "NRestarts"))
    killed_at = time.monotonic()
    box.run(f"kill -9 {supervisor}")
    # control-group: systemd removes what the supervisor left in the unit's cgroup before restarting it.
    wait_until(lambda: not old & set(_engine_pids(box)), timeout=60, message="the old engine outlived its supervisor")
    # RestartSec=30 as shipped.
    wait_until(lambda: int(box.show("nemotron-engine.service", "NRestarts")) == restarts + 1, timeout=90)
    wait_until(lambda: _ready(box), timeout=90, message=box.journal("nemotron-engine"))
    FIGURES["supervisor_kill9_to_ready_s"] = time.monotonic() - killed_at
    assert box.show("nemotron-engine.service", "MainPID") != supervisor
    assert not old & set(_engine_pids(box))


def test_uninstall_removes_units_and_venv_and_keeps_the_env_file(box: Container, key: str) -> None:
    box.run("/mnt/stage/deploy/install.sh --uninstall", timeout=120)
    assert box.run("ls /etc/systemd/system/ | grep -c nemotron", check=False).stdout.strip() == "0"
    assert box.run("test -e /opt/nemotron-gateway", check=False).returncode != 0
    assert box.run(f"test -f {ENV}", check=False).returncode == 0
    assert _engine_pids(box) == []
