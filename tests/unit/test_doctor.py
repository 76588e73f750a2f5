"""The preflight doctor: each check's pass/warn/fail boundaries with fed values, the fatbin reader on a built ELF,
rendering, the CLI glue, and the real gatherer on this machine (a tmp model directory, a free port, test Redis)."""

from __future__ import annotations

import argparse
import json
import resource
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import Settings
from gateway.supervisor import doctor, nvml
from gateway.supervisor.check import NO_GPU, Check, Status, failed, passed, warned, worst
from gateway.supervisor.checks_gpu import (
    FlashAttnBuild,
    TorchBuild,
    check_compute_capability,
    check_cuda_visible_devices,
    check_device_nodes,
    check_driver_vs_torch,
    check_flash_attn,
    check_gpu_memory,
    check_gpu_present,
    check_pcie,
    read_torch_build,
)
from gateway.supervisor.checks_host import (
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
from gateway.supervisor.checks_model import check_bos, check_model_dir, check_rope_theta, resolve_model
from gateway.supervisor.doctor import (
    DoctorConfig,
    add_doctor_parser,
    exit_code,
    fatal_failures,
    hub_cache,
    render_json,
    render_table,
    run_checks,
    run_doctor,
)
from gateway.supervisor.fatbin import cuda_archs
from gateway.supervisor.nvml import GpuDevice, GpuReadings, PcieLink
from tests.procs import free_port

pytestmark = pytest.mark.timeout(30)

GiB = 2**30
TEMPLATE_WITH_BOS = "{{ bos_token }}{% for m in messages %}<extra_id_1>{{ m.role }}\n{{ m.content }}{% endfor %}"
TEMPLATE_NO_BOS = "{% for m in messages %}<extra_id_1>{{ m.role }}\n{{ m.content }}{% endfor %}"


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


# --- GPU checks ---------------------------------------------------------------------------------------------


def test_driver_older_major_than_torch_cuda_fails_fatally() -> None:
    check = check_driver_vs_torch((12, 2), "13.0", "535.104", "2.11.0+cu130")
    assert (check.status, check.fatal) == (Status.FAIL, True)
    assert "CUDA 12.2" in check.measured and "CUDA 13.0" in check.measured
    assert "580" in check.fix


@pytest.mark.parametrize(
    ("driver", "torch_cuda", "status"),
    [((13, 0), "13.0", Status.PASS), ((13, 1), "13.0", Status.PASS), ((12, 2), "12.4", Status.WARN)],
)
def test_driver_vs_torch_boundaries(driver: tuple[int, int], torch_cuda: str, status: Status) -> None:
    assert check_driver_vs_torch(driver, torch_cuda).status is status


def test_driver_vs_torch_without_gpu_or_cuda_torch() -> None:
    assert check_driver_vs_torch(None, "13.0").measured == NO_GPU
    cpu_torch = check_driver_vs_torch((13, 0), None, "580.159.04", "2.13.0+cpu")
    assert cpu_torch.status is Status.WARN and "CPU-only" in cpu_torch.measured
    assert "not installed" in check_driver_vs_torch((13, 0), None).measured


@pytest.mark.parametrize(
    ("cc", "archs", "status"),
    [
        ((8, 0), {"sm90"}, Status.FAIL),
        ((9, 0), {"sm80"}, Status.FAIL),  # sm80 code does not run on 9.0
        ((9, 0), {"sm80", "sm90"}, Status.PASS),
        ((8, 6), {"sm80"}, Status.PASS),  # same major, newer minor runs it
        ((8, 0), {"sm86"}, Status.FAIL),
        ((9, 0), {"sm_90a"}, Status.PASS),
        ((9, 0), {"9.0"}, Status.PASS),
        ((10, 0), {"sm80", "compute80", "sm90"}, Status.WARN),  # PTX only: JIT
        ((7, 5), {"sm75", "sm80"}, Status.FAIL),  # FlashAttention needs Ampere
        ((9, 0), None, Status.WARN),
    ],
)
def test_compute_capability_vs_flash_attn_archs(cc: tuple[int, int], archs: set[str] | None, status: Status) -> None:
    check = check_compute_capability(cc, archs)
    assert check.status is status, check
    assert check.fatal is False
    if status is Status.FAIL:
        assert check.fix


def test_flash_attn_not_installed_warns() -> None:
    check = check_flash_attn((9, 0), None)
    assert check.status is Status.WARN and "no flash-attn" in check.measured
    assert check_flash_attn((9, 0), FlashAttnBuild("x.so", frozenset({"sm90"}))).status is Status.PASS


def test_gpu_memory_against_utilisation() -> None:
    total = 140 * GiB
    assert check_gpu_memory(139 * GiB, total, 0.90).status is Status.PASS
    short = check_gpu_memory(100 * GiB, total, 0.90)
    assert (short.status, short.fatal) == (Status.FAIL, True)
    assert "--gpu-memory-utilization to 0.70" in short.fix
    tight = check_gpu_memory(int(126.5 * GiB), total, 0.90)  # 126.0 needed: 0.5 GiB headroom
    assert tight.status is Status.WARN


@pytest.mark.parametrize(
    ("value", "count", "uuids", "status"),
    [
        ("3", 1, (), Status.FAIL),
        ("0", 1, (), Status.PASS),
        (None, 2, (), Status.PASS),
        ("", 1, (), Status.FAIL),
        ("-1", 1, (), Status.FAIL),
        ("0,5", 2, (), Status.WARN),  # CUDA drops 5 and anything after it
        ("0,0", 2, (), Status.WARN),
        ("GPU-8f1a2b3c-0000-1111-2222-333344445555", 1, (), Status.PASS),  # UUIDs unknown: form accepted
        ("GPU-8f1a", 1, ("GPU-8f1a2b3c-0000-1111-2222-333344445555",), Status.PASS),  # unique prefix
        ("GPU-dead", 1, ("GPU-8f1a2b3c-0000-1111-2222-333344445555",), Status.FAIL),
        ("MIG-4b8e3f1c-1111-2222-3333-444455556666", 1, (), Status.PASS),
        ("1, 0", 2, (), Status.PASS),
    ],
)
def test_cuda_visible_devices(value: str | None, count: int, uuids: tuple[str, ...], status: Status) -> None:
    check = check_cuda_visible_devices(value, count, uuids)
    assert check.status is status, check
    assert check.fatal is True


def test_cuda_visible_devices_naming_no_gpu_says_so() -> None:
    check = check_cuda_visible_devices("3", 1)
    assert "names no GPU" in check.measured and check.blocks_start
    assert check_cuda_visible_devices("0", 0).measured == NO_GPU


@pytest.mark.parametrize(
    ("link", "status"),
    [
        ((4, 8, 4, 16), Status.WARN),
        ((4, 16, 4, 16), Status.PASS),
        ((5, 16, 5, 16), Status.PASS),
        ((3, 16, 3, 16), Status.WARN),  # the slot tops out at gen3
        ((1, 16, 5, 16), Status.PASS),  # an idle link trains down to gen1
        ((5, 16, 5, 8), Status.WARN),
        ((None, None, None, None), Status.WARN),
    ],
)
def test_pcie_link(link: tuple[int | None, ...], status: Status) -> None:
    check = check_pcie(*link)
    assert check.status is status, check
    assert check.fatal is False


def test_pcie_gen4_x8_names_the_fix() -> None:
    check = check_pcie(4, 8, 4, 16)
    assert check.measured == "gen4 x8 (max gen4 x16)"
    assert "x16" in check.fix and "pcie-limited" in check.fix


def test_device_nodes() -> None:
    ok = {"/dev/nvidia0": True, "/dev/nvidiactl": True, "/dev/nvidia-uvm": True}
    assert check_device_nodes(ok, gpu_present=True).status is Status.PASS
    assert check_device_nodes({}, gpu_present=False).measured == NO_GPU
    closed = check_device_nodes({**ok, "/dev/nvidia0": False}, gpu_present=True)
    assert closed.status is Status.FAIL and "/dev/nvidia0" in closed.measured and "cgroup" in closed.fix
    no_uvm = check_device_nodes({"/dev/nvidia0": True, "/dev/nvidiactl": True}, gpu_present=True)
    assert no_uvm.status is Status.WARN and "nvidia-modprobe" in no_uvm.fix


def _h200(index: int = 0) -> GpuDevice:
    return GpuDevice(index, "NVIDIA H200", f"GPU-{index}abc", 140 * GiB, 141 * GiB, (9, 0), PcieLink(5, 16, 5, 16))


def test_gpu_presence_by_profile() -> None:
    none = GpuReadings()
    assert check_gpu_present(none, cpu_profile=True).measured == NO_GPU
    missing = check_gpu_present(none, cpu_profile=False)
    assert missing.blocks_start
    broken = check_gpu_present(GpuReadings(error="NVML init failed: Unknown Error"), cpu_profile=False)
    assert broken.status is Status.FAIL and "Unknown Error" in broken.measured
    found = check_gpu_present(GpuReadings("580.159.04", (13, 0), (_h200(), _h200(1))), cpu_profile=False)
    assert found.status is Status.PASS and "2 x NVIDIA H200" in found.measured


def test_worst_merges_per_gpu_rows() -> None:
    merged = worst("PCIe link", [check_pcie(5, 16, 5, 16), check_pcie(4, 8, 4, 16)], ["GPU 0", "GPU 1"])
    assert merged.status is Status.WARN
    assert merged.measured.startswith("GPU 0: gen5 x16") and "GPU 1: gen4 x8" in merged.measured
    assert worst("x", [passed("y", "one")], ["GPU 0"]).name == "x"


def test_torch_build_is_read_without_importing_torch() -> None:
    build = read_torch_build()  # this machine may have no torch; the shape holds either way
    assert build is None or build.version


# --- the fatbin reader --------------------------------------------------------------------------------------


def _fatbin(entries: list[tuple[int, int]]) -> bytes:
    """One fatbin: (kind, arch) entries with 16-byte payloads."""
    body = b""
    for kind, arch in entries:
        header = struct.pack("<HHIQIIHHI", kind, 0x101, 64, 16, 0, 0, 0, 0, arch).ljust(64, b"\0")
        body += header + bytes(16)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf_with_section(name: bytes, data: bytes) -> bytes:
    """A minimal little-endian ELF64 file: null, .shstrtab and one section holding `data`."""
    names = b"\0.shstrtab\0" + name + b"\0"
    names_at, data_at = 64, 64 + len(names)
    table_at = data_at + len(data) + (-(data_at + len(data)) % 8)
    header = b"\x7fELF\x02\x01\x01".ljust(16, b"\0")
    header += struct.pack("<HHIQQQIHHHHHH", 3, 0xBE, 1, 0, 0, table_at, 0, 64, 0, 0, 64, 3, 1)
    section = struct.Struct("<IIQQQQIIQQ")
    table = section.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    table += section.pack(1, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)
    table += section.pack(11, 1, 0, 0, data_at, len(data), 0, 0, 8, 0)
    return header + names + data + bytes(table_at - data_at - len(data)) + table


def test_fatbin_archs_from_an_elf(tmp_path: Path) -> None:
    first = _fatbin([(2, 80), (1, 80)])
    data = first + bytes(8) + _fatbin([(2, 90), (2, 90)])  # zero padding between fatbins
    library = tmp_path / "_fa_C.abi3.so"
    library.write_bytes(_elf_with_section(b".nv_fatbin", data))
    assert cuda_archs(library) == {"sm80", "compute80", "sm90"}


def test_fatbin_reader_refuses_what_is_not_cuda(tmp_path: Path) -> None:
    plain = tmp_path / "plain.so"
    plain.write_bytes(_elf_with_section(b".text", b"\x90" * 32))
    assert cuda_archs(plain) is None
    text = tmp_path / "notes.txt"
    text.write_text("not an ELF file")
    assert cuda_archs(text) is None
    assert cuda_archs(tmp_path / "missing.so") is None


# --- host checks --------------------------------------------------------------------------------------------


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


# --- model directory ----------------------------------------------------------------------------------------

CONFIG: dict[str, Any] = {
    "architectures": ["NemotronForCausalLM"],
    "model_type": "nemotron",
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
}
TOKENIZER_CONFIG: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "add_bos_token": False,
    "chat_template": TEMPLATE_WITH_BOS,
}


