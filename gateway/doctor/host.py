"""Host preflight checks: cgroup limits, open files, disk for the model cache, proxies, Redis, the engine port.

Each `check_*` takes plain values (tests feed them); the `read_*`/`probe_*` functions measure this machine.
Imports `check`, `rows` and `running` of ours.
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr

from gateway.doctor import rows
from gateway.doctor.check import Check, failed, gib, passed, warned
from gateway.doctor.running import PortOwner
from gateway.redis import ping_redis
from gateway.settings import RedisSettings, Settings

MIN_OPEN_FILES = 65_536
MIN_CACHE_DISK = 15 * 10**9  # bytes: a quantised 8B model plus vLLM's compile caches
_MIN_CGROUP_MEMORY = 32 * 2**30
_MIN_CGROUP_PIDS = 4096
_PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
_UNLIMITED = "max"


@dataclass(frozen=True)
class CgroupInfo:
    version: int | None  # None: no cgroup filesystem mounted at /sys/fs/cgroup
    memory_max: int | None = None  # bytes; None = unlimited or unreadable
    pids_max: int | None = None


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_ulimit(soft: int, hard: int | None = None) -> Check:
    """Each stream holds sockets on both sides of the gateway; 20000 runs out under load."""
    row = rows.OPEN_FILES
    if soft == resource.RLIM_INFINITY or soft >= MIN_OPEN_FILES:
        return passed(row, "unlimited" if soft == resource.RLIM_INFINITY else str(soft))
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    measured = f"{soft} (hard {hard_text})" if hard is not None else str(soft)
    fix = f"LimitNOFILE={MIN_OPEN_FILES} in the systemd unit, or `ulimit -n {MIN_OPEN_FILES}` before starting"
    if hard is not None and hard != resource.RLIM_INFINITY and hard < MIN_OPEN_FILES:
        fix += f" (the hard limit {hard} must be raised too: /etc/security/limits.conf)"
    return warned(row, measured, fix)


def check_disk(free: int, path: str, need: int = MIN_CACHE_DISK) -> Check:
    """The model cache (downloads, vLLM and torch compile caches) needs room."""
    row = rows.DISK
    measured = f"{free / 1e9:.1f} GB free at {path} (need {need / 1e9:.0f} GB)"
    if free >= need:
        return passed(row, measured)
    fix = "free space there, or point HF_HOME / --cache-dir at a larger filesystem"
    return warned(row, measured, fix)


def _covers(no_proxy: str, host: str) -> bool:
    for raw in no_proxy.split(","):
        entry = raw.strip().lower().lstrip(".")
        if entry == "*" or entry == host:
            return True
        if "/" in entry:
            try:
                if ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
        elif entry and host.endswith("." + entry):
            return True
    return False


def proxy_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The proxy variables set in `env` (either case), values as given."""
    found: dict[str, str] = {}
    for var in _PROXY_VARS:
        for name in (var, var.lower()):
            if env.get(name):
                found[name] = env[name]
    return found


def check_proxy(env: Mapping[str, str], unreachable: Mapping[str, str] | None = None) -> Check:
    """Proxy variables route the gateway's calls to 127.0.0.1 through the proxy unless NO_PROXY excludes it,
    and an unreachable proxy stalls model downloads. `unreachable` maps a proxy URL to its connect error."""
    row = rows.PROXY
    proxies = proxy_settings(env)
    if not proxies:
        return passed(row, "none set")
    shown = ", ".join(f"{k}={mask_url(v)}" for k, v in proxies.items())
    no_proxy = ",".join(filter(None, (env.get("NO_PROXY"), env.get("no_proxy"))))
    problems: list[str] = []
    fixes: list[str] = []
    missing = [h for h in ("127.0.0.1", "localhost") if not _covers(no_proxy, h)]
    if missing:
        problems.append(f"NO_PROXY does not cover {', '.join(missing)}")
        fixes.append("export NO_PROXY=127.0.0.1,localhost (and no_proxy) for the gateway and the engine")
    dead = [f"{mask_url(url)} ({error})" for url, error in (unreachable or {}).items()]
    if dead:
        problems.append(f"unreachable: {', '.join(dead)}")
        fixes.append("fix or unset the proxy; for a local model set HF_HUB_OFFLINE=1 so nothing is downloaded")
    if problems:
        return warned(row, f"{shown}; {'; '.join(problems)}", "; ".join(fixes))
    return passed(row, f"{shown}; NO_PROXY covers 127.0.0.1, localhost")


