"""SharedEngineState: the one view of the engine that every forked worker of a gateway reads and writes.

Readiness is one fact per gateway, not per worker: a load balancer asking /ready, and the requests that
follow, reach whichever worker the kernel picks, so all of them must answer alike. The design is one
prober at a time over one shared record (not a verdict per worker reconciled afterwards):

- one worker holds the *probe turn* (a lease: holder and expiry, taken under a lock, renewed on every
  probe tick); it alone probes /health and sends the idle one-token generation probe, and writes the
  verdict. If it stops (SIGSTOP, a hung loop) the lease runs out and the next worker's tick takes it;
- every worker reads the verdict on each request and each /ready (a few 8-byte loads, no I/O), and
  writes the evidence it sees itself: progress (a chunk or answer from the engine), the exchanges it has
  in flight (its own slot), a refused connection (the engine is down);
- "not generating" is a timestamp (`stuck_since`, the start of the failed probe) that only later progress
  clears: no worker can turn it back into "ready" on a /health 200 (vLLM answers 200 while its engine
  core hangs); a /health verdict clears only a "down" (refused, non-200);
- `draining` is set by the pool parent the moment it gets its stop signal, so every worker's /ready says
  503 at once, before each worker is signalled.

The record is an anonymous MAP_SHARED mapping (a fork shares the page instead of copying it), made by the
server before it forks its workers; time.monotonic() is one clock for every process on the machine. Each
field is an aligned 8-byte word: a load or store of one is a single instruction on x86-64 and aarch64, so
a reader sees the old or the new value, never a mix. Fields that change together are written in an order
whose intermediate states are harmless (see `publish_up`). Only the rare read-modify-writes (taking the
probe turn, claiming a slot) take the lock, and never blocking: a worker stopped while it holds the lock
must not stop the others. Stdlib only.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import struct
import time
from dataclasses import dataclass

from gateway.engine.supervisor_state import pid_alive

# Why the engine is down, as a code (the verdict word's low byte) and, for /health, its status (the bits above).
HEALTHY = 0
NOT_PROBED = 1
REFUSED = 2
HEALTH_STATUS = 3
KEY_REFUSED = 4
MODELS_UNAVAILABLE = 5
_REASONS = {
    NOT_PROBED: "not probed yet",
    REFUSED: "connection refused",
    HEALTH_STATUS: "/health answered {}",
    KEY_REFUSED: "engine key refused",
    MODELS_UNAVAILABLE: "model list unavailable",
}

# Field offsets (bytes); every field is one 8-byte word.
_HEALTH = 0  # i64: reason code | detail << 8 (HEALTHY: /health 200 and the model known)
_VERDICT_AT = 8  # f64: when the evidence behind the health word was gathered (an older probe does not overwrite it)
_EPOCH = 16  # i64: counts the times the engine came up (each worker relearns the model when it changes)
_PROGRESS_MARK = 24  # f64: last progress when it came up ("stuck" is judged only once it generated since)
_STUCK_SINCE = 32  # f64: start of the failed generation probe that found it not generating; 0.0: not stuck
_LAST_PROGRESS = 40  # f64: when any worker last saw the engine produce something
_LEASE_UNTIL = 48  # f64: the probe turn's expiry
_LEASE_HOLDER = 56  # i64: the monitor holding the probe turn
_DRAINING = 64  # i64: 1 once the gateway got its stop signal
_SLOTS = 128  # then SLOTS x (pid i32, exchanges in flight i32)
SLOTS = 256
_SIZE = _SLOTS + 8 * SLOTS
_F64 = struct.Struct("d")  # the progress stamp, written for every relayed chunk: packed without a format lookup


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the gateway knows of the engine now, as one worker read it."""

    down: str | None  # why it is down (refused, non-200 /health, model unknown to the prober), or None
    stuck: bool  # a generation probe failed and no progress was seen since it started
    epoch: int
    probed: bool  # some worker has published a verdict since the gateway started

    @property
    def reason(self) -> str | None:
        """None when the engine is ready, else a short reason."""
        if self.down is not None:
            return self.down
        return "engine not generating" if self.stuck else None


def _describe(word: int) -> str | None:
    code, detail = word & 0xFF, word >> 8
    if code == HEALTHY:
        return None
    return _REASONS.get(code, "unknown").format(detail)


