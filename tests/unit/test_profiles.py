"""Engine profiles as data and the pure `vllm serve` argv builder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.engine.launch import engine_environment
from gateway.engine.profiles import ProfileError, build_argv, load_profiles, select_profile, unknown_flags
from gateway.engine.supervisor_state import scheduling_policy
from gateway.settings import EngineSettings

LAUNCHER = ["python", "-m", "vllm.entrypoints.openai.api_server"]


def test_shipped_profiles_match_the_design_table() -> None:
    profiles = load_profiles()
    visible = {name for name, p in profiles.items() if not p.hidden}
    assert visible == {
        "low-latency",
        "balanced",
        "throughput",
        "throughput-priority",
        "throughput-priority-queued",
        "awq",
        "pcie-limited",
        "cpu-dev",
    }
    assert profiles["low-latency"].flags["gpu-memory-utilization"] == 0.85
    assert profiles["balanced"].flags["gpu-memory-utilization"] == 0.90
    assert profiles["throughput"].flags["max-num-seqs"] == 256
    assert profiles["awq"].flags["quantization"] == "awq" and profiles["awq"].flags["dtype"] == "half"
    assert profiles["pcie-limited"].flags["block-size"] == 16
    # The context length is the preset's (presets.toml); only cpu-dev caps it.
    assert {n for n, p in profiles.items() if "max-model-len" in p.flags} == {"cpu-dev"}
    assert profiles["cpu-dev"].env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "gpu-memory-utilization" not in profiles["cpu-dev"].flags


def test_argv_is_bound_to_localhost_with_profile_flags_then_extra_args() -> None:
    engine = EngineSettings(
        model="/srv/models/nemotron", port=8123, served_model_name="nemo", extra_args=("--seed", "7")
    )
    argv = build_argv(LAUNCHER, engine, select_profile(load_profiles(), "throughput"))
    assert argv[:3] == LAUNCHER
    assert argv[argv.index("--model") + 1] == "/srv/models/nemotron"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--served-model-name") + 1] == "nemo"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.92"
    assert argv[argv.index("--max-num-seqs") + 1] == "256"
    assert argv[-2:] == ["--seed", "7"]


def test_the_priority_profiles_extend_throughput_and_the_supervisor_records_their_policy() -> None:
    profiles = load_profiles()
    argv = build_argv(LAUNCHER, EngineSettings(model="m"), select_profile(profiles, "throughput-priority"))
    assert argv[argv.index("--max-num-seqs") + 1] == "256"
    assert scheduling_policy(argv) == "priority"
    queued = build_argv(LAUNCHER, EngineSettings(model="m"), select_profile(profiles, "throughput-priority-queued"))
    assert queued[queued.index("--max-num-queued-reqs") + 1] == "512"
    plain = build_argv(LAUNCHER, EngineSettings(model="m"), select_profile(profiles, "throughput"))
    assert scheduling_policy(plain) == "fcfs"
    # cpu-dev with the policy as extra args (how the tests run it); the last flag wins, as in argparse.
    extra = EngineSettings(model="m", extra_args=("--scheduling-policy", "priority"))
    assert scheduling_policy(build_argv(LAUNCHER, extra, select_profile(profiles, "cpu-dev"))) == "priority"
    assert scheduling_policy([*argv, "--scheduling-policy=fcfs"]) == "fcfs"


def test_booleans_are_bare_flags_or_absent() -> None:
    argv = build_argv(LAUNCHER, EngineSettings(model="m"), select_profile(load_profiles(), "cpu-dev"))
    assert "--enforce-eager" in argv
    assert "true" not in argv and "True" not in argv


def test_unknown_profile_names_the_choices() -> None:
    with pytest.raises(ProfileError, match=r"unknown engine profile 'fast'; choose one of: awq, balanced"):
        select_profile(load_profiles(), "fast")
    with pytest.raises(ProfileError, match="unknown engine profile 'common'"):
        select_profile(load_profiles(), "common")


def test_missing_model_is_a_clear_error() -> None:
    with pytest.raises(ProfileError, match="NEMOTRON_ENGINE__MODEL"):
        build_argv(LAUNCHER, EngineSettings(), select_profile(load_profiles(), "balanced"))


def test_operator_file_adds_and_overrides_profiles(tmp_path: Path) -> None:
    extra = tmp_path / "profiles.toml"
    extra.write_text(
        '[profiles.balanced]\nextends = "common"\ngpu-memory-utilization = 0.88\n\n'
        '[profiles.h200-long]\nextends = "throughput"\nmax-model-len = 32768\nenv = { VLLM_FOO = "1" }\n'
    )
    profiles = load_profiles(extra)
    assert profiles["balanced"].flags["gpu-memory-utilization"] == 0.88
    assert profiles["h200-long"].flags["max-model-len"] == 32768
    assert profiles["h200-long"].flags["max-num-seqs"] == 256
    assert profiles["h200-long"].env == {"VLLM_FOO": "1"}


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("[profiles.x]\nport = 9000\n", "comes from the engine settings"),
        ('[profiles.x]\nextends = "nope"\n', "extends unknown profile 'nope'"),
        ('[profiles.a]\nextends = "b"\n[profiles.b]\nextends = "a"\n', "extends itself"),
        ("[profiles.x]\nflag = [1, 2]\n", "string, number or boolean"),
        ("profiles = 3\n", "[profiles.<name>]"),
        ("[profiles.x\n", "not valid TOML"),
    ],
)
def test_bad_operator_files_are_rejected(tmp_path: Path, text: str, phrase: str) -> None:
    extra = tmp_path / "profiles.toml"
    extra.write_text(text)
    with pytest.raises(ProfileError, match=phrase.replace("[", r"\[").replace("(", r"\(")):
        load_profiles(extra)


def test_unknown_flags_are_found_before_the_slow_start() -> None:
    accepted = frozenset({"--model", "--host", "--port", "--served-model-name", "--max-model-len"})
    argv = [*LAUNCHER, "--model", "m", "--host", "127.0.0.1", "--disable-log-requests", "--max-model-len=4096"]
    assert unknown_flags(argv, accepted) == ["--disable-log-requests"]


def test_engine_environment_adds_the_profile_and_turns_off_usage_reports() -> None:
    env = engine_environment(select_profile(load_profiles(), "cpu-dev"), base={"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"


def test_the_engine_runs_with_its_own_responses_store_off_whatever_it_inherits() -> None:
    # The gateway keeps the Responses API's state; vLLM's store would keep every answer in its memory, unevicted.
    profile = select_profile(load_profiles(), "cpu-dev")
    inherited = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    assert engine_environment(profile, base=inherited)["VLLM_ENABLE_RESPONSES_API_STORE"] == "0"
    assert engine_environment(profile, base={})["VLLM_ENABLE_RESPONSES_API_STORE"] == "0"
