"""The GPU sweep's bookkeeping: which process is which part of the stack, and the table it writes."""

from __future__ import annotations

from loadtest.gpu.sweep import markdown, role_of


def test_roles_follow_the_command_lines_of_the_stack() -> None:
    assert role_of("/usr/bin/python3 -m gateway serve") == "gateway"
    assert role_of("python3 -m vllm.entrypoints.launchers.api_server.entry --model /tmp/model") == "vllm-api"
    assert role_of("VLLM::EngineCore") == "engine-core"
    # The guard that runs a child in its own process group is not counted as the child.
    assert role_of("python3 -m gateway.supervisor.guard -- python3 -m gateway serve") is None
    assert role_of("redis-server 127.0.0.1:6390") is None


def test_the_table_has_one_row_per_point_with_errors_summed() -> None:
    point = {
        "target": "gateway",
        "concurrency": 256,
        "ok": 500,
        "requests": 512,
        "errors": {"503": 10, "timeout": 2},
        "output_tokens_per_s": 6543.2,
        "ttft_p50_ms": 120.0,
        "ttft_p99_ms": 900.0,
        "itl_p50_ms": 30.5,
        "itl_p99_ms": 160.25,
        "cpu_s_per_1k_tokens": {"gateway": 0.05, "vllm-api": 0.25, "engine-core": 0.5},
    }
    rows = markdown([point]).splitlines()
    assert len(rows) == 3
    assert rows[2] == (
        "| gateway | 256 | 500/512 | 12 | 6,543 | 120.0 / 900.0 | 30.50 / 160.25 | 0.050 | 0.250 | 0.500 |"
    )
