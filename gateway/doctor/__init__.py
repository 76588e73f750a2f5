"""The preflight doctor: checks of the GPU, the host, the model directory and Redis before the engine starts.

Public surface: `run_checks` with a `DoctorConfig` (the supervisor refuses to start on `fatal_failures`; it
asks vLLM's own verdict, `vllm_verdict_checks`, beside the engine's start),
the report renderers, and the `doctor` verb. Imports settings, the engine package (profiles and the argv
builder, the status file) and its own modules; never the HTTP app, the relay, fastapi or aiohttp.
"""

from gateway.doctor.check import Check, Status
from gateway.doctor.cli import add_doctor_parser, run_doctor
from gateway.doctor.report import exit_code, fatal_failures, render_json, render_table
from gateway.doctor.runner import DoctorConfig, doctor_config, run_checks, vllm_verdict_checks

__all__ = [
    "Check",
    "DoctorConfig",
    "Status",
    "add_doctor_parser",
    "doctor_config",
    "exit_code",
    "fatal_failures",
    "render_json",
    "render_table",
    "run_checks",
    "run_doctor",
    "vllm_verdict_checks",
]