def check_cgroup(info: CgroupInfo) -> Check:
    """cgroup limits that stop a model from loading: memory for weights in host RAM, pids for vLLM's threads."""
    row = rows.CGROUP
    if info.version is None:
        return warned(row, "no cgroup filesystem at /sys/fs/cgroup", "mount cgroup2 (systemd does on boot)")
    parts = [f"v{info.version}" + (" (unified)" if info.version == 2 else " (legacy/hybrid)")]
    parts.append(f"memory.max {gib(info.memory_max) if info.memory_max is not None else _UNLIMITED}")
    parts.append(f"pids.max {info.pids_max if info.pids_max is not None else _UNLIMITED}")
    measured = ", ".join(parts)
    fixes: list[str] = []
    if info.memory_max is not None and info.memory_max < _MIN_CGROUP_MEMORY:
        fixes.append(f"raise MemoryMax (or the container limit) to {gib(_MIN_CGROUP_MEMORY)}+: weights pass host RAM")
    if info.pids_max is not None and info.pids_max < _MIN_CGROUP_PIDS:
        fixes.append(f"raise TasksMax / pids limit to {_MIN_CGROUP_PIDS}+: vLLM and torch start many threads")
    if fixes:
        return warned(row, measured, "; ".join(fixes))
    return passed(row, measured)


def check_redis(where: str, error: str | None) -> Check:
    """Keys and limits live in Redis; without it the gateway answers 503 (fail closed)."""
    row = rows.REDIS
    if error is None:
        return passed(row, f"PING ok at {where}")
    fix = "start Redis or fix NEMOTRON_REDIS_URL (the gateway fails closed without it)"
    return failed(row, f"{where}: {error}", fix)


def check_engine_port(host: str, port: int, error: str | None, owner: PortOwner | None = None) -> Check:
    """vLLM exits after ~23 s when its port is taken (fatal); taken by our own running engine, the port is fine."""
    row = rows.ENGINE_PORT
    if error is None:
        return passed(row, f"{host}:{port} free")
    if owner is not None:
        return passed(row, f"{host}:{port} held by the running engine (pid {owner.pid}, {owner.state})")
    fix = f"stop what listens there (`ss -ltnp 'sport = :{port}'`) or choose another --engine-port"
    return failed(row, f"{host}:{port} in use ({error})", fix)


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_cgroup(root: Path = Path("/sys/fs/cgroup"), proc_self: Path = Path("/proc/self/cgroup")) -> CgroupInfo:
    """cgroup version and this process's memory and pids limits (the tightest along its cgroup path)."""
    if (root / "cgroup.controllers").exists():
        own = next((line[3:] for line in (_read(proc_self) or "").splitlines() if line.startswith("0::")), "/")
        leaf = root / own.strip("/")
        directories = [leaf, *leaf.parents]
        within = [d for d in directories if d == root or root in d.parents]
        memory = [m for d in within if (m := _int_or_none(_read(d / "memory.max"))) is not None]
        pids = [p for d in within if (p := _int_or_none(_read(d / "pids.max"))) is not None]
        return CgroupInfo(2, min(memory, default=None), min(pids, default=None))
    if (root / "memory").is_dir() or (root / "pids").is_dir():
        limit = _int_or_none(_read(root / "memory" / "memory.limit_in_bytes"))
        memory_max = limit if limit is not None and limit < 2**62 else None  # v1 writes ~2^63 for "no limit"
        return CgroupInfo(1, memory_max, _int_or_none(_read(root / "pids" / "pids.max")))
    return CgroupInfo(None)


def read_open_files() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def read_free_disk(path: Path) -> tuple[Path, int]:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    probe = path.expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def probe_redis(url: str, timeout: float = 1.0, sentinel_password: SecretStr | None = None) -> str | None:
    """None if Redis (the master, with Sentinel) answers PING within `timeout`, else the error; connected as the
    gateway connects (`gateway.redis.connect_redis`)."""
    redis = RedisSettings(
        connect_timeout=timeout, socket_timeout=timeout, command_timeout=timeout, sentinel_password=sentinel_password
    )
    return asyncio.run(ping_redis(Settings(redis_url=SecretStr(url), redis=redis)))


def probe_port(host: str, port: int) -> str | None:
    """None if a listener could bind host:port now (SO_REUSEADDR, as uvicorn sets), else the error."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def probe_proxies(proxies: Mapping[str, str], timeout: float = 1.0) -> dict[str, str]:
    """Each proxy URL that refuses a TCP connection within `timeout`, with the error."""
    dead: dict[str, str] = {}
    for url in dict.fromkeys(proxies.values()):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 1080 if parts.scheme.startswith("socks") else 80)
        except ValueError as exc:
            dead[url] = str(exc)
            continue
        try:
            with socket.create_connection((parts.hostname or "", port), timeout=timeout):
                pass
        except OSError as exc:
            dead[url] = exc.strerror or type(exc).__name__
    return dead
