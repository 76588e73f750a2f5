"""Hostile clients against the real server (`nemotron-gateway serve`, uvicorn + httptools) on loopback.

Raw sockets where the attack is below HTTP: oversized heads, slowloris, idle floods, hang-ups mid-body.
Each test asserts what a client (or the operator reading the log) sees.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.procs import FakeEngineControl, ServerProcess, run_gateway, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "nemotron-test"
HEAD_TIMEOUT = 1.5
BODY_CHUNK_TIMEOUT = 1.0
BODY_TIMEOUT = 3.0

GATEWAY_ENV = {
    "NEMOTRON_AUTH__ENABLED": "false",
    "NEMOTRON_HTTP__HEAD_TIMEOUT": str(HEAD_TIMEOUT),
    "NEMOTRON_HTTP__BODY_CHUNK_TIMEOUT": str(BODY_CHUNK_TIMEOUT),
    "NEMOTRON_HTTP__BODY_TIMEOUT": str(BODY_TIMEOUT),
    # Background probes would blur the count of engine calls /ready makes.
    "NEMOTRON_RELAY__PROBE_INTERVAL": "120",
    "NEMOTRON_TRUSTED_PROXIES": "127.0.0.1",
}


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[ServerProcess]:
    with run_gateway(fake_engine.base_url, redis_url, env=GATEWAY_ENV) as proc:
        yield proc


@pytest.fixture
def port(gateway: ServerProcess, engine: FakeEngineControl) -> int:
    assert gateway.port is not None
    return gateway.port


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as a close)."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_and_body(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def access_lines(gateway: ServerProcess, needle: str) -> list[str]:
    return [line for line in gateway.log_text().splitlines() if "gateway.access" in line and needle in line]


# --- the request head -------------------------------------------------------------------------------


def test_a_huge_header_is_refused_with_431_while_others_are_served(port: int) -> None:
    # Before: httptools buffered any head; 50 MB cost 4 s of CPU and stalled every request meanwhile.
    answers: list[int] = []

    def health_meanwhile() -> None:
        with httpx.Client(timeout=30) as client:
            answers.extend(client.get(f"http://127.0.0.1:{port}/health").status_code for _ in range(20))

    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        checker = threading.Thread(target=health_meanwhile)
        checker.start()
        sent = 0
        sock.settimeout(0.05)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
                with contextlib.suppress(TimeoutError):
                    if sock.recv(1, socket.MSG_PEEK):
                        break
        sock.settimeout(30)
        raw = read_all(sock)
        checker.join(30)
    status, body = status_and_body(raw)
    assert status == 431
    assert orjson.loads(body)["error"]["code"] == "request_header_too_large"
    assert answers == [200] * 20


def test_many_small_headers_count_towards_the_cap(port: int) -> None:
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(200))
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        assert status_and_body(read_all(sock))[0] == 431


def test_a_normal_head_just_under_the_cap_is_served(port: int) -> None:
    response = httpx.get(f"http://127.0.0.1:{port}/health", headers={"X-Pad": "a" * 15000}, timeout=10)
    assert response.status_code == 200


def test_a_slow_head_is_cut_off_at_its_deadline(port: int) -> None:
    # Slowloris: one byte every 0.3 s kept a connection open for as long as the client liked.
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 30:
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.3)
            try:
                if sock.recv(65536, socket.MSG_PEEK):
                    closed = True
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
                break
        assert closed, "a head sent a byte at a time was still being read after 30 s"
        sock.settimeout(10)
        raw = read_all(sock)
    if raw:
        assert status_and_body(raw)[0] == 408


def test_an_idle_connection_is_closed_at_the_head_deadline(port: int) -> None:
    # uvicorn alone keeps a connection that sent nothing open for good: only the head deadline closes it, and a
    # read still waiting after 30 s raises TimeoutError.
    with connect(port) as sock:
        sock.settimeout(30)
        assert read_all(sock) == b""


def test_a_body_that_stalls_is_answered_408(port: int, gateway: ServerProcess) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    with connect(port) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body
        )
        sock.settimeout(30)
        raw = read_all(sock)
    status, answer = status_and_body(raw)
    assert status == 408
    assert orjson.loads(answer)["error"]["code"] == "request_timeout"
    wait_until(lambda: access_lines(gateway, '"POST /v1/chat/completions" 408'), timeout=10)


def test_a_body_trickled_past_the_total_deadline_is_answered_408(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n"
        )
        started = time.monotonic()
        raw = b""
        sock.settimeout(0.3)
        while time.monotonic() - started < 30:
            try:
                sock.sendall(b" ")
                raw = sock.recv(65536)
                break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(10)
        raw += read_all(sock)
    assert status_and_body(raw)[0] == 408


# --- hang-ups, methods and paths ---------------------------------------------------------------------


def test_a_client_hanging_up_mid_body_is_a_499_without_a_traceback(port: int, gateway: ServerProcess) -> None:
    marker = "hangup-" + str(time.monotonic_ns())
    with connect(port) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-ID: %s\r\n"
            b'Content-Length: 5000\r\n\r\n{"model": ' % marker.encode()
        )
    line = wait_until(lambda: access_lines(gateway, marker), timeout=10)[0]
    assert '"POST /v1/chat/completions" 499' in line
    assert "Traceback" not in gateway.log_text()
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'nemotron_gateway_requests_total{route="/v1/chat/completions",status="499"}' in metrics
    assert 'nemotron_gateway_client_disconnects_total{mode="upload"}' in metrics


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("TRACE", "/health", 405, "method_not_allowed"),
        ("TRACE", "/anything", 404, "unknown_url"),
        ("OPTIONS", "/v1/chat/completions", 405, "method_not_allowed"),
        ("PUT", "/v1/models", 405, "method_not_allowed"),
        ("DELETE", "/ready", 405, "method_not_allowed"),
        ("PROPFIND", "/", 404, "unknown_url"),
        ("GET", "/v1/../health", 404, "unknown_url"),
        ("GET", "//health", 404, "unknown_url"),
    ],
)
def test_unserved_methods_and_paths_answer_in_openais_envelope(
    port: int, method: str, path: str, status: int, code: str
) -> None:
    with connect(port) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        got, body = status_and_body(read_all(sock))
    assert got == status
    error = orjson.loads(body)["error"]
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}


def test_head_on_health_and_ready_for_load_balancers(port: int, engine: FakeEngineControl) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        assert client.head("/health").status_code == 200
        assert client.head("/ready").status_code == 200
        response = client.request("PATCH", "/health")
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, HEAD"


def test_ready_reads_cached_state_instead_of_probing_the_engine(port: int, engine: FakeEngineControl) -> None:
    # Before: 100 /ready calls made 102 engine probes.
    before = engine.stats()["health_checks"]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        statuses = [client.get("/ready").status_code for _ in range(100)]
    assert statuses == [200] * 100
    assert engine.stats()["health_checks"] - before <= 2


# --- what reaches the log ----------------------------------------------------------------------------


def test_control_characters_in_a_path_cannot_forge_log_lines(port: int, gateway: ServerProcess) -> None:
    marker = "forge" + str(time.monotonic_ns())
    forged = "2026-01-01 00:00:00,000 INFO gateway.access: 6.6.6.6 %22GET /admin%22 200".replace(" ", "%20")
    path = f"/{marker}%0d%0a{forged}%1b%5b31m"
    with connect(port) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        assert status_and_body(read_all(sock))[0] == 404
    lines = wait_until(lambda: [line for line in gateway.log_text().splitlines() if marker in line], timeout=10)
    assert len(lines) == 1
    assert "\\r\\n2026-01-01" in lines[0] and "\\x1b[31m" in lines[0]
    assert "\x1b" not in gateway.log_text()
    assert not any(line.startswith("2026-01-01 00:00:00,000") for line in gateway.log_text().splitlines())


@pytest.mark.parametrize(
    ("forwarded", "logged"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8::1", "2001:db8::1"),
        ("not-an-address", "127.0.0.1"),
        ("203.0.113.7.evil", "127.0.0.1"),
        ("", "127.0.0.1"),
    ],
)
def test_forwarded_for_from_a_trusted_proxy_is_believed_only_when_it_is_an_address(
    port: int, gateway: ServerProcess, forwarded: str, logged: str
) -> None:
    marker = "xff-" + str(time.monotonic_ns())
    response = httpx.get(
        f"http://127.0.0.1:{port}/v1/models",  # /health would not be access-logged (probes are not, by default)
        headers={"X-Forwarded-For": forwarded, "X-Request-ID": marker},
        timeout=10,
    )
    assert response.status_code == 200
    line = wait_until(lambda: access_lines(gateway, marker), timeout=10)[0]
    assert re.search(rf"gateway\.access: {re.escape(logged)} \"GET /v1/models\"", line), line


# --- malformed requests ------------------------------------------------------------------------------------

MALFORMED = [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-\x01Bad: 1\r\n\r\n",  # a control character in a header name
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # TLS spoken to the plain-HTTP port
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",  # not a chunk size
]


def test_malformed_requests_get_a_400_envelope_and_a_throttled_log_line(gateway: ServerProcess, port: int) -> None:
    # Before: uvicorn logged "Invalid HTTP request received" for each (500 warnings in 0.12 s) and answered text/plain.
    warned_before = gateway.log_text().count("malformed request")
    answers = []
    for index in range(500):
        with connect(port) as sock:
            sock.sendall(MALFORMED[index % len(MALFORMED)])
            answers.append(read_all(sock))
    for raw in answers:
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), raw[:200]
        assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower(), head
        error = orjson.loads(body)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_http_request"), error
        assert "not valid HTTP/1.1" in error["message"]
    log = gateway.log_text()
    assert "Invalid HTTP request received" not in log
    assert 1 <= log.count("malformed request") - warned_before <= 2, "malformed requests are logged throttled"
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_bytes_that_are_not_http_after_a_request_let_that_request_be_answered(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + MALFORMED[0])
        raw = read_all(sock)
    assert status_and_body(raw)[0] == 200, raw[:300]
    assert b"HTTP/1.1 400" not in raw and b"connection: close" in raw.lower(), raw[:500]


# --- a flood of connections ---------------------------------------------------------------------------


def test_a_connection_flood_is_refused_with_a_log_line_and_clients_are_served_after_it(
    fake_engine: FakeEngineControl, redis_url: str
) -> None:
    cap = 20
    env = {**GATEWAY_ENV, "NEMOTRON_HTTP__MAX_CONNECTIONS": str(cap), "NEMOTRON_HTTP__HEAD_TIMEOUT": "60"}
    with run_gateway(fake_engine.base_url, redis_url, env=env) as gateway:
        base = f"http://127.0.0.1:{gateway.port}"
        assert gateway.port is not None
        flood = [connect(gateway.port) for _ in range(cap + 10)]
        try:
            # The first `cap` are held open; the rest are answered 503 at once and closed.
            refused = []
            for sock in flood[cap:]:
                sock.settimeout(30)
                raw = read_all(sock)
                refused.append(status_and_body(raw)[0] if raw else None)
            assert set(refused) <= {503, None} and 503 in refused
            wait_until(lambda: "refused" in gateway.log_text() and f"cap of {cap} connections" in gateway.log_text())
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{base}/health", timeout=10).raise_for_status()
        finally:
            for sock in flood:
                sock.close()
        assert wait_until(lambda: _served(f"{base}/health"), timeout=30)
        assert gateway.log_text().count(f"cap of {cap} connections") <= 2, "refusals are logged rate-limited"
        assert "Traceback" not in gateway.log_text()


def _served(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
