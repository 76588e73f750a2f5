"""EngineSupervisor: spawns `vllm serve`, knows when it is ready, restarts it when it dies or stops generating.

Signal handlers only record; the loop acts; a second signal forces (uvicorn's model). Readiness is
/health 200; liveness after that is progress (`liveness.py`), so a busy engine is never restarted and a
frozen one is. Restarts back off exponentially with jitter, and a crash-loop budget ends in FAILED with
a non-zero exit so that systemd's own restart policy takes over. Each restart's cause is kept in the
status file. Talks to the engine over HTTP only; never imports the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any

import httpx

from gateway.doctor.check import gib
from gateway.engine.launch import ENGINE_KEY_VARIABLE
from gateway.engine.nvml import GpuReadings, read_gpus
from gateway.engine.supervisor_state import (
    DATA_PARALLEL_FLAG,
    RESTART_REQUEST_POLL,
    STATUS_FILE,
    TENSOR_PARALLEL_FLAG,
    EngineState,
    EngineStatus,
    RestartCause,
    RestartRecord,
    parallel_size,
    scheduling_policy,
    sequence_slots,
    take_restart_request,
)
from gateway.metrics.instruments import SupervisorMetrics
from gateway.settings import EngineSettings
from gateway.supervisor.liveness import PROBE_MARK, Liveness, Verdict
from gateway.supervisor.process import GuardedProcess, MemberWatch, process_names

logger = logging.getLogger(__name__)

_READY_POLL = 0.5
_PROGRESS_EVERY = 10.0
# Seconds a condemned engine gets to show that it has in fact exited (its reaper reports within ~0.1 s).
_EXIT_GRACE = 1.0
# Seconds between two samples of the group's /dev/shm files while the engine runs. They are for when the whole
# group dies, reaper included (the reaper sees each file appear and samples it itself); vLLM makes its files while
# it starts (sampled on every start-up poll and when ready) and keeps them. A sample reads all of /proc and the
# engine's memory maps: a few ms that every liveness check (5 s) used to pay on an idle engine.
_SHM_SAMPLE_EVERY = 30.0
# Seconds the driver gets to free the GPU memory of an engine whose processes are all gone (a process the kernel
# still holds, stuck in the driver, keeps its memory until it is reaped).
_GPU_RELEASE = 10.0
_GPU_RELEASE_POLL = 0.5


def held_gpu_memory(readings: GpuReadings, pids: Collection[int]) -> list[str]:
    """Where NVML still lists one of `pids` (an engine that is gone) on a GPU: `GPU 1: pid 42 (20.0 GiB)`."""
    return [
        f"GPU {device.index}: pid {p.pid} ({gib(p.used) if p.used is not None else 'size unknown'})"
        for device in readings.devices
        for p in device.processes
        if p.pid in pids
    ]


async def wait_gpu_memory_released(
    pids: Collection[int], read: Callable[[], GpuReadings] = read_gpus, within: float = _GPU_RELEASE
) -> list[str]:
    """Wait until no GPU lists any of `pids` (the engine's processes, all ended); what is still held after
    `within` s, logged as an error (the next start would find that memory taken). NVML is read off the loop."""
    deadline = time.monotonic() + within
    while True:
        held = held_gpu_memory(await asyncio.to_thread(read), pids) if pids else []
        if not held or time.monotonic() >= deadline:
            break
        await asyncio.sleep(_GPU_RELEASE_POLL)
    if held:
        logger.error("GPU memory still held %.0f s after the engine's processes ended: %s", within, "; ".join(held))
    return held


class EngineSupervisor:
    """Keeps one engine (one replica) running; `run()` returns the process exit code (0 stopped, 1 failed, 2 refused
    by the preflight asked beside the first start). An operator's restart request (a file in its state dir,
    `request_restart`) restarts a ready engine within about `RESTART_REQUEST_POLL` s, outside the crash budget."""

    def __init__(
        self,
        settings: EngineSettings,
        argv: list[str],
        env: Mapping[str, str],
        *,
        status: EngineStatus,
        metrics: SupervisorMetrics | None = None,
        on_line: Callable[[str], None] | None = None,
        preflight: Callable[[], str | None] | None = None,
        replica: int = 0,
        name: str = "engine",
    ) -> None:
        """`preflight`, when given, is a slow check (vLLM's verdict on the argv: an import of vLLM, as the
        engine's own start is) run on a thread beside the first start; it answers why the start is refused, or
        None. The engine is reported READY only once it has passed; a refusal stops the engine and ends `run()`
        with 2 (FAILED, the refusal as the reason). `replica` labels its metrics; `name` starts its log lines
        (`engine 1` beside other replicas)."""
        self.settings = settings
        self.argv = argv
        self.env = dict(env)
        self.status = status
        self.status.scheduling_policy = scheduling_policy(argv)
        self.status.sequence_slots = sequence_slots(argv)
        self.status.gpus = env.get("CUDA_VISIBLE_DEVICES")
        self.status.tensor_parallel_size = parallel_size(argv, TENSOR_PARALLEL_FLAG)
        self.status.data_parallel_size = parallel_size(argv, DATA_PARALLEL_FLAG)
        self.metrics = metrics
        self.replica = replica
        self.name = name
        self._echo = on_line or _echo
        self.should_exit = asyncio.Event()
        self.force_exit = False
        self.process: GuardedProcess | None = None
        self._crashes: deque[float] = deque()
        self._kill_task: asyncio.Future[None] | None = None
        self._preflight = preflight
        self._verdict: asyncio.Future[str | None] | None = None
        self.refused: str | None = None  # why the preflight refused the start
        self._health_url = f"http://127.0.0.1:{settings.port}/health"
        # vLLM leaves /tmp/vllm_dist_* and IPC sockets behind on every launch: give it a scratch TMPDIR
        # that is emptied before each start and after the stop.
        self.scratch = settings.state_dir / "engine-tmp"
        self.env["TMPDIR"] = str(self.scratch)

    # --- signals: record only -------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT ask for a clean stop; a second one forces it."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_exit)

    def handle_exit(self) -> None:
        """Record a stop request (the loop acts on it)."""
        if self.should_exit.is_set() and not self.force_exit:
            self.force_exit = True
            if self.process is not None:
                self._kill_task = asyncio.ensure_future(self.process.kill())
        self.should_exit.set()

    def on_line(self, line: str) -> None:
        """One line of engine output, unless it is the access line of our own idle probe (one every few s)."""
        if PROBE_MARK not in line:
            self._echo(line)

    # --- state ----------------------------------------------------------------------------------

    def _set_state(self, state: EngineState, reason: str | None = None) -> None:
        if state != self.status.state or reason != self.status.reason:
            log = logger.error if state in (EngineState.FAILED, EngineState.UNHEALTHY) else logger.info
            log("%s %s%s", self.name, state.value, f": {reason}" if reason else "")
        self.status.state = state
        self.status.reason = reason
        self.status.since = time.time()
        self.status.group_pid = self.process.pid if self.process else None
        self.status.engine_pid = self.process.command_pid if self.process else None
        self.status.write(self.settings.state_dir / STATUS_FILE)
        if self.metrics is not None:
            self.metrics.observe(self.status, replica=str(self.replica))

    # --- the loop -------------------------------------------------------------------------------

    async def run(self) -> int:
        """Start, supervise and restart the engine until asked to stop, out of crash budget, or refused by the
        preflight."""
        if self._preflight is not None:
            self._verdict = self._ask_beside_start(self._preflight)
        if take_restart_request(self.settings.state_dir):
            logger.info("%s: a restart request from before this supervisor started is dropped", self.name)
        async with httpx.AsyncClient(timeout=self.settings.probe_timeout) as client:
            while not self.should_exit.is_set():
                ended = await self._run_once(client)
                if ended is None:
                    break
                if not await self._after_crash(ended):
                    return 1
        await self._stop()
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.refused is not None:
            self._set_state(EngineState.FAILED, self.refused)
            return 2
        self._set_state(EngineState.STOPPED)
        return 0

    def _ask_beside_start(self, preflight: Callable[[], str | None]) -> asyncio.Future[str | None]:
        """Run `preflight` on a daemon thread (a stop never waits for it: its vLLM import may take a minute);
        a refusal stops the engine."""
        loop = asyncio.get_running_loop()
        verdict: asyncio.Future[str | None] = loop.create_future()

        def answered(refused: str | None) -> None:
            if verdict.done():
                return
            verdict.set_result(refused)
            if refused is not None:
                self.refused = refused
                logger.error("nemotron-gateway: %s", refused)
                self.handle_exit()

        def ask() -> None:
            try:
                refused = preflight()
            except Exception as exc:  # the check's own failure is not the engine's: logged, the start goes on
                logger.warning("preflight: vLLM's verdict could not be asked (%s): the start goes on", exc)
                refused = None
            with contextlib.suppress(RuntimeError):  # the loop closed: the supervisor has ended already
                loop.call_soon_threadsafe(answered, refused)

        threading.Thread(target=ask, name="preflight-verdict", daemon=True).start()
        return verdict

    async def _passed_preflight(self) -> bool:
        """Wait for the preflight asked beside the start (or a stop); whether the engine may be reported READY."""
        if self._verdict is None or self._verdict.done():
            return self.refused is None
        logger.info("%s ready; waiting for vLLM's verdict on its configuration", self.name)
        stop = asyncio.ensure_future(self.should_exit.wait())
        try:
            await asyncio.wait((self._verdict, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        return self.refused is None and not self.should_exit.is_set()

    async def _run_once(self, client: httpx.AsyncClient) -> RestartRecord | None:
        """One engine life: None when it ended because we stop, else why it ended."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.process = GuardedProcess(
            self.argv,
            env=self.env,
            grace=self.settings.stop_grace,
            log_lines=self.settings.log_lines,
            on_line=self.on_line,
        )
        await self.process.start()
        self._set_state(EngineState.STARTING)
        reason = await self._wait_ready(client)
        if reason is not None or self.should_exit.is_set():
            return reason
        if not await self._passed_preflight():
            return None
        self._set_state(EngineState.READY)
        return await self._watch(client)

    async def _wait_ready(self, client: httpx.AsyncClient) -> RestartRecord | None:
        assert self.process is not None
        started = time.monotonic()
        next_progress = started + _PROGRESS_EVERY
        while not self.should_exit.is_set():
            if self.process.returncode is not None:
                return self._ended(RestartCause.START_FAILED, "exited during start-up", show_tail=True)
            now = time.monotonic()
            if now - started > self.settings.startup_timeout:
                await self.process.kill()
                why = f"not ready after {self.settings.startup_timeout:.0f} s"
                return self._ended(RestartCause.START_FAILED, why, show_tail=True)
            if now >= next_progress:
                logger.info(
                    "%s starting: %.0f s elapsed; last line: %s", self.name, now - started, self.process.last_line
                )
                next_progress = now + _PROGRESS_EVERY
            self.process.sample_shared_memory()
            if await self._probe(client) is None:
                logger.info("%s ready after %.1f s", self.name, time.monotonic() - started)
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.should_exit.wait(), _READY_POLL)
        return None

    async def _watch(self, client: httpx.AsyncClient) -> RestartRecord | None:
        """A ready engine until it exits, stops generating, or we stop; a check runs every `health_interval` s."""
        assert self.process is not None
        liveness = Liveness(self.settings, client, api_key=self.env.get(ENGINE_KEY_VARIABLE))
        exited: asyncio.Future[Any] = asyncio.ensure_future(self.process.wait())
        stop: asyncio.Future[Any] = asyncio.ensure_future(self.should_exit.wait())
        check: asyncio.Future[Any] | None = None
        self.process.sample_shared_memory()
        members = self._watch_members()
        lost: asyncio.Future[int] = asyncio.ensure_future(members.first_exit())
        requested: asyncio.Future[None] = asyncio.ensure_future(self._restart_requested())
        sample_at = time.monotonic() + _SHM_SAMPLE_EVERY
        try:
            while True:
                done, _ = await asyncio.wait(
                    (exited, stop, lost, requested),
                    timeout=self.settings.health_interval,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done and time.monotonic() >= sample_at:
                    self.process.sample_shared_memory()
                    sample_at = time.monotonic() + _SHM_SAMPLE_EVERY
                    if set(self._member_pids()) != set(members.pids):
                        lost.cancel()
                        members.close()
                        members = self._watch_members()
                        lost = asyncio.ensure_future(members.first_exit())
                # The check races the exit and the stop: a probe waiting on a frozen engine must not delay either.
                check = asyncio.ensure_future(liveness.check()) if not done else None
                if check is not None:
                    done, _ = await asyncio.wait(
                        (exited, stop, check, lost, requested), return_when=asyncio.FIRST_COMPLETED
                    )
                if stop in done:
                    return None
                if requested in done and not exited.done():
                    logger.info("%s: restart requested by an operator", self.name)
                    return RestartRecord(at=time.time(), cause=RestartCause.REQUESTED, reason="an operator's request")
                if lost in done and not exited.done():
                    # vLLM itself ended (its reaper reports the code once the rest of the group is down, within the
                    # grace), or it may notice a lost helper and exit by itself: either way its exit code says more.
                    # The status stops saying READY now, not after that wait.
                    vllm = lost.result() == self.process.command_pid
                    self._set_state(EngineState.UNHEALTHY, f"engine process {lost.result()} exited")
                    await asyncio.wait((exited,), timeout=_EXIT_GRACE + (self.settings.stop_grace if vllm else 0))
                if exited.done():
                    # Any exit we did not ask for is a crash: vLLM exits 0 when its engine core dies.
                    if self.process.orphaned:
                        return self._ended(RestartCause.CRASH, "its reaper was killed; the engine's group was ended")
                    return self._ended(RestartCause.CRASH, "exited")
                if lost in done:
                    pid = lost.result()
                    await self.process.kill()
                    what = f"engine process {pid} ({members.names.get(pid, '?')}) exited; restarting the whole engine"
                    return self._ended(RestartCause.CRASH, what)
                assert check is not None
                verdict: Verdict = check.result()
                if verdict.problem is None:
                    if self.status.state != EngineState.READY:
                        self._set_state(EngineState.READY)
                    continue
                if verdict.cause is not None:
                    # A refused connection is often an exit on its way: the exit code tells more.
                    if verdict.failed:
                        await asyncio.wait((exited,), timeout=_EXIT_GRACE)
                    if exited.done():
                        return self._ended(RestartCause.CRASH, "exited")
                    await self.process.kill()
                    return self._ended(verdict.cause, verdict.problem)
                # A slow answer or a gap between tokens is normal under load; only a check that failed outright,
                # or half the stall bound without progress, is worth an UNHEALTHY.
                if verdict.failed or liveness.stalled_for > self.settings.stall_timeout / 2:
                    self._set_state(EngineState.UNHEALTHY, verdict.problem)
        finally:
            for future in (stop, exited, check, lost, requested):
                if future is not None and not future.done():
                    future.cancel()
            members.close()

    async def _restart_requested(self) -> None:
        """Until an operator's restart request appears in the state dir (and is taken). Polled: the request is a
        file another process writes, with no event to wait on."""
        while not take_restart_request(self.settings.state_dir):  # noqa: ASYNC110 - a file, not an in-process event
            await asyncio.sleep(RESTART_REQUEST_POLL)

    def _member_pids(self) -> list[int]:
        """vLLM and every process it started (its reaper left out)."""
        return self.process.members() if self.process is not None else []

    def _watch_members(self) -> MemberWatch:
        """A watch on the engine's processes now (vLLM's API server and the processes vLLM names as its own:
        EngineCore, a worker per GPU, API servers, the data-parallel coordinator); `engine status` shows them.

        Other members come and go in normal work (a compiler Triton runs for a new kernel, a short-lived
        multiprocessing helper): their exit is no fault, so they are not watched."""
        prefix = self.env.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::"
        command = self.process.command_pid if self.process is not None else None
        names = process_names(self._member_pids())
        watch = MemberWatch([pid for pid, name in names.items() if pid == command or name.startswith(prefix)])
        self.status.processes = watch.pids
        self.status.write(self.settings.state_dir / STATUS_FILE)
        return watch

    async def _probe(self, client: httpx.AsyncClient) -> str | None:
        try:
            response = await client.get(self._health_url)
        except httpx.TimeoutException:
            return f"/health did not answer within {self.settings.probe_timeout:g} s"
        except httpx.HTTPError as exc:
            return f"/health failed ({type(exc).__name__})"
        return None if response.status_code == 200 else f"/health answered {response.status_code}"

    def _ended(self, cause: RestartCause, what: str, *, show_tail: bool = False) -> RestartRecord:
        """Why this life ended, with the exit code when the engine exited by itself."""
        assert self.process is not None
        code = self.process.returncode if cause in (RestartCause.CRASH, RestartCause.START_FAILED) else None
        if code is not None:
            self.status.last_exit_code = code
        if show_tail and self.process.tail:
            logger.error("last %s output:\n%s", self.name, "\n".join(list(self.process.tail)[-40:]))
        reason = f"{what} (exit code {code})" if code is not None else what
        return RestartRecord(at=time.time(), cause=cause, reason=reason, exit_code=code)

    async def _after_crash(self, ended: RestartRecord) -> bool:
        """Count the crash; False when the budget is spent (FAILED), else wait the backoff (RESTARTING). A
        requested restart is no crash: the engine is stopped and started again at once."""
        self.status.record_restart(ended)
        if ended.cause is RestartCause.REQUESTED:
            await self._stop()
            self.status.restarts += 1
            self._set_state(EngineState.RESTARTING, f"restart {self.status.restarts} requested by an operator")
            return True
        reason = f"{ended.cause.value}: {ended.reason}"
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.settings.crash_window:
            self._crashes.popleft()
        await self._stop()
        if len(self._crashes) >= self.settings.crash_limit:
            self._set_state(
                EngineState.FAILED,
                f"{reason}; {len(self._crashes)} crashes within {self.settings.crash_window:.0f} s, giving up",
            )
            return False
        delay = min(self.settings.backoff_max, self.settings.backoff_initial * 2 ** (len(self._crashes) - 1))
        delay *= random.uniform(0.8, 1.2)
        self.status.restarts += 1
        self._set_state(EngineState.RESTARTING, f"{reason}; restart {self.status.restarts} in {delay:.1f} s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.should_exit.wait(), delay)
        return True

    async def _stop(self) -> None:
        """Stop the engine's group (if it still runs) and see every GPU's memory of it freed."""
        ended, self.status.processes = self.status.processes, []
        if self.process is not None:
            if self.process.returncode is None:
                self._set_state(EngineState.STOPPING)
                if self.force_exit:
                    await self.process.kill()
            # Also when the reaper has ended: a group it left running (its reaper killed alone) is ended here.
            self.status.last_exit_code = await self.process.stop()
        await wait_gpu_memory_released(ended)


def _echo(line: str) -> None:
    sys.stdout.write(f"engine | {line}\n")
    sys.stdout.flush()
