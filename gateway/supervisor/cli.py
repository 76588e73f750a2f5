"""What the supervisor's verbs run: `engine` (foreground supervisor), `engine status`, `engine profiles`,
`engine presets`, `engine --print-argv` (the command line, nothing started), and `up`. Their flags are
declared once, in `gateway.cli`, for both names of the engine command (`nemotron-gateway engine`,
`nemotron-engine`).

`engine` and `up` run a supervisor per managed replica (`engine.replicas`, or only `engine.replica`), each with its
own port, GPUs, state dir, restarts and `replica` metrics label (`gateway/engine/replicas.py` splits them).

`up` runs the supervisors in this process and the gateway (`nemotron-gateway serve`) as a guarded child:
one foreground process tree for a single machine. A gateway that exits by itself is restarted with
backoff while the model stays loaded; on SIGTERM/SIGINT the gateway drains first, then the engine stops.
Each replica's supervisor writes the settings it runs with to its state dir's `run.env`, which a hand-run `doctor`
reads, so it checks the configuration that is running. Never imports the HTTP app.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import start_http_server

from gateway.doctor import Check, doctor_config, fatal_failures, render_table, run_checks, vllm_verdict_checks
from gateway.engine.launch import ENGINE_KEY_VARIABLE, VllmNotInstalled, added_variables, prepare, unchecked_argv
from gateway.engine.presets import load_presets
from gateway.engine.profiles import Profile, ProfileError, load_profiles, option_names
from gateway.engine.replicas import replica_gpus, replica_indices, replica_settings
from gateway.engine.supervisor_state import RUNNING_ENV, STATUS_FILE, EngineState, EngineStatus, pid_alive, read_status
from gateway.metrics.instruments import SupervisorMetrics
from gateway.settings import EngineSettings, Settings
from gateway.supervisor.process import GuardedProcess, process_names
from gateway.supervisor.replica_set import ReplicaSet
from gateway.supervisor.supervisor import EngineSupervisor

logger = logging.getLogger(__name__)

# Backoff of gateway restarts under `up`; a gateway that ran `_GATEWAY_STABLE` s starts the count anew.
_GATEWAY_BACKOFF_INITIAL = 1.0
_GATEWAY_BACKOFF_MAX = 30.0
_GATEWAY_STABLE = 60.0
# Flags of the gateway's own settings, which every vLLM release has: left out of the unchecked list.
_EVERY_VLLM_HAS = frozenset(("--model", "--host", "--port", "--served-model-name", "--max-model-len"))
# The engine settings written to RUNNING_ENV: the host's (the first replica's port and state dir, the replica count),
# from which every replica's own follow.
_RUNNING_FIELDS = (
    "model",
    "profile",
    "preset",
    "profiles_file",
    "served_model_name",
    "port",
    "state_dir",
    "replicas",
)


def _status_path(engine: EngineSettings, index: int = 0) -> Path:
    return engine.replica_state_dir(index) / STATUS_FILE


def write_running_env(settings: Settings, index: int = 0) -> None:
    """Record the settings the supervisor of replica `index` runs with in its state dir, where a hand-run `doctor`
    finds them: the host's engine settings (every replica's follow from them) and, beside other replicas, which
    one this is.

    Owner-only (0600): it holds the Redis URL, which may carry a password.
    """
    values: dict[str, object] = {f"ENGINE__{name}": getattr(settings.engine, name) for name in _RUNNING_FIELDS}
    if settings.engine.replicas > 1:
        values["ENGINE__REPLICA"] = index
    values.update(PORT=settings.port, REDIS_URL=settings.redis_url.get_secret_value())
    lines = ["# the settings of the running engine supervisor (read by a hand-run `nemotron-gateway doctor`)"]
    lines += [f"NEMOTRON_{key.upper()}={json.dumps(str(value))}" for key, value in values.items() if value is not None]
    path = settings.engine.replica_state_dir(index) / RUNNING_ENV
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def quiet_probe_loggers() -> None:
    """httpx logs every request at INFO: one line per liveness check (some 54 a minute)."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def show_status(engine: EngineSettings, *, as_json: bool) -> int:
    """Print the last status of every replica's supervisor (only `engine.replica` when set); exit 0 when every
    replica's engine is ready, 1 otherwise. One replica prints as a single engine always has."""
    indices = replica_indices(engine)
    found = [(index, _replica_status(engine, index)) for index in indices]
    ready = all(status is not None and status.state == EngineState.READY and alive for _, (status, alive) in found)
    if len(found) == 1 and engine.replicas == 1:
        index, (status, alive) = found[0]
        if status is None:
            sys.stdout.write(f"no engine supervisor status at {_status_path(engine, index)}\n")
        elif as_json:
            sys.stdout.write(json.dumps({**status.to_json(), "supervisor_running": alive}) + "\n")
        else:
            sys.stdout.write(_status_text(status, alive))
        return 0 if ready else 1
    if as_json:
        replicas = [_replica_json(engine, index, status, alive) for index, (status, alive) in found]
        sys.stdout.write(json.dumps({"ready": ready, "replicas": replicas}) + "\n")
        return 0 if ready else 1
    blocks = []
    for index, (status, alive) in found:
        title = f"replica {index} (port {_port_of(engine, index, status)})\n"
        if status is None:
            blocks.append(f"{title}no engine supervisor status at {_status_path(engine, index)}\n")
        else:
            blocks.append(title + _status_text(status, alive, indent="  "))
    sys.stdout.write("\n".join(blocks))
    return 0 if ready else 1


