"""The gateway's HTTP server: uvicorn with httptools, bounded in what one client may cost.

`serve(settings)` builds the app and runs it until SIGTERM/SIGINT, in one process or a pool of workers sharing one
listening socket. The protocol that bounds a client (`GuardedHttpToolsProtocol`, in `gateway/http/uvicorn_internals.py`
with everything else that relies on uvicorn's internals) caps the request head (431), gives it a deadline (408,
then close), closes a body still arriving after its deadline, and refuses connections beyond a cap at accept
(503); the 408 for a slow body is answered by the middleware, where the route reads it. Under systemd socket
activation it serves the inherited listening socket, so connections wait in the kernel's queue while one gateway
process replaces another (a restart refuses no connection); from a stop signal on, /ready answers 503 (draining).
Imports the app (this is where it runs), settings, the client limits and the uvicorn protocol and server.
"""

from __future__ import annotations

import functools
import json
import logging
import socket

from gateway.app import create_app
from gateway.http.client_limits import ClientLimits
from gateway.http.uvicorn_internals import DrainingServer, GuardedHttpToolsProtocol, ServerConfig
from gateway.http.workers import STARTUP_FAILURE, WorkerPool, usable_cores
from gateway.metrics.multiprocess import forget_worker
from gateway.relay.readiness import SharedPoolState
from gateway.settings import Settings, inherited_listen_fd

logger = logging.getLogger(__name__)

# uvicorn's default listen backlog, for the workers' shared socket as for its own.
_BACKLOG = 2048


def listening_sockets() -> list[socket.socket] | None:
    """The listening socket systemd passed (socket activation), or None to bind `host:port` as usual."""
    fd = inherited_listen_fd()
    if fd is None:
        return None
    sock = socket.socket(fileno=fd)  # family and type read from the descriptor
    logger.info("serving the listening socket systemd passed (fd %d, %s)", fd, sock.getsockname())
    return [sock]


def serve(settings: Settings) -> int:
    """Run the gateway until SIGTERM/SIGINT (open streams get `shutdown_grace` to finish): one process, or with
    `workers` > 1 a `WorkerPool` of processes sharing one listening socket (the default: one per usable core)."""
    logger.info("effective settings: %s", json.dumps(settings.masked()))
    limits = ClientLimits.from_settings(settings)
    workers = settings.workers or usable_cores()
    logger.info(
        "client limits: %d connections per worker, %d-byte heads within %g s, bodies within %g s",
        limits.max_connections,
        limits.max_head_bytes,
        limits.head_timeout,
        settings.http.body_timeout,
    )
    inherited = listening_sockets()
    if workers == 1:
        return serve_socket(settings, limits, inherited[0] if inherited else None)
    try:
        sock = inherited[0] if inherited else listen(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return STARTUP_FAILURE
    # Made before the fork, so the workers share one view of every replica (see gateway/relay/readiness.py).
    shared = SharedPoolState()
    target = functools.partial(serve_socket, settings, limits, shared=shared)
    # A dead worker's in-flight gauge must not stay in the sum the others' scrapes report.
    pool = WorkerPool(
        workers,
        target,
        sock,
        drain=settings.shutdown_grace,
        on_exit=forget_worker,
        on_stop=shared.mark_draining,
    )
    return pool.run()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` that forked workers inherit (what uvicorn's own bind does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_socket(
    settings: Settings, limits: ClientLimits, sock: socket.socket | None, shared: SharedPoolState | None = None
) -> int:
    """Build the app and run it under uvicorn, on `sock` or (None) on a socket of its own; the exit code. `shared`:
    the engine view of the pool this worker belongs to."""
    config = ServerConfig(
        create_app(settings, shared),
        limits=limits,
        freeze_heap=True,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=GuardedHttpToolsProtocol,
        lifespan="on",
        access_log=False,
        log_config=None,
        # The app's ForwardedClientMiddleware reads X-Forwarded-For, and only believes addresses.
        proxy_headers=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace),
        server_header=False,
        backlog=_BACKLOG,
    )
    server = DrainingServer(config)
    server.run(sockets=None if sock is None else [sock])
    return 0 if server.started else STARTUP_FAILURE
