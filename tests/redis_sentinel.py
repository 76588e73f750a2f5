"""A Redis that can fail over, for tests: one master, one replica and three Sentinels on free 127.0.0.1 ports.

Each is a real process (tests/procs.py ServerProcess). Sentinels run as `redis-sentinel`, or as
`redis-server --sentinel` where Debian's redis-sentinel package is not installed (the same binary).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest
import redis

from tests.conftest import _redis_server_binary, redis_answers
from tests.procs import ServerProcess, free_port, wait_until

SERVICE = "mymaster"
# A master that answers nothing for this long is down to a Sentinel; 2 of the 3 must agree (the quorum).
DOWN_AFTER_MS = 1000
QUORUM = 2


def _sentinel_argv(config: Path) -> list[str]:
    binary = shutil.which("redis-sentinel")
    if binary is not None:
        return [binary, str(config)]
    server = _redis_server_binary()
    if server is None:
        pytest.skip("redis-server is not installed")
    return [server, str(config), "--sentinel"]  # the config file must come first


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0, socket_connect_timeout=2.0)


class SentinelGroup:
    """A master, its replica and three Sentinels watching them; `url` is the gateway's redis+sentinel:// URL."""

    def __init__(self, directory: Path) -> None:
        server = _redis_server_binary()
        if server is None:
            pytest.skip("redis-server is not installed")
        self._server = server
        self._directory = directory
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{SERVICE}/0"
        self._redis: dict[int, ServerProcess] = {}
        self._sentinels: list[ServerProcess] = []

    def start(self) -> None:
        """Start all five, and return once the Sentinels know the replica and each other (a failover can run)."""
        self._redis[self.master_port] = self._start_redis(self.master_port)
        self._redis[self.replica_port] = self._start_redis(self.replica_port, replica=True)
        wait_until(lambda: self._link_up(self.replica_port), timeout=20, message="the replica never synced")
        for port in self.sentinel_ports:
            config = self._directory / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self._directory}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} {QUORUM}\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            url = f"redis://127.0.0.1:{port}/0"
            process = ServerProcess(_sentinel_argv(config), ready_check=lambda u=url: redis_answers(u))
            self._sentinels.append(process.start())
        wait_until(self._sentinels_ready, timeout=30, interval=0.2, message="the Sentinels never found each other")

    def stop(self) -> None:
        for process in [*self._sentinels, *self._redis.values()]:
            process.stop()
        self._sentinels, self._redis = [], {}

    def master(self) -> tuple[str, int]:
        """The master's address as most Sentinels report it now (the others learn a failover a little later)."""
        reported: list[tuple[str, int]] = []
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError), _client(port) as client:
                host, master_port = client.sentinel_get_master_addr_by_name(SERVICE)
                reported.append((host.decode() if isinstance(host, bytes) else str(host), int(master_port)))
        assert reported, "no Sentinel answers"
        return Counter(reported).most_common(1)[0][0]

    def master_client(self) -> redis.Redis:
        """A client of the current master (for the test's own reads; close it)."""
        return _client(self.master()[1])

    def kill_master(self) -> int:
        """SIGKILL the master (no shutdown, no last write to disk) and wait until it is gone; its port."""
        port = self.master()[1]
        master = self._redis[port]
        master.send_signal(signal.SIGKILL)
        # The signal is delivered, not yet acted on: on a busy machine the master can answer a few more commands.
        wait_until(lambda: not master.running, timeout=5, interval=0.001, message="the master outlived SIGKILL")
        return port

    def flush_replica_scripts(self) -> None:
        """Empty the replica's Lua script cache, so the master it becomes lacks every script (NOSCRIPT)."""
        with _client(self.replica_port) as client:
            client.script_flush()

    def _start_redis(self, port: int, *, replica: bool = False) -> ServerProcess:
        directory = self._directory / f"redis-{port}"
        directory.mkdir()
        argv = [self._server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
        argv += ["--save", "", "--appendonly", "no"]
        if replica:
            argv += ["--replicaof", "127.0.0.1", str(self.master_port)]
        url = f"redis://127.0.0.1:{port}/0"
        return ServerProcess(argv, ready_check=lambda: redis_answers(url), port=port).start()

    def _link_up(self, port: int) -> bool:
        with _client(port) as client:
            return client.info("replication").get("master_link_status") == "up"

    def _sentinels_ready(self) -> bool:
        for port in self.sentinel_ports:
            with _client(port) as client:
                state = client.sentinel_master(SERVICE)
                if int(state.get("num-other-sentinels", 0)) < len(self.sentinel_ports) - 1:
                    return False
                if int(state.get("num-slaves", 0)) < 1:
                    return False
        return True