def _replica_status(engine: EngineSettings, index: int) -> tuple[EngineStatus | None, bool]:
    """Replica `index`'s last status (a supervisor that is gone shown STOPPED) and whether its supervisor runs."""
    status = read_status(_status_path(engine, index))
    if status is None:
        return None, False
    alive = pid_alive(status.supervisor_pid)
    if not alive and status.state not in (EngineState.STOPPED, EngineState.FAILED):
        status.reason = f"supervisor (pid {status.supervisor_pid}) is not running; last state {status.state.value}"
        status.state = EngineState.STOPPED
    return status, alive


def _port_of(engine: EngineSettings, index: int, status: EngineStatus | None) -> int:
    """The port replica `index` serves on: its status file's (the settings it was started with), else the one these
    settings give it."""
    port = urlsplit(status.engine_url).port if status is not None and status.engine_url else None
    return port if port is not None else engine.replica_port(index)


def _replica_json(engine: EngineSettings, index: int, status: EngineStatus | None, alive: bool) -> dict[str, object]:
    where = {
        "replica": index,
        "port": _port_of(engine, index, status),
        "status_file": str(_status_path(engine, index)),
    }
    if status is None:
        return {**where, "state": None, "reason": "no engine supervisor status", "supervisor_running": False}
    return {**where, **status.to_json(), "supervisor_running": alive}


def _status_text(status: EngineStatus, alive: bool, indent: str = "") -> str:
    rows = [
        ("state", status.state.value),
        ("reason", status.reason or "-"),
        ("profile", status.profile),
        ("model", status.model),
        ("engine", status.engine_url),
        ("engine pid", f"{status.engine_pid or '-'} (vLLM; process group {status.group_pid or '-'})"),
        ("processes", _processes_text(status.processes)),
        ("GPUs", _gpus_text(status)),
        ("supervisor pid", f"{status.supervisor_pid} ({'running' if alive else 'not running'})"),
        ("restarts", str(status.restarts)),
        ("last exit code", "-" if status.last_exit_code is None else str(status.last_exit_code)),
        ("since", _clock(status.since)),
    ]
    rows += [("restarted", f"{_clock(r.at)} {r.cause.value}: {r.reason}") for r in reversed(status.history)]
    return "".join(f"{indent}{name:<15} {value}\n" for name, value in rows)


def _processes_text(pids: list[int]) -> str:
    """The engine's processes with the names vLLM gives them (`VLLM::Worker_TP1`), those still alive."""
    names = process_names(pids)
    return ", ".join(f"{pid} {names[pid]}" for pid in pids if pid in names) or "-"


def _gpus_text(status: EngineStatus) -> str:
    parallel = f"tensor parallel {status.tensor_parallel_size}, data parallel {status.data_parallel_size}"
    return f"{status.gpus or 'all visible'} ({parallel})"


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def show_profiles(engine: EngineSettings) -> int:
    """List the engine profiles and their flags."""
    try:
        profiles = load_profiles(engine.profiles_file)
    except ProfileError as exc:
        sys.stderr.write(f"nemotron-gateway: {exc}\n")
        return 2
    for name, profile in profiles.items():
        if profile.hidden:
            continue
        sys.stdout.write(f"{name}\n  {profile.description}\n  {_flags_text(profile.flags)}\n")
    return 0


def _flags_text(flags: Mapping[str, object]) -> str:
    return " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in flags.items() if v is not False)


def show_presets(engine: EngineSettings) -> int:
    """List the model presets: flags, context length, how each model switches reasoning, the GPUs its checkpoint
    needs and the oldest vLLM that serves it."""
    try:
        presets = load_presets(engine.profiles_file)
    except ProfileError as exc:
        sys.stderr.write(f"nemotron-gateway: {exc}\n")
        return 2
    for name, preset in presets.items():
        length = preset.context_length or "from the model's config"
        sys.stdout.write(f"{name}\n  {preset.description}\n  model: {preset.model or '-'}; context: {length}; ")
        sys.stdout.write(f"reasoning switch: {preset.reasoning.value}\n")
        sys.stdout.write(
            f"  needs: {preset.needs.describe()}; {f'vLLM {preset.min_vllm}+' if preset.min_vllm else 'any vLLM'}\n"
        )
        sys.stdout.write(f"  {_flags_text(preset.flags) or '-'}\n")
    return 0