def write_model(
    root: Path,
    config: dict[str, Any] | None = CONFIG,
    tokenizer_config: dict[str, Any] | None = TOKENIZER_CONFIG,
    tokenizer: bool = True,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(bytes(64))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if tokenizer:
        (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "post_processor": None}))
    return root


def test_complete_model_dir_passes(tmp_path: Path) -> None:
    checks = by_name(check_model_dir(write_model(tmp_path / "m"), 4096))
    assert {c.status for c in checks.values()} == {Status.PASS}, checks
    assert set(checks) == {
        "model directory",
        "model config",
        "tokenizer",
        "chat template",
        "BOS token",
        "rope_theta",
        "context length",
    }
    assert [n for n, c in checks.items() if c.fatal] == [
        "model directory",
        "model config",
        "tokenizer",
        "context length",
    ]


def test_missing_model_dir_is_fatal_and_skips_the_rest(tmp_path: Path) -> None:
    checks = check_model_dir(tmp_path / "absent", 4096)
    assert checks[0].blocks_start and "no such directory" in checks[0].measured
    assert {c.status for c in checks[1:]} == {Status.SKIP}


def test_model_dir_without_config_is_fatal(tmp_path: Path) -> None:
    checks = by_name(check_model_dir(write_model(tmp_path / "m", config=None), 4096))
    assert checks["model config"].blocks_start and "missing" in checks["model config"].measured
    assert checks["context length"].status is Status.SKIP


