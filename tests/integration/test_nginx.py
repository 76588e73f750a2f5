"""The shipped nginx site (deploy/nginx/nemotron-gateway.conf) in front of a real gateway: TLS, unbuffered SSE,
forwarded client address and request id, the per-IP limit and nginx's own refusals in OpenAI's envelope.

Only the addresses, ports and certificate paths of the shipped file are replaced; everything else is as shipped.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.procs import REPO_ROOT, FakeEngineControl, ServerProcess, free_port, run_gateway, wait_until

SITE = REPO_ROOT / "deploy" / "nginx" / "nemotron-gateway.conf"
MODEL = "nemotron-test"


def _nginx() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        pytest.fail("nginx is not installed (scripts/test installs Debian's nginx-light as root)", pytrace=False)
    return found


def _site(gateway_ports: list[int], listen_port: int, cert: Path, key: Path) -> str:
    text = SITE.read_text()
    replacements = {
        "listen 443 ssl http2;": f"listen 127.0.0.1:{listen_port} ssl http2;",
        "server 127.0.0.1:8000;": "\n    ".join(f"server 127.0.0.1:{port};" for port in gateway_ports),
        "/etc/nemotron-gateway/tls/fullchain.pem": str(cert),
        "/etc/nemotron-gateway/tls/privkey.pem": str(key),
    }
    for old, new in replacements.items():
        assert old in text, f"the shipped site no longer contains {old!r}"
        text = text.replace(old, new)
    return text


@contextmanager
def _nginx_in_front_of(gateway_port: int, root: Path, *, before: int | None = None) -> Iterator[str]:
    """The shipped site on a free port in front of `gateway_port` (after `before` in the upstream, when
    given: a second gateway), with a throw-away certificate; its URL."""
    binary = _nginx()
    root.chmod(0o777)  # worker processes run as an unprivileged user and need the temp dirs
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    upstream = [gateway_port] if before is None else [before, gateway_port]
    (root / "site.conf").write_text(_site(upstream, port, cert, key))
    (root / "nginx.conf").write_text(
        f"daemon off;\nworker_processes 1;\npid {root}/nginx.pid;\nerror_log {root}/error.log info;\n"
        "events { worker_connections 256; }\n"
        f"http {{\n  access_log {root}/access.log;\n"
        + "".join(
            f"  {kind}_temp_path {root}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        + f"  include {root}/site.conf;\n}}\n"
    )
    test = subprocess.run(
        [binary, "-t", "-p", str(root), "-c", str(root / "nginx.conf")], capture_output=True, text=True
    )
    assert test.returncode == 0, test.stderr
    url = f"https://127.0.0.1:{port}"
    proc = ServerProcess(
        [binary, "-p", str(root), "-c", str(root / "nginx.conf")],
        # Any answer at all: nginx is up (whether the gateway behind it is, is the test's business).
        ready_check=lambda: httpx.get(f"{url}/health", verify=False, timeout=1).status_code > 0,
        port=port,
    )
    with proc.start():
        yield url


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, fake_engine: FakeEngineControl, redis_url: str
) -> Iterator[tuple[str, ServerProcess]]:
    with run_gateway(fake_engine.base_url, redis_url, env={"NEMOTRON_AUTH__ENABLED": "false"}) as gateway:
        assert gateway.port is not None
        with _nginx_in_front_of(gateway.port, tmp_path_factory.mktemp("nginx")) as url:
            wait_until(lambda: httpx.get(f"{url}/health", verify=False, timeout=1).status_code == 200, timeout=10)
            yield url, gateway


@pytest.fixture
def nginx_url(stack: tuple[str, ServerProcess]) -> str:
    return stack[0]


@pytest.fixture
def client(nginx_url: str, engine: FakeEngineControl) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=nginx_url, verify=False, timeout=10) as http:
        yield http


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_streams_pass_through_nginx_unbuffered(client: httpx.Client, engine: FakeEngineControl) -> None:
    # 20 tokens a second apart: the first data must reach the client while the engine still generates the rest (a
    # buffering nginx would pass it on only once the engine had finished), and the client leaves then.
    body = chat(max_tokens=20, stream=True, fake_token_delay=1.0)
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        (record,) = engine.requests()
        assert not record["completed"] and record["tokens_sent"] < 20, "nginx buffered the stream"
    assert first != "data: [DONE]"


def test_request_id_is_kept_or_made_by_nginx(client: httpx.Client, engine: FakeEngineControl) -> None:
    kept = client.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"X-Request-ID": "from-client-1"})
    assert kept.headers["x-request-id"] == "from-client-1"
    made = client.post("/v1/chat/completions", json=chat(max_tokens=1))
    assert len(made.headers["x-request-id"]) == 32
    # The engine gets the request id with a unique suffix (two clients may send the same id).
    assert engine.requests()[-1]["request_id"].startswith(made.headers["x-request-id"] + "-")


def test_the_gateway_sees_the_client_address_nginx_forwards(
    client: httpx.Client, stack: tuple[str, ServerProcess]
) -> None:
    # nginx appends its peer (127.0.0.1, a trusted proxy) to X-Forwarded-For; the gateway logs the address before.
    # Not /health: probes are not access-logged by default.
    response = client.get("/v1/models", headers={"X-Forwarded-For": "203.0.113.9", "X-Request-ID": "xff-check-1"})
    assert response.status_code == 200
    gateway = stack[1]
    log = wait_until(lambda: gateway.log_text() if "xff-check-1" in gateway.log_text() else None, timeout=3)
    line = next(line for line in log.splitlines() if "xff-check-1" in line)
    assert "gateway.access: 203.0.113.9 " in line, line


def test_metrics_are_not_reachable_through_nginx(client: httpx.Client) -> None:
    assert client.get("/metrics").status_code == 404


def test_nginx_refusals_come_in_the_openai_envelope(client: httpx.Client) -> None:
    too_large = client.post("/v1/chat/completions", content=b"x" * (3 * 1024 * 1024))
    assert too_large.status_code == 413
    assert too_large.json()["error"]["code"] == "request_too_large"


async def test_per_ip_limit_answers_429_in_the_envelope(nginx_url: str) -> None:
    async with httpx.AsyncClient(base_url=nginx_url, verify=False, timeout=10) as http:
        answers = await asyncio.gather(*(http.get("/health") for _ in range(120)))
    limited = [a for a in answers if a.status_code == 429]
    assert limited, "120 requests at once must exceed rate 20/s with burst 40"
    assert sum(a.status_code == 200 for a in answers) >= 40
    error = limited[0].json()["error"]
    assert error["type"] == "rate_limit_error" and limited[0].headers["retry-after"] == "1"
    wait_until(lambda: httpx.get(f"{nginx_url}/health", verify=False).status_code == 200, timeout=5)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_the_gateway_gone_gives_a_502_in_the_envelope_with_retry_after(
    tmp_path_factory: pytest.TempPathFactory, method: str
) -> None:
    # Nothing listens on the gateway's port (its socket unit stopped too): nginx's own 502, never its HTML page.
    with _nginx_in_front_of(free_port(), tmp_path_factory.mktemp("nginx-alone")) as url:
        answer = httpx.request(method, f"{url}/v1/chat/completions", json=chat(), verify=False, timeout=30)
    assert answer.status_code == 502
    assert answer.headers["content-type"] == "application/json"
    assert int(answer.headers["retry-after"]) > 0
    error = answer.json()["error"]
    assert error["code"] == "gateway_unavailable" and error["type"] == "service_unavailable", error


def test_a_refused_connection_moves_on_to_the_next_gateway_even_for_a_post(
    tmp_path_factory: pytest.TempPathFactory, stack: tuple[str, ServerProcess]
) -> None:
    # A first gateway that refuses connections (stopped), the running one second: the request never reached
    # the first, so nginx may send it on, and every completion is answered.
    gateway = stack[1]
    assert gateway.port is not None
    with _nginx_in_front_of(gateway.port, tmp_path_factory.mktemp("nginx-two"), before=free_port()) as url:
        with httpx.Client(base_url=url, verify=False, timeout=30) as http:
            answers = [http.post("/v1/chat/completions", json=chat(max_tokens=1)) for _ in range(6)]
    assert [answer.status_code for answer in answers] == [200] * 6
