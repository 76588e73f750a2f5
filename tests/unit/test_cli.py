"""The command line: each verb loads only what it runs; unknown NEMOTRON_* names are warned about at start."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gateway import cli

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
# What the web app brings: ~0.6 s of imports that `keys list` must not pay.
WEB_STACK = ["fastapi", "starlette", "uvicorn", "aiohttp", "gateway.app", "gateway.http.server", "gateway.relay"]
_PROBE = """
import json, sys
from gateway import cli
verb = sys.argv[1:]
cli.build_parser(cli._verb_of(verb)).parse_args(verb)
cli._verb_module(verb[0])
print(json.dumps(sorted(m for m in json.loads(sys.stdin.read()) if m in sys.modules)))
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("NEMOTRON_"):
            monkeypatch.delenv(name)


def loaded_after(*argv: str, modules: list[str] = WEB_STACK) -> list[str]:
    """Which of `modules` a fresh interpreter has loaded after parsing `argv` and importing the verb's module."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        input=json.dumps(modules),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=25,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))


@pytest.mark.parametrize("argv", [["keys", "list"], ["engine", "status"], ["doctor"]])
def test_verbs_without_the_web_app_do_not_import_it(argv: list[str]) -> None:
    assert loaded_after(*argv) == []


def test_keys_usage_reads_usage_without_loading_the_rate_limiter() -> None:
    assert loaded_after("keys", "usage", modules=["gateway.ratelimit", "gateway.usage"]) == ["gateway.usage"]


def test_serve_does_import_the_web_app() -> None:
    # The probe itself works: the one verb that runs the app loads it.
    assert "gateway.app" in loaded_after("serve")


def test_every_verb_names_a_module_with_its_functions() -> None:
    expected = {
        "serve": ["serve"],
        "engine": ["run_engine", "show_status", "show_profiles"],
        "up": ["run_up"],
        "keys": ["add_keys_parser", "run_keys"],
        "doctor": ["add_doctor_parser", "run_doctor"],
        "replicas": ["add_replicas_parser", "run_replicas"],
    }
    for verb, names in expected.items():
        module = importlib.import_module(cli._VERB_MODULES[verb])
        assert all(callable(getattr(module, name)) for name in names), verb


def test_top_level_help_lists_every_verb_without_loading_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser("keys").parse_args(["--help"])
    out = capsys.readouterr().out
    for verb in ("serve", "engine", "keys", "demo-model", "doctor", "up", "replicas"):
        assert verb in out


def test_misspelt_variable_is_warned_with_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NEMOTRON_REDIS_ULR", "redis://elsewhere:6379/0")
    assert cli.main(["engine", "profiles"]) == 0
    err = capsys.readouterr().err
    assert "NEMOTRON_REDIS_ULR (in the environment) is not a setting; did you mean NEMOTRON_REDIS_URL?" in err


def test_misspelt_env_file_line_is_named_before_the_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env_file = tmp_path / "gateway.env"
    env_file.write_text("NEMOTRON_ENGINE__SERVED_MODEL_NAM=nemo\n")
    assert cli.main(["engine", "profiles", "--env-file", str(env_file)]) == 2
    err = capsys.readouterr().err
    assert f"NEMOTRON_ENGINE__SERVED_MODEL_NAM (in the {env_file}) is not a setting" in err
    assert "did you mean NEMOTRON_ENGINE__SERVED_MODEL_NAME?" in err


@pytest.mark.timeout(120)  # the writer imports torch: seconds on a busy machine
def test_demo_model_writes_the_model_from_any_directory_of_a_checkout(tmp_path: Path) -> None:
    # The writer is tools/demo_model.py, outside the package; the verb finds it beside the package, whatever the cwd.
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "demo-model", str(tmp_path / "model"), "--seed", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["NemotronForCausalLM"]
    assert (tmp_path / "model" / "tokenizer.json").is_file()


def test_log_lines_read_as_loggings_own_format_within_a_second_and_across_seconds() -> None:
    # The date and time are formatted once a second; every line must still read as logging's own formatter writes it.
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    ours, theirs = cli.LineFormatter(fmt), logging.Formatter(fmt)
    for created in (1_764_605_000.001, 1_764_605_000.999, 1_764_605_001.5, 1_764_605_000.25):
        record = logging.LogRecord("gateway.access", logging.INFO, "", 0, "line %d", (7,), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.format(record) == theirs.format(record)


# The engine command under its two names: `nemotron-gateway engine ARGS` and `nemotron-engine ARGS`.
ENGINE_NAMES = {
    "nemotron-gateway engine": lambda argv: cli.main(["engine", *argv]),
    "nemotron-engine": cli.engine_main,
}
ENGINE_COMMAND_LINES = [
    ["--model", "/m", "--profile", "cpu-dev", "--preset", "nemotron-3-nano", "--engine-port", "8101"],
    ["--served-model-name", "nemo", "--print-argv", "--log-level", "debug", "--redis-url", "redis://r:6379/1"],
    ["--env-file", "/etc/env", "status", "--json", "--redis-url", "redis://r:6379/2"],
    ["profiles", "--log-level", "error"],
    ["presets"],
]


def test_nemotron_engine_is_the_shared_engine_command() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["nemotron-engine"].split(":")
    assert getattr(importlib.import_module(module), function) is cli.engine_main


@pytest.mark.parametrize("argv", ENGINE_COMMAND_LINES)
def test_both_engine_names_parse_a_command_line_alike(argv: list[str]) -> None:
    under_gateway = vars(cli.build_parser("engine").parse_args(["engine", *argv]))
    assert vars(cli.engine_parser().parse_args(argv)) == under_gateway
    assert under_gateway["verb"] == "engine"


@pytest.mark.parametrize("argv", [["--model", "/m", "--no-such-flag"], ["status", "--model", "/m"], ["stat"]])
def test_both_engine_names_refuse_the_same_command_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for run in ENGINE_NAMES.values():
        with pytest.raises(SystemExit) as exit_info:
            run(argv)
        assert exit_info.value.code == 2  # argparse's usage error
        assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "code", "expected_out", "expected_err"),
    [
        (["profiles"], 0, "balanced\n", ""),
        (["presets"], 0, "reasoning switch: think_line", ""),
        (["--profile", "cpu-dev", "--model", "/m", "--print-argv"], 0, "--max-model-len 2048", ""),
        (["--preset", "nope", "--model", "/m", "--print-argv"], 2, "", "unknown model preset 'nope'"),
        (["status"], 1, "no engine supervisor status at ", ""),
    ],
)
def test_both_engine_names_run_the_same_verbs(
    argv: list[str],
    code: int,
    expected_out: str,
    expected_err: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("NEMOTRON_ENGINE__STATE_DIR", str(tmp_path))
    monkeypatch.setenv("NEMOTRON_ENGINE__LAUNCHER", json.dumps([sys.executable, "-m", "vllm_stand_in"]))
    outputs = []
    for run in ENGINE_NAMES.values():
        assert run(argv) == code
        outputs.append(capsys.readouterr())
    assert outputs[0] == outputs[1]
    assert expected_out in outputs[0].out and expected_err in outputs[0].err


def test_python_m_gateway_supervisor_is_the_engine_command_too() -> None:
    answers = [
        subprocess.run(
            [sys.executable, "-m", *entry, "profiles"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=25,
            check=False,
        )
        for entry in (["gateway", "engine"], ["gateway.supervisor"])
    ]
    assert answers[0].returncode == answers[1].returncode == 0
    assert answers[0].stdout == answers[1].stdout and "cpu-dev\n" in answers[0].stdout