def test_model_dir_without_weights_or_with_missing_shards_fails(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_model_dir(empty, 4096)[0].blocks_start
    sharded = write_model(tmp_path / "sharded")
    index = {"metadata": {"total_size": 10}, "weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    first = check_model_dir(sharded, 4096)[0]
    assert first.blocks_start and "1 of 2 shards missing" in first.measured


def test_model_dir_without_tokenizer_fails(tmp_path: Path) -> None:
    checks = by_name(check_model_dir(write_model(tmp_path / "m", tokenizer=False), 4096))
    assert checks["tokenizer"].blocks_start and "--tokenizer" in checks["tokenizer"].fix
    base = write_model(tmp_path / "base")
    with_base = by_name(check_model_dir(tmp_path / "m", 4096, tokenizer_dir=base))
    assert with_base["tokenizer"].status is Status.PASS


def test_chat_template_absent_warns(tmp_path: Path) -> None:
    no_template = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "chat_template"}
    checks = by_name(check_model_dir(write_model(tmp_path / "m", tokenizer_config=no_template), 4096))
    assert checks["chat template"].status is Status.WARN and "--chat-template" in checks["chat template"].fix


def test_chat_template_from_other_places(tmp_path: Path) -> None:
    no_template = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "chat_template"}
    jinja = write_model(tmp_path / "jinja", tokenizer_config=no_template)
    (jinja / "chat_template.jinja").write_text(TEMPLATE_NO_BOS)
    assert by_name(check_model_dir(jinja, 4096))["chat template"].status is Status.PASS
    named = {**TOKENIZER_CONFIG, "chat_template": [{"name": "default", "template": TEMPLATE_NO_BOS}]}
    assert (
        by_name(check_model_dir(write_model(tmp_path / "list", tokenizer_config=named), 4096))["chat template"].status
        is Status.PASS
    )
    override = tmp_path / "nemotron.jinja"
    override.write_text(TEMPLATE_NO_BOS)
    bare = write_model(tmp_path / "bare", tokenizer_config=no_template)
    assert by_name(check_model_dir(bare, 4096, chat_template=override))["chat template"].status is Status.PASS
    missing = by_name(check_model_dir(bare, 4096, chat_template=tmp_path / "none.jinja"))["chat template"]
    assert missing.status is Status.FAIL