class SharedEngineState:
    """The gateway-wide engine record, shared by this process and the processes it forks."""

    def __init__(self) -> None:
        self._memory = mmap.mmap(-1, _SIZE)  # anonymous, MAP_SHARED (mmap's default on Unix), zero-filled
        self._lock = multiprocessing.get_context("fork").Lock()
        self._put("q", _HEALTH, NOT_PROBED)
        self._put("d", _LAST_PROGRESS, time.monotonic())

    def _get(self, fmt: str, offset: int) -> float:
        value: float = struct.unpack_from(fmt, self._memory, offset)[0]
        return value

    def _put(self, fmt: str, offset: int, value: float) -> None:
        struct.pack_into(fmt, self._memory, offset, value)

    # Readers: every worker, on every request.

    def verdict(self) -> Verdict:
        """The engine's state as every worker sees it."""
        stuck_since = self._get("d", _STUCK_SINCE)
        health = int(self._get("q", _HEALTH))
        return Verdict(
            down=_describe(health),
            stuck=stuck_since > 0.0 and self.last_progress < stuck_since,
            epoch=int(self._get("q", _EPOCH)),
            probed=health != NOT_PROBED,
        )

    @property
    def last_progress(self) -> float:
        """When any worker last saw the engine produce something (time.monotonic())."""
        return self._get("d", _LAST_PROGRESS)

    @last_progress.setter
    def last_progress(self, value: float) -> None:
        self._put("d", _LAST_PROGRESS, value)

    def stamp_progress(self) -> None:
        """The engine produced something just now (the relay calls this for every chunk: one store)."""
        _F64.pack_into(self._memory, _LAST_PROGRESS, time.monotonic())

    @property
    def progress_mark(self) -> float:
        """`last_progress` when the engine last came up."""
        return self._get("d", _PROGRESS_MARK)

    @property
    def stuck_since(self) -> float:
        """Start of the failed probe that found the engine not generating (0.0: never, or it came up since)."""
        return self._get("d", _STUCK_SINCE)

    @property
    def verdict_at(self) -> float:
        """When the evidence behind the current up/down verdict was gathered."""
        return self._get("d", _VERDICT_AT)

    @property
    def draining(self) -> bool:
        """Whether the gateway got its stop signal."""
        return self._get("q", _DRAINING) != 0

    # Writers of evidence: any worker.

    def mark_draining(self) -> None:
        """The gateway stops: every worker's /ready says 503 from now on (safe in a signal handler)."""
        self._put("q", _DRAINING, 1)

    def publish_down(self, code: int, observed_at: float, detail: int = 0) -> None:
        """The engine was found down (`code`, e.g. REFUSED) by evidence gathered at `observed_at`."""
        self._put("d", _VERDICT_AT, observed_at)
        self._put("q", _HEALTH, code | detail << 8)

    def mark_stuck(self, since: float) -> None:
        """A generation probe started at `since` failed and nothing was produced since: not generating
        until progress newer than `since` is recorded."""
        self._put("d", _STUCK_SINCE, since)

    # The prober's writes.

    def publish_up(self, observed_at: float) -> None:
        """The engine answers /health 200 and its model is known, by evidence from `observed_at`: a new epoch
        (it came up, maybe restarted as another model), not stuck. The health word goes last, so a reader
        that sees it healthy also sees the new epoch and the cleared stuck mark."""
        self._put("d", _PROGRESS_MARK, self.last_progress)
        self._put("d", _STUCK_SINCE, 0.0)
        self._put("q", _EPOCH, int(self._get("q", _EPOCH)) + 1)
        self._put("d", _VERDICT_AT, observed_at)
        self._put("q", _HEALTH, HEALTHY)

    def take_probe_turn(self, holder: int, lease: float) -> bool:
        """Whether `holder` has the probe turn for the next `lease` seconds: it holds it already, or the last
        holder's lease ran out. A compare-and-swap under the lock; when the lock is busy (another worker is
        taking the turn this instant) the answer is what the record says, without waiting."""
        now = time.monotonic()
        if not self._lock.acquire(block=False):
            return self._get("q", _LEASE_HOLDER) == holder and self._get("d", _LEASE_UNTIL) > now
        try:
            if self._get("q", _LEASE_HOLDER) != holder and self._get("d", _LEASE_UNTIL) > now:
                return False
            self._put("q", _LEASE_HOLDER, holder)
            self._put("d", _LEASE_UNTIL, now + lease)
            return True
        finally:
            self._lock.release()

    def holds_probe_turn(self, holder: int) -> bool:
        """Whether `holder` still holds an unexpired probe turn (checked before it publishes a verdict)."""
        return self._get("q", _LEASE_HOLDER) == holder and self._get("d", _LEASE_UNTIL) > time.monotonic()

    # Exchanges in flight: one slot per worker, written by that worker alone.

    def claim_slot(self) -> int | None:
        """A slot for this process's count of exchanges in flight (a free one, or a dead process's); None
        when all are taken by live processes (its exchanges then go uncounted)."""
        if not self._lock.acquire(timeout=1.0):  # held by a stopped worker: go uncounted rather than hang
            return None
        try:
            for slot in range(SLOTS):
                pid = int(self._get("i", _SLOTS + 8 * slot))
                if pid == 0 or not pid_alive(pid):
                    self._put("i", _SLOTS + 8 * slot, os.getpid())
                    self._put("i", _SLOTS + 8 * slot + 4, 0)
                    return slot
            return None
        finally:
            self._lock.release()

    def set_in_flight(self, slot: int, count: int) -> None:
        """This process's exchanges in flight now."""
        self._put("i", _SLOTS + 8 * slot + 4, count)

    def in_flight(self) -> int:
        """Exchanges in flight in every live process of the gateway."""
        total = 0
        for slot in range(SLOTS):
            pid = int(self._get("i", _SLOTS + 8 * slot))
            if pid == 0:
                continue
            count = int(self._get("i", _SLOTS + 8 * slot + 4))
            if count and pid_alive(pid):
                total += count
        return total
