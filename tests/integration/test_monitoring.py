"""The shipped monitoring against a real Prometheus (Debian's `prometheus` package) on loopback: the scrape config
of deploy/prometheus/ pointed at a supervisor, its fake engine and a gateway in front; after a known sequence of
requests every counter has its exact value in Prometheus and every dashboard panel's query returns data.

Also: promtool checks and unit-tests the alert rules, /metrics answers only allowed networks or the token, a
revoked key's series stop being exported, one JSON access line per request, and the dashboard PNG.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.grafana.dashboard import load_dashboard, panel_queries, render
from tests.e2e.supervised import start_supervisor, status
from tests.integration.test_keys_limits import PEPPER, UNKNOWN_SECRET, create_keys, keys_cli
from tests.procs import REPO_ROOT, ServerProcess, free_port, run_gateway, wait_until

pytestmark = pytest.mark.timeout(240)

PROMETHEUS_DIR = REPO_ROOT / "deploy" / "prometheus"
MODEL = "nemotron"
TOKEN = "scrape-token-for-the-test"
GUARD_LIMIT = 3
GATEWAY_ENV = {
    "NEMOTRON_AUTH__SECRET": PEPPER,
    "NEMOTRON_AUTH__FAILED_AUTH_LIMIT": str(GUARD_LIMIT),
    "NEMOTRON_AUTH__FAILED_AUTH_WINDOW": "60",
    "NEMOTRON_AUTH__FAILED_AUTH_BLOCK": "60",
    "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2",
    "NEMOTRON_LOG_FORMAT": "json",
    "NEMOTRON_METRICS__TOKEN": TOKEN,
}


def _binary(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        pytest.fail(f"{name} is not installed (scripts/test installs Debian's prometheus as root)", pytrace=False)
    return found


@dataclass
class Stack:
    gateway: ServerProcess
    supervisor: ServerProcess
    state_dir: Path
    prometheus: str
    started: float
    secrets: dict[str, str]
    redis_url: str
    # (route, status) -> count, and the other counters, as the client saw them.
    answers: Counter[tuple[str, str]] = field(default_factory=Counter)
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        answer.raise_for_status()
        result: list[dict[str, Any]] = answer.json()["data"]["result"]
        return result

    def value(self, metric: str, **labels: str) -> float | None:
        selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
        found = self.query(f"sum({metric}{{{selector}}})")
        return float(found[0]["value"][1]) if found else None


def _scrape_config(gateway_port: int, supervisor_port: int, rules: Path) -> str:
    """The shipped config with its targets pointed at the test's processes and a 1 s interval."""
    text = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    replacements = {
        "scrape_interval: 15s": "scrape_interval: 1s",
        "evaluation_interval: 15s": "evaluation_interval: 1s",
        "  - alerts.yml": f"  - {rules}",
        '"127.0.0.1:8000"': f'"127.0.0.1:{gateway_port}"',
        '"127.0.0.1:9101"': f'"127.0.0.1:{supervisor_port}"',
    }
    for old, new in replacements.items():
        assert old in text, f"the shipped scrape config no longer has {old!r}"
        text = text.replace(old, new)
    return text