def test_add_bos_token_with_a_template_that_writes_bos_warns(tmp_path: Path) -> None:
    double = {**TOKENIZER_CONFIG, "add_bos_token": True}
    check = by_name(check_model_dir(write_model(tmp_path / "m", tokenizer_config=double), 4096))["BOS token"]
    assert check.status is Status.WARN and "double BOS" in check.fix
    literal = check_bos("<s>", True, "<s>{% for m in messages %}{{ m.content }}{% endfor %}")
    assert literal.status is Status.WARN
    assert check_bos("<s>", True, TEMPLATE_NO_BOS).status is Status.PASS
    assert check_bos(None, None, TEMPLATE_WITH_BOS).status is Status.PASS


def test_bos_added_by_the_tokenizer_json_post_processor(tmp_path: Path) -> None:
    unset = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "add_bos_token"}
    model = write_model(tmp_path / "m", tokenizer_config=unset)
    processor = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel"},
            {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}]},
        ],
    }
    (model / "tokenizer.json").write_text(json.dumps({"post_processor": processor}))
    check = by_name(check_model_dir(model, 4096))["BOS token"]
    assert check.status is Status.WARN and "tokenizer adds it: True" in check.measured


def test_max_model_len_above_the_model_fails(tmp_path: Path) -> None:
    check = by_name(check_model_dir(write_model(tmp_path / "m"), 8192))["context length"]
    assert check.blocks_start and "model allows 4096" in check.measured and "4096" in check.fix


