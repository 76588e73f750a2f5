"""The real gatherer on this machine (a tmp model directory, a free port, test Redis) and the CLI glue."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from gateway.doctor import rows as report_rows
from gateway.doctor.check import NO_GPU, Status
from gateway.doctor.cli import add_doctor_parser, run_doctor
from gateway.doctor.report import exit_code, fatal_failures, render_json, render_table
from gateway.doctor.runner import run_checks
from gateway.engine import nvml
from gateway.settings import Settings
from tests.procs import free_port
from tests.unit.doctor.samples import by_name, doctor_config_for, write_model

pytestmark = pytest.mark.timeout(30)


def test_real_gatherer_on_this_machine(tmp_path: Path, redis_url: str) -> None:
    checks = run_checks(doctor_config_for(tmp_path, redis_url))
    table = (*report_rows.GPU_ROWS, *report_rows.HOST_ROWS, *report_rows.MODEL_ROWS)
    assert [(c.name, c.fatal) for c in checks] == [(r.name, r.fatal) for r in table]  # the table's order and flags
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
        config = doctor_config_for(
            tmp_path, redis_url, engine_port=listener.getsockname()[1], model=str(tmp_path / "absent")
        )
        checks = run_checks(config)
    assert {c.name for c in fatal_failures(checks)} >= {"engine port", "model directory"}
    assert exit_code(checks) == 1


@pytest.mark.timeout(300)  # run_doctor asks the installed vLLM: two uncached verdicts
def test_cli_glue(tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_doctor_parser(parser.add_subparsers(dest="verb"))
    model = write_model(tmp_path / "model")
    argv = ["doctor", "--model", str(model), "--engine-port", str(free_port()), "--cpu", "--cache-dir", str(tmp_path)]
    settings = Settings(redis_url=redis_url, engine={"state_dir": tmp_path / "state"})  # no running stack
    assert run_doctor(parser.parse_args([*argv, "--json"]), settings) == 0
    body = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in body["checks"]} >= {"Redis", "engine port", "context length"}
    assert run_doctor(parser.parse_args([*argv, "--max-model-len", "8192"]), settings) == 1
    table = capsys.readouterr().out
    assert table.startswith("STATUS") and "FAIL*" in table and "context length" in table


@pytest.mark.timeout(300)  # two uncached verdicts of the installed vLLM
def test_a_hand_run_doctor_checks_the_stack_make_run_started(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # What `make run` leaves in the state dir: the settings it started the stack with.
    model, state, port = write_model(tmp_path / "model"), tmp_path / "state", free_port()
    state.mkdir()
    run_env = state / "run.env"
    run_env.write_text(
        f"NEMOTRON_ENGINE__MODEL={model}\nNEMOTRON_ENGINE__PROFILE=cpu-dev\n"
        f"NEMOTRON_ENGINE__PORT={port}\nNEMOTRON_REDIS_URL={redis_url}\n"
    )
    for name in ("NEMOTRON_ENGINE__MODEL", "NEMOTRON_ENGINE__PROFILE", "NEMOTRON_ENGINE__PORT", "NEMOTRON_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEMOTRON_ENGINE__STATE_DIR", str(state))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    parser = argparse.ArgumentParser()
    add_doctor_parser(parser.add_subparsers(dest="verb"))

    assert run_doctor(parser.parse_args(["doctor", "--json"]), Settings()) == 0
    out, err = capsys.readouterr()
    rows = {c["name"]: c for c in json.loads(out)["checks"]}
    assert rows["model directory"]["measured"].startswith(f"{model}: 1 weight file(s)")
    # cpu-dev's length, and vLLM's word on it
    assert rows["context length"]["measured"].startswith("--max-model-len 2048, model allows 4096 (vllm")
    assert rows["NVIDIA GPU"]["status"] != "fail"  # cpu-dev needs no GPU
    assert rows["engine port"]["measured"] == f"127.0.0.1:{port} free"
    assert rows["Redis"]["status"] == "pass"
    assert str(run_env) in err

    # An explicit --env-file is the configuration to check; the doctor's own flags win over run.env.
    other = tmp_path / "other.env"
    other.write_text("NEMOTRON_ENGINE__PROFILE=balanced\n")
    args = parser.parse_args(["doctor", "--json"])
    args.env_file = other
    run_doctor(args, Settings(_env_file=other))
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert rows["model directory"]["measured"] == "no --model given"
    run_doctor(parser.parse_args(["doctor", "--json", "--max-model-len", "1024"]), Settings())
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert rows["context length"]["measured"].startswith("--max-model-len 1024, model allows 4096 (vllm")