@contextlib.contextmanager
def _prometheus(config: str, workdir: Path) -> Iterator[str]:
    port = free_port()
    workdir.mkdir()
    (workdir / "prometheus.yml").write_text(config)
    argv = [
        _binary("prometheus"),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    url = f"http://127.0.0.1:{port}"
    try:

        def targets_up() -> bool:
            try:
                active = httpx.get(f"{url}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        wait_until(targets_up, timeout=60, interval=0.5, message="Prometheus never saw its three targets up")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def _chat(max_tokens: int = 4, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, **extra}
    return {**body, "stream": True} if stream else body


def _headers(secret: str | None, address: str) -> dict[str, str]:
    headers = {"X-Forwarded-For": address}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    return headers


CHAT = "/v1/chat/completions"


def _run_sequence(stack: Stack) -> None:
    """Success (non-stream and stream), 400, engine error, a stream its client leaves, 401 by cause, 429 by limit;
    each answer tallied as the client saw it."""
    alpha = stack.secrets["alpha"]
    seen = stack.answers
    tokens: Counter[str] = Counter()
    guesses = 0
    with httpx.Client(base_url=stack.url, timeout=20) as client:
        for _ in range(3):
            answer = client.post(CHAT, json=_chat(), headers=_headers(alpha, "198.51.100.1"))
            seen[(CHAT, str(answer.status_code))] += 1
            tokens["prompt"] += answer.json()["usage"]["prompt_tokens"]
            tokens["completion"] += answer.json()["usage"]["completion_tokens"]
        with client.stream("POST", CHAT, json=_chat(5, stream=True), headers=_headers(alpha, "198.51.100.1")) as sse:
            assert sse.read().endswith(b"data: [DONE]\n\n")
            seen[(CHAT, str(sse.status_code))] += 1
        bad = {"model": MODEL, "messages": [{"role": "User", "content": "hi"}]}
        seen[(CHAT, str(client.post(CHAT, json=bad, headers=_headers(alpha, "198.51.100.1")).status_code))] += 1
        failed = client.post(CHAT, json=_chat(fake_status=500), headers=_headers(alpha, "198.51.100.1"))
        seen[(CHAT, str(failed.status_code))] += 1
        # 401s by cause, each from its own address so the failed-auth guard does not step in.
        for secret, address in (
            (None, "198.51.100.21"),
            ("sk-short", "198.51.100.22"),
            (UNKNOWN_SECRET, "198.51.100.23"),
        ):
            seen[(CHAT, str(client.post(CHAT, json=_chat(), headers=_headers(secret, address)).status_code))] += 1
        # Guessing from one address until it is blocked: 429 failed_auth.
        for _ in range(GUARD_LIMIT + 10):
            code = client.post(CHAT, json=_chat(), headers=_headers(UNKNOWN_SECRET, "198.51.100.30")).status_code
            seen[(CHAT, str(code))] += 1
            if code == 429:
                break
            guesses += 1
        for _ in range(2):  # --rpm 1: the second is refused for requests
            code = client.post(CHAT, json=_chat(), headers=_headers(stack.secrets["rpm"], "198.51.100.2")).status_code
            seen[(CHAT, str(code))] += 1
        # --tpm 20 and 30 tokens asked: refused as too large, counted under tokens.
        code = client.post(CHAT, json=_chat(30), headers=_headers(stack.secrets["tpm"], "198.51.100.3")).status_code
        seen[(CHAT, str(code))] += 1
        held = _chat(40, stream=True, fake_token_delay=0.05)
        with client.stream("POST", CHAT, json=held, headers=_headers(stack.secrets["conc"], "198.51.100.4")) as sse:
            chunks = sse.iter_raw()
            next(chunks)
            refused = client.post(CHAT, json=_chat(), headers=_headers(stack.secrets["conc"], "198.51.100.4"))
            seen[(CHAT, str(refused.status_code))] += 1
            assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
            seen[(CHAT, str(sse.status_code))] += 1
        # A stream whose client leaves after the first chunk: 499, one stream disconnect.
        leaving = _chat(200, stream=True, fake_token_delay=0.05)
        with client.stream("POST", CHAT, json=leaving, headers=_headers(alpha, "198.51.100.1")) as sse:
            next(sse.iter_raw())
        seen[(CHAT, "499")] += 1
    assert seen[(CHAT, "200")] == 6 and seen[(CHAT, "400")] == 1 and seen[(CHAT, "500")] == 1
    assert guesses >= GUARD_LIMIT and seen[(CHAT, "401")] == 3 + guesses and seen[(CHAT, "429")] == 4, seen
    expected = stack.expected
    for (route, code), count in seen.items():
        expected[("nemotron_gateway_requests_total", (("route", route), ("status", code)))] = count
    for limit in ("requests", "tokens", "concurrency", "failed_auth"):
        expected[("nemotron_gateway_rate_limited_total", (("limit", limit),))] = 1
    for cause, count in (("missing", 1), ("malformed", 1), ("unknown", 1 + guesses)):
        expected[("nemotron_gateway_auth_failures_total", (("cause", cause),))] = count
    expected[("nemotron_gateway_engine_errors_total", (("kind", "error_status"),))] = 1
    expected[("nemotron_gateway_client_disconnects_total", (("mode", "stream"),))] = 1
    expected[("nemotron_gateway_key_requests_total", (("key", "alpha"), ("status", "200")))] = 4
    expected[("nemotron_gateway_key_requests_total", (("key", "rpm"), ("status", "429")))] = 1
    expected[("nemotron_gateway_key_tokens_total", (("key", "alpha"), ("kind", "completion")))] = (
        tokens["completion"] + 5
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("monitoring")
    engine_port, supervisor_port = free_port(), free_port()
    with contextlib.ExitStack() as stop:
        supervisor = stop.enter_context(
            start_supervisor(workdir, engine_port, NEMOTRON_ENGINE__METRICS_PORT=str(supervisor_port))
        )
        gateway = stop.enter_context(run_gateway(f"http://127.0.0.1:{engine_port}", redis_url, env=GATEWAY_ENV))
        flags = {
            "alpha": ["--daily-tokens", "1000000"],
            "rpm": ["--rpm", "1"],
            "tpm": ["--tpm", "20"],
            "conc": ["--max-concurrency", "1"],
        }
        secrets = create_keys(redis_url, flags)
        rules = workdir / "alerts.yml"
        shutil.copy(PROMETHEUS_DIR / "alerts.yml", rules)
        prometheus = stop.enter_context(
            _prometheus(_scrape_config(gateway.port, supervisor_port, rules), workdir / "prometheus")
        )
        yield Stack(gateway, supervisor, workdir, prometheus, time.time(), secrets, redis_url)


@pytest.fixture(scope="module")
def after_sequence(stack: Stack) -> Stack:
    _run_sequence(stack)
    key = ("nemotron_gateway_requests_total", (("route", CHAT), ("status", "499")))
    wait_until(
        lambda: stack.value(key[0], **dict(key[1])) == stack.expected[key],
        timeout=30,
        interval=0.5,
        message="Prometheus never scraped the sequence's last request",
    )
    return stack


def test_counters_have_exact_values_in_prometheus(after_sequence: Stack) -> None:
    stack = after_sequence
    wrong = {}
    for (metric, labels), want in stack.expected.items():
        got = stack.value(metric, **dict(labels))
        if got != want:
            wrong[f"{metric}{dict(labels)}"] = (got, want)
    assert not wrong, f"(Prometheus, expected): {wrong}"
    # The engine's own metrics reach Prometheus through the gateway's relay, as their own job.
    assert stack.query('vllm:num_requests_running{job="nemotron-engine"}')
    assert stack.value("nemotron_supervisor_engine_up") == 1
    assert stack.value("process_resident_memory_bytes", job="nemotron-gateway")


def test_every_dashboard_panel_returns_data(after_sequence: Stack) -> None:
    stack = after_sequence
    has_gpu = Path("/dev/nvidiactl").exists()
    queries = [q for q in panel_queries(load_dashboard()) if has_gpu or "_gpu_" not in q.expr]

    def empty() -> list[str]:
        return [f"{q.panel}: {q.expr}" for q in queries if not stack.query(q.expr)]

    # A rate() needs two scrapes of a series in its window: wait for them rather than for a fixed time.
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not empty(), timeout=30, interval=1.0)
    assert not empty(), "panels without data:\n" + "\n".join(empty())
    if not has_gpu:
        # No GPU: no GPU series at all, rather than zeros.
        assert "nemotron_gateway_gpu_" not in httpx.get(f"{stack.url}/metrics", timeout=10).text


def test_json_access_lines_hold_the_request_and_no_secret(after_sequence: Stack) -> None:
    log = after_sequence.gateway.log_text()
    lines = [json.loads(line[line.index("{") :]) for line in log.splitlines() if "gateway.access" in line]
    api = [line for line in lines if line["route"] == CHAT]
    assert len(api) == sum(after_sequence.answers.values())
    first = api[0]
    assert first["key"] == "alpha" and first["status"] == 200 and first["model"] == MODEL
    assert first["prompt_tokens"] is not None and first["duration_ms"] > 0 and first["client"] == "198.51.100.1"
    assert {line["cause"] for line in api if line["status"] == 429} == {
        "requests",
        "tokens",
        "concurrency",
        "failed_auth",
    }
    assert any(line["disconnected"] and line["status"] == 499 for line in api)
    assert any(line["engine_error"] == "error_status" for line in api)
    for secret in after_sequence.secrets.values():
        assert secret not in log
    assert "hello" not in log, "the prompt is never logged"


def test_metrics_answer_allowed_networks_or_the_token(stack: Stack) -> None:
    outside = {"X-Forwarded-For": "203.0.113.9"}
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        for path in ("/metrics", "/metrics/engine"):
            refused = client.get(path, headers=outside)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "metrics_forbidden"
            assert client.get(path, headers={**outside, "Authorization": f"Bearer {TOKEN}"}).status_code == 200
            assert client.get(path, headers={**outside, "Authorization": "Bearer wrong"}).status_code == 403
            assert client.get(path).status_code == 200  # loopback
        assert "vllm:num_requests_running" in client.get("/metrics/engine").text


def test_a_revoked_keys_series_stop_being_exported(stack: Stack, redis_url: str) -> None:
    secret = create_keys(redis_url, {"short-lived": ["--rpm", "0"]})["short-lived"]
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        assert client.post(CHAT, json=_chat(), headers=_headers(secret, "198.51.100.40")).status_code == 200
        assert 'key="short-lived"' in client.get("/metrics").text
        [revoked] = keys_cli(redis_url, ["revoke", "short-lived"])
        assert revoked.returncode == 0, revoked.stderr
        wait_until(
            lambda: 'key="short-lived"' not in client.get("/metrics").text,
            timeout=10,
            message="a revoked key's series are still exported",
        )
        assert 'key="alpha"' in client.get("/metrics").text


def test_supervisor_exports_restarts_last_exit_and_start_up(after_sequence: Stack) -> None:
    stack = after_sequence
    startup = stack.value("nemotron_supervisor_engine_startup_duration_seconds")
    assert startup is not None and startup > 0
    engine_pid = int(str(status(stack.state_dir)["engine_pid"]))
    os.kill(engine_pid, signal.SIGKILL)
    wait_until(
        lambda: (
            stack.value("nemotron_supervisor_engine_restarts_total") == 1
            and stack.value("nemotron_supervisor_engine_last_exit", cause="crash") == 1
            and stack.value("nemotron_supervisor_engine_up") == 1
        ),
        timeout=60,
        interval=0.5,
        message="the restart never showed in Prometheus",
    )


def test_promtool_checks_the_config_and_unit_tests_the_alerts() -> None:
    promtool = _binary("promtool")
    for argv in (
        [promtool, "check", "config", "prometheus.yml"],
        [promtool, "check", "rules", "alerts.yml"],
        [promtool, "test", "rules", "alerts_test.yml"],
    ):
        done = subprocess.run(argv, cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"{' '.join(argv[1:])}:\n{done.stdout}{done.stderr}"
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS_DIR / "alerts_test.yml").read_text()))
    assert len(tested) >= 4, tested


