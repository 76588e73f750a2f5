"""Host checks: ulimit, disk, proxies, cgroup, Redis and the engine port, with fed values and on this machine."""

from __future__ import annotations

import resource
import socket
from pathlib import Path

import pytest

from gateway.doctor.check import Status
from gateway.doctor.host import (
    CgroupInfo,
    check_cgroup,
    check_disk,
    check_engine_port,
    check_proxy,
    check_redis,
    check_ulimit,
    mask_url,
    probe_port,
    read_cgroup,
    read_free_disk,
)
from tests.procs import free_port
from tests.unit.doctor.samples import GiB

pytestmark = pytest.mark.timeout(30)


def test_ulimit_below_65536_warns_with_the_fix() -> None:
    check = check_ulimit(20000, 1_048_576)
    assert check.status is Status.WARN
    assert "LimitNOFILE=65536" in check.fix and "hard limit" not in check.fix
    assert "hard limit 20000" in check_ulimit(20000, 20000).fix
    assert check_ulimit(65536, 65536).status is Status.PASS
    assert check_ulimit(resource.RLIM_INFINITY, resource.RLIM_INFINITY).measured == "unlimited"


def test_disk_for_the_model_cache() -> None:
    assert check_disk(10 * 10**9, "/data").status is Status.WARN
    assert check_disk(15 * 10**9, "/data").status is Status.PASS
    assert check_disk(20 * 10**9, "/data", need=60 * 10**9).status is Status.WARN


def test_free_disk_of_a_path_not_created_yet(tmp_path: Path) -> None:
    at, free = read_free_disk(tmp_path / "not" / "yet")
    assert at == tmp_path and free > 0


def test_proxy_without_no_proxy_for_loopback_warns() -> None:
    check = check_proxy({"HTTPS_PROXY": "http://user:secret@proxy.corp:3128"})
    assert check.status is Status.WARN
    assert "127.0.0.1" in check.measured and "NO_PROXY=127.0.0.1,localhost" in check.fix
    assert "secret" not in check.measured and "***" in check.measured


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"https_proxy": "http://proxy:3128", "no_proxy": "127.0.0.1,localhost"},
        {"HTTP_PROXY": "http://proxy:3128", "NO_PROXY": "127.0.0.0/8,.localhost,localhost"},
        {"ALL_PROXY": "socks5://proxy:1080", "NO_PROXY": "*"},
    ],
)
def test_proxy_passes_when_loopback_is_excluded(env: dict[str, str]) -> None:
    assert check_proxy(env).status is Status.PASS


def test_proxy_partial_no_proxy_and_dead_proxy_warn() -> None:
    only_localhost = check_proxy({"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "localhost"})
    assert only_localhost.status is Status.WARN and "127.0.0.1" in only_localhost.measured
    env = {"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "127.0.0.1,localhost"}
    dead = check_proxy(env, {"http://proxy:3128": "Connection refused"})
    assert dead.status is Status.WARN and "HF_HUB_OFFLINE=1" in dead.fix


def test_mask_url() -> None:
    assert mask_url("redis://:pw@host:6380/1") == "redis://:***@host:6380/1"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_cgroup_limits() -> None:
    assert check_cgroup(CgroupInfo(2)).status is Status.PASS
    small = check_cgroup(CgroupInfo(2, memory_max=8 * GiB, pids_max=512))
    assert small.status is Status.WARN and "MemoryMax" in small.fix and "TasksMax" in small.fix
    assert check_cgroup(CgroupInfo(None)).status is Status.WARN
    assert "v1" in check_cgroup(CgroupInfo(1)).measured


def test_read_cgroup_v2_takes_the_tightest_limit_on_the_path(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    leaf = root / "system.slice" / "nemotron.service"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "system.slice" / "memory.max").write_text(f"{64 * GiB}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "pids.max").write_text("2048\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/system.slice/nemotron.service\n")
    assert read_cgroup(root, proc) == CgroupInfo(2, 64 * GiB, 2048)


def test_read_cgroup_v1_and_none(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert read_cgroup(tmp_path, tmp_path / "none") == CgroupInfo(1, None, None)
    assert read_cgroup(tmp_path / "absent", tmp_path / "none") == CgroupInfo(None)


def test_redis_and_engine_port_rows() -> None:
    assert check_redis("redis://127.0.0.1:6379/0", None).status is Status.PASS
    down = check_redis("redis://127.0.0.1:1/0", "Connection refused")
    assert down.status is Status.FAIL and down.fatal is False
    busy = check_engine_port("127.0.0.1", 8001, "Address already in use")
    assert busy.blocks_start and "8001" in busy.fix
    assert check_engine_port("127.0.0.1", 8001, None).status is Status.PASS


def test_probe_port_sees_a_listener() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert probe_port("127.0.0.1", port) is not None
    assert probe_port("127.0.0.1", free_port()) is None