def print_argv(settings: Settings) -> int:
    """`engine --print-argv`: the engine's command line and the environment it adds, flags checked; starts nothing.

    Without vLLM here (a configuration prepared for a GPU host elsewhere) it is printed all the same, as `vllm
    serve ...`, and stderr names the flags no installed vLLM has checked."""
    try:
        try:
            _, argv, env = prepare(settings)
        except VllmNotInstalled as missing:
            _, argv, env = unchecked_argv(settings)
            sys.stderr.write(_unchecked_note(settings, argv, missing))
    except ProfileError as exc:
        sys.stderr.write(f"nemotron-gateway engine: {exc}\n")
        return 2
    added = added_variables(env)
    if ENGINE_KEY_VARIABLE in added:
        added[ENGINE_KEY_VARIABLE] = "<NEMOTRON_ENGINE_API_KEY>"  # a secret: named, never printed
    sys.stdout.write(shlex.join(argv) + "\n")
    sys.stdout.write("".join(f"{k}={shlex.quote(v)}\n" for k, v in sorted(added.items())))
    return 0


def _unchecked_note(settings: Settings, argv: list[str], missing: VllmNotInstalled) -> str:
    """What stderr says when the argv was built without a vLLM to check it against."""
    flags = ", ".join(f for f in dict.fromkeys(option_names(argv)) if f not in _EVERY_VLLM_HAS)
    preset = load_presets(settings.engine.profiles_file).get(settings.engine.preset)
    wanted = f"; preset {preset.name!r} needs vLLM >= {preset.min_vllm}" if preset and preset.min_vllm else ""
    return (
        f"nemotron-gateway engine: {missing}\n"
        f"nemotron-gateway engine: printed without an installed vLLM{wanted}: not checked against its "
        f"--help=all: {flags}\n"
    )


def _preflight(settings: Settings, profile: Profile, *, ask_verdict: bool = True) -> Callable[[], str | None] | None:
    """The doctor's checks but vLLM's verdict now: a fatal one stops the start (the rest are logged). Returns
    the check that asks vLLM's verdict on the argv (an import of vLLM: 15-60 s), to run beside the engine's start
    (which imports it too), or None without one (or with `ask_verdict` False: another replica of this process asks it,
    as the model and flags are the same); it answers why the start is refused, or None."""
    config = doctor_config(settings, profile)
    _judged(run_checks(replace(config, ask_vllm=False)))
    if config.engine_python is None or not ask_verdict:
        return None

    def verdict() -> str | None:
        try:
            _judged(vllm_verdict_checks(config))
        except ProfileError as refused:
            return str(refused)
        return None

    return verdict


def _judged(checks: list[Check]) -> None:
    """Log the warnings among `checks`; raise ProfileError with the fatal ones."""
    for check in checks:
        if check.status in ("warn", "fail") and not check.blocks_start:
            logger.warning("preflight %s: %s (%s)", check.name, check.measured, check.fix)
    if fatal := fatal_failures(checks):
        raise ProfileError("preflight checks failed (see `nemotron-gateway doctor`):\n" + render_table(fatal))


def _build_replicas(settings: Settings) -> ReplicaSet:
    """A supervisor for each replica this process runs, each with its own port, GPUs, state dir and preflight; the
    metrics port opened once (`metrics_port`, or `metrics_port` + the index of a lone `engine.replica`)."""
    indices = replica_indices(settings.engine)
    several = settings.engine.replicas > 1
    _, first_argv, _ = prepare(replica_settings(settings, indices[0], settings.engine.gpus))
    gpus = replica_gpus(settings.engine, first_argv)
    metrics = SupervisorMetrics()
    supervisors = []
    for index in indices:
        own = replica_settings(settings, index, gpus[index])
        profile, argv, env = prepare(own)
        asks = index == indices[0]  # vLLM's verdict on the shared model and flags: asked once per process
        verdict = _preflight(own, profile, ask_verdict=asks) if settings.engine.run_doctor else None
        status = EngineStatus(
            profile=profile.name, model=settings.engine.model or "", engine_url=f"http://127.0.0.1:{own.engine.port}"
        )
        name = f"engine {index}" if several else "engine"
        logger.info("%s command: %s%s", name, " ".join(argv), f" (GPUs {gpus[index]})" if gpus[index] else "")
        write_running_env(settings, index)
        supervisors.append(
            EngineSupervisor(
                own.engine,
                argv,
                env,
                status=status,
                metrics=metrics,
                preflight=verdict,
                replica=index,
                name=name,
                on_line=functools.partial(_echo_engine, f"{name} | "),
            )
        )
    if settings.engine.metrics_port:
        port = settings.engine.metrics_port + (settings.engine.replica or 0)
        start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    return ReplicaSet(supervisors)