def test_context_length_follows_rope_scaling(tmp_path: Path) -> None:
    yarn = {**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
    assert (
        "allows 16384" in by_name(check_model_dir(write_model(tmp_path / "y", yarn), 16384))["context length"].measured
    )
    llama3 = {**CONFIG, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert (
        "allows 131072"
        in by_name(check_model_dir(write_model(tmp_path / "l", llama3), 4096))["context length"].measured
    )
    limited = {**TOKENIZER_CONFIG, "model_max_length": 2048}
    check = by_name(check_model_dir(write_model(tmp_path / "t", tokenizer_config=limited), 4096))["context length"]
    assert check.status is Status.FAIL
    nameless = {k: v for k, v in CONFIG.items() if k != "max_position_embeddings"}
    assert by_name(check_model_dir(write_model(tmp_path / "n", nameless), 4096))["context length"].status is Status.WARN


@pytest.mark.parametrize(
    ("value", "status"),
    [
        (10000, Status.PASS),
        (500000.0, Status.PASS),
        (None, Status.PASS),
        ("1e6", Status.WARN),
        (1.0, Status.WARN),
        (1e12, Status.WARN),
        (True, Status.WARN),
    ],
)
def test_rope_theta(value: object, status: Status) -> None:
    assert check_rope_theta(value).status is status


def test_rope_theta_inside_rope_parameters(tmp_path: Path) -> None:
    config = {k: v for k, v in CONFIG.items() if k != "rope_theta"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": "10000"}
    check = by_name(check_model_dir(write_model(tmp_path / "m", config), 4096))["rope_theta"]
    assert check.status is Status.WARN and "not a number" in check.measured


def test_hub_ids_resolve_through_the_cache(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--nvidia--Nemotron-Mini-4B-Instruct"
    write_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model("nvidia/Nemotron-Mini-4B-Instruct", tmp_path / "hub") == repo / "snapshots" / "abc123"
    assert resolve_model("nvidia/not-downloaded", tmp_path / "hub") is None
    assert resolve_model(str(tmp_path / "x"), tmp_path / "hub") == tmp_path / "x"
    checks = check_model_dir(None, 4096, model="nvidia/not-downloaded")
    assert checks[0].status is Status.WARN and not fatal_failures(checks)


def test_hub_cache_follows_huggingface_variables(tmp_path: Path) -> None:
    assert hub_cache({"HF_HUB_CACHE": str(tmp_path)}) == tmp_path
    assert hub_cache({"HF_HOME": str(tmp_path)}) == tmp_path / "hub"
    assert hub_cache({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "huggingface" / "hub"


# --- rendering and exit code --------------------------------------------------------------------------------

SAMPLE = [
    passed("NVIDIA GPU", "1 x NVIDIA H200; driver 580.159.04", fatal=True),
    warned("open files (ulimit -n)", "20000", "LimitNOFILE=65536 in the systemd unit " * 3),
    failed("engine port", "127.0.0.1:8001 in use (Address already in use)", "stop it", fatal=True),
    failed("Redis", "redis://127.0.0.1:1/0: refused", "start Redis"),
]


def test_render_table_aligns_columns_and_marks_fatal() -> None:
    lines = render_table(SAMPLE).splitlines()
    header = lines[0]
    measured_at, fix_at = header.index("MEASURED"), header.index("FIX")
    rows = [line for line in lines[1:] if line and not line[0].isspace() and not line[0].isdigit()]
    assert [r.split()[0] for r in rows] == ["PASS", "WARN", "FAIL*", "FAIL"]
    for row, check in zip(rows, SAMPLE, strict=True):
        assert row[measured_at:].startswith(check.measured[:20])
        if check.fix:
            assert row[fix_at:].startswith(check.fix[:10])
    assert any(line.startswith(" ") and line[fix_at:].strip() for line in lines)  # the long fix wraps
    assert lines[-1] == "1 pass, 1 warn, 2 fail, 0 skip; * fatal: the supervisor will not start the engine (1)"


def test_render_json_and_exit_code() -> None:
    body = json.loads(render_json(SAMPLE))
    assert body["exit_code"] == 1 and body["fatal_failures"] == ["engine port"]
    assert body["checks"][1] == {
        "name": "open files (ulimit -n)",
        "status": "warn",
        "measured": "20000",
        "fix": SAMPLE[1].fix,
        "fatal": False,
    }
    assert exit_code(SAMPLE[:2]) == 0 and exit_code(SAMPLE[3:]) == 1
    assert fatal_failures(SAMPLE) == [SAMPLE[2]]


# --- the real machine ---------------------------------------------------------------------------------------


def _config(tmp_path: Path, redis_url: str, **overrides: Any) -> DoctorConfig:
    values: dict[str, Any] = {
        "model": str(write_model(tmp_path / "model")),
        "max_model_len": 4096,
        "engine_port": free_port(),
        "redis_url": redis_url,
        "cache_dir": tmp_path / "hf",
        "cpu": True,
        "environ": {"HF_HUB_CACHE": str(tmp_path / "hf")},
    }
    return DoctorConfig(**{**values, **overrides})


def test_real_gatherer_on_this_machine(tmp_path: Path, redis_url: str) -> None:
    checks = run_checks(_config(tmp_path, redis_url))
    rows = by_name(checks)
    if not nvml.read_gpus().devices:
        gpu_rows = ["NVIDIA GPU", "driver vs torch CUDA", "compute capability vs flash-attn", "GPU memory free"]
        gpu_rows += ["CUDA_VISIBLE_DEVICES", "PCIe link", "GPU device nodes"]
        assert {rows[n].measured for n in gpu_rows} == {NO_GPU}
        assert {rows[n].status for n in gpu_rows} == {Status.SKIP}
    assert rows["Redis"].status is Status.PASS
    assert rows["engine port"].status is Status.PASS
    assert rows["context length"].status is Status.PASS
    assert not [c for c in checks if c.status is Status.FAIL], render_table(checks)
    assert exit_code(checks) == 0  # warnings (ulimit 20000 here) do not fail the doctor
    assert "STATUS" in render_table(checks)
    assert len(json.loads(render_json(checks))["checks"]) == len(checks)


def test_real_gatherer_reports_fatal_failures(tmp_path: Path, redis_url: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        config = _config(tmp_path, redis_url, engine_port=listener.getsockname()[1], model=str(tmp_path / "absent"))
        checks = run_checks(config)
    assert {c.name for c in fatal_failures(checks)} >= {"engine port", "model directory"}
    assert exit_code(checks) == 1


def test_cli_glue(tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_doctor_parser(parser.add_subparsers(dest="verb"))
    model = write_model(tmp_path / "model")
    argv = ["doctor", "--model", str(model), "--engine-port", str(free_port()), "--cpu", "--cache-dir", str(tmp_path)]
    settings = Settings(redis_url=redis_url)
    assert run_doctor(parser.parse_args([*argv, "--json"]), settings) == 0
    body = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in body["checks"]} >= {"Redis", "engine port", "context length"}
    assert run_doctor(parser.parse_args([*argv, "--max-model-len", "8192"]), settings) == 1
    table = capsys.readouterr().out
    assert table.startswith("STATUS") and "FAIL*" in table and "context length" in table


# --- NVML and the GPU rows, with a stand-in for the library -------------------------------------------------


class FakeNvml:
    """The pynvml calls `nvml.read_gpus` makes, answering like one H200 whose PCIe getters are unsupported."""

    class NVMLError(Exception):
        pass

    def __init__(self, count: int = 1, init_error: bool = False) -> None:
        self.count, self.init_error, self.shut_down = count, init_error, False

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"580.159.04"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return argparse.Namespace(free=140 * GiB, total=141 * GiB)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}f1a2b3c-0000"

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return argparse.Namespace(busId=b"00000000:18:00.0")

    def _unsupported(self, handle: int) -> int:
        raise self.NVMLError("Not Supported")

    nvmlDeviceGetCurrPcieLinkGeneration = _unsupported
    nvmlDeviceGetCurrPcieLinkWidth = _unsupported
    nvmlDeviceGetMaxPcieLinkGeneration = _unsupported
    nvmlDeviceGetMaxPcieLinkWidth = _unsupported


def test_read_gpus_through_nvml_with_the_pcie_link_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = tmp_path / "0000:18:00.0"
    device.mkdir()
    for name, value in {
        "current_link_speed": "16.0 GT/s PCIe",
        "current_link_width": "8",
        "max_link_speed": "32.0 GT/s PCIe",
        "max_link_width": "16",
    }.items():
        (device / name).write_text(value + "\n")
    fake = FakeNvml(count=2)
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setattr(nvml, "_SYSFS_PCI", tmp_path)
    readings = nvml.read_gpus()
    assert (readings.driver_version, readings.cuda_driver, readings.error) == ("580.159.04", (13, 0), None)
    assert [d.uuid for d in readings.devices] == ["GPU-0f1a2b3c-0000", "GPU-1f1a2b3c-0000"]
    assert readings.devices[0].pcie == PcieLink(4, 8, 5, 16)
    assert readings.devices[0].compute_capability == (9, 0) and fake.shut_down


def test_read_gpus_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "pynvml", FakeNvml(init_error=True))
    readings = nvml.read_gpus()
    assert readings.devices == ()
    monkeypatch.setattr(nvml, "pynvml", None)
    assert nvml.read_gpus().devices == ()


def test_gpu_rows_on_a_gpu_machine(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    readings = GpuReadings("580.159.04", (13, 0), (_h200(0), _h200(1)))
    monkeypatch.setattr(doctor, "read_gpus", lambda: readings)
    nodes = {"/dev/nvidia0": True, "/dev/nvidia1": True, "/dev/nvidiactl": True, "/dev/nvidia-uvm": True}
    monkeypatch.setattr(doctor, "device_nodes", lambda: nodes)
    monkeypatch.setattr(doctor, "read_torch_build", lambda: TorchBuild("2.11.0+cu130", "13.0", "/site/torch"))
    monkeypatch.setattr(doctor, "flash_attn_libraries", lambda: [])
    environ = {"HF_HUB_CACHE": str(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": "1"}
    rows = by_name(run_checks(_config(tmp_path, redis_url, cpu=False, environ=environ)))
    assert rows["NVIDIA GPU"].measured == "2 x NVIDIA H200; driver 580.159.04"
    assert rows["driver vs torch CUDA"].status is Status.PASS
    assert rows["compute capability vs flash-attn"].status is Status.WARN  # no vLLM kernels in this Python
    assert rows["GPU memory free"].status is Status.PASS
    assert rows["CUDA_VISIBLE_DEVICES"].measured == "'1': 1 of 2 GPU(s)"
    assert rows["PCIe link"].measured == "gen5 x16 (max gen5 x16)"  # GPU 1 only: the one CUDA will use
    assert rows["GPU device nodes"].status is Status.PASS
    cpu_rows = by_name(run_checks(_config(tmp_path, redis_url, cpu=True, environ=environ)))
    assert cpu_rows["GPU memory free"].measured == "skipped: CPU profile"