def _traffic(stack: Stack, seconds: float) -> None:
    """A bounded mix of answers for the picture: successes, streams, refusals, bad keys, engine errors."""
    bulk = create_keys(stack.redis_url, {"bulk": ["--rpm", "0", "--tpm", "0", "--max-concurrency", "0"]})["bulk"]
    alpha, rpm = stack.secrets["alpha"], stack.secrets["rpm"]
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=stack.url, timeout=20) as client:
        for i in range(5000):
            if time.monotonic() > deadline:
                break
            client.post(CHAT, json=_chat(8 + i % 24), headers=_headers(bulk, "198.51.100.5"))
            if i % 3 == 0:
                stream = _chat(32, stream=True, fake_token_delay=0.01 + (i % 5) / 200)
                client.post(CHAT, json=stream, headers=_headers(bulk, "198.51.100.5"))
            if i % 5 == 0:
                client.post(CHAT, json=_chat(), headers=_headers(alpha, "198.51.100.1"))
            if i % 4 == 0:
                client.post(CHAT, json=_chat(), headers=_headers(rpm, "198.51.100.2"))
            if i % 7 == 0:
                client.post(CHAT, json=_chat(), headers=_headers(UNKNOWN_SECRET, f"198.51.100.{100 + i % 50}"))
            if i % 25 == 0:
                client.post(CHAT, json=_chat(fake_status=500), headers=_headers(bulk, "198.51.100.5"))


def test_dashboard_png_is_rendered_from_prometheus(after_sequence: Stack, tmp_path: Path) -> None:
    # NEMOTRON_TEST_DASHBOARD_PNG=path: two minutes of mixed traffic first, and the picture written there (the
    # README's deploy/grafana/nemotron-gateway.png is made so).
    target = os.environ.get("NEMOTRON_TEST_DASHBOARD_PNG")
    out = Path(target) if target else tmp_path / "dashboard.png"
    if target:
        _traffic(after_sequence, 120.0)
    render(after_sequence.prometheus, out, after_sequence.started, time.time())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 50_000