def _echo_engine(prefix: str, line: str) -> None:
    sys.stdout.write(f"{prefix}{line}\n")
    sys.stdout.flush()


def run_engine(settings: Settings) -> int:
    """`nemotron-gateway engine`: the supervisor in the foreground (the production unit)."""
    quiet_probe_loggers()
    try:
        replicas = _build_replicas(settings)
    except ProfileError as exc:
        sys.stderr.write(f"nemotron-gateway engine: {exc}\n")
        return 2

    async def main() -> int:
        replicas.install_signal_handlers()
        return await replicas.run()

    return asyncio.run(main())


def _gateway_argv(env_file: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "gateway", "serve"]
    return argv + (["--env-file", str(env_file)] if env_file is not None else [])


def _gateway_env(settings: Settings) -> dict[str, str]:
    # Resolved settings reach the child through its environment (a secret in argv shows in `ps`).
    env = dict(os.environ)
    env.pop("NEMOTRON_ENGINE__REPLICA", None)  # one replica's supervisor; the gateway routes across them all
    if settings.engine.replicas == 1:
        env["NEMOTRON_ENGINE_URL"] = f"http://127.0.0.1:{settings.engine.port}"
    env.update(
        {
            "NEMOTRON_HOST": settings.host,
            "NEMOTRON_PORT": str(settings.port),
            # Every local replica: the gateway names them with Settings.local_replica_urls().
            "NEMOTRON_ENGINE__REPLICAS": str(settings.engine.replicas),
            "NEMOTRON_ENGINE__PORT": str(settings.engine.port),
            # The gateway translates the client's reasoning switch into this preset's convention.
            "NEMOTRON_ENGINE__PRESET": settings.engine.preset,
            "NEMOTRON_REDIS_URL": settings.redis_url.get_secret_value(),
            "NEMOTRON_LOG_LEVEL": settings.log_level,
        }
    )
    return env


def _echo_gateway(line: str) -> None:
    sys.stdout.write(f"gateway | {line}\n")
    sys.stdout.flush()


def run_up(settings: Settings, env_file: Path | None) -> int:
    """`nemotron-gateway up`: the replicas' supervisors + gateway in one foreground process tree."""
    quiet_probe_loggers()
    try:
        replicas = _build_replicas(settings)
    except ProfileError as exc:
        sys.stderr.write(f"nemotron-gateway up: {exc}\n")
        return 2

    def gateway() -> GuardedProcess:
        return GuardedProcess(
            _gateway_argv(env_file),
            env=_gateway_env(settings),
            grace=settings.shutdown_grace + 5,
            on_line=_echo_gateway,
        )

    return asyncio.run(_up(replicas, gateway))


async def _up(replicas: ReplicaSet, new_gateway: Callable[[], GuardedProcess]) -> int:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (2, 15):  # SIGINT, SIGTERM: drain the gateway first, then stop every replica's engine
        loop.add_signal_handler(sig, stop_requested.set)
    engine_task = asyncio.create_task(replicas.run(), name="engine-supervisors")
    stop_wait = asyncio.create_task(stop_requested.wait(), name="stop-requested")
    failures = 0
    while True:
        gateway = new_gateway()
        await gateway.start()
        started = time.monotonic()
        gateway_exit = asyncio.create_task(gateway.wait(), name="gateway-exit")
        await asyncio.wait((engine_task, gateway_exit, stop_wait), return_when=asyncio.FIRST_COMPLETED)
        if not gateway_exit.done():
            await gateway.stop()
            break
        if stop_wait.done() or engine_task.done():
            break
        # The gateway holds no model: restart it and keep the engine (minutes to reload) running.
        failures = 1 if time.monotonic() - started > _GATEWAY_STABLE else failures + 1
        delay = min(_GATEWAY_BACKOFF_MAX, _GATEWAY_BACKOFF_INITIAL * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
        logger.error(
            "the gateway exited unexpectedly (exit code %s); restarting it in %.1f s, the engine stays up",
            gateway.returncode,
            delay,
        )
        await asyncio.wait((engine_task, stop_wait), timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        if stop_wait.done() or engine_task.done():
            break
    replicas.handle_exit()
    code = await engine_task
    stop_wait.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stop_wait
    return code
