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

import hashlib
import mmap
import multiprocessing
import os
import struct
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Lock

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
_DRAINING = 64  # i64: 1 once the gateway got its stop signal (the pool's first record only)
_SLOTS_USED = 72  # i64: one past the highest slot ever claimed (the in-flight sum reads that far)
_DRAINED = 80  # i64: 1 while an operator has drained this engine (read from Redis by the worker probing it)
_ENGINE_QUEUE = 88  # f64: requests the engine runs and queues, as the worker probing it last scraped its /metrics
_KV_CACHE_USE = 96  # f64: the engine's KV-cache use (0 to 1), from the same scrape
_SLOTS = 128  # then SLOTS x (pid i32, exchanges in flight i32, requests picked and not yet sent i32, padding)
SLOTS = 256
_SLOT_SIZE = 16
RECORD_SIZE = _SLOTS + _SLOT_SIZE * SLOTS
_F64 = struct.Struct("d")  # the progress stamp, written for every relayed chunk: packed without a format lookup
_SLOT = struct.Struct("iii")


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

    def __init__(self, memory: mmap.mmap | None = None, base: int = 0, lock: Lock | None = None) -> None:
        """A record of its own (no arguments), or the one at `base` in `memory` guarded by `lock` (a pool's)."""
        if memory is None:
            memory = mmap.mmap(-1, RECORD_SIZE)  # anonymous, MAP_SHARED (mmap's default on Unix), zero-filled
        self._memory = memory
        self._base = base
        self._lock = lock or multiprocessing.get_context("fork").Lock()
        if lock is None:
            self.reset()

    def reset(self) -> None:
        """A fresh record: nothing probed, progress now, no slot claimed."""
        self._memory[self._base : self._base + RECORD_SIZE] = bytes(RECORD_SIZE)
        self._put("q", _HEALTH, NOT_PROBED)
        self._put("d", _LAST_PROGRESS, time.monotonic())

    def _get(self, fmt: str, offset: int) -> float:
        value: float = struct.unpack_from(fmt, self._memory, self._base + offset)[0]
        return value

    def _put(self, fmt: str, offset: int, value: float) -> None:
        struct.pack_into(fmt, self._memory, self._base + offset, value)

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
        _F64.pack_into(self._memory, self._base + _LAST_PROGRESS, time.monotonic())

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

    @property
    def drained(self) -> bool:
        """Whether an operator drained this engine (the probing worker's last reading of Redis)."""
        return self._get("q", _DRAINED) != 0

    @drained.setter
    def drained(self, value: bool) -> None:
        self._put("q", _DRAINED, 1 if value else 0)

    @property
    def engine_load(self) -> tuple[float, float]:
        """The engine's own count of requests running and waiting, and its KV-cache use, as the worker probing it
        last scraped them (every gateway's requests, not only this one's; 0.0, 0.0 before the first scrape)."""
        return self._get("d", _ENGINE_QUEUE), self._get("d", _KV_CACHE_USE)

    def publish_engine_load(self, queued: float, kv_cache_use: float) -> None:
        """Keep a scrape's running + waiting requests and KV-cache use for every worker's picker."""
        self._put("d", _ENGINE_QUEUE, queued)
        self._put("d", _KV_CACHE_USE, kv_cache_use)

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

    # Exchanges in flight, and requests picked for the engine that have not opened theirs yet: one slot per worker,
    # written by that worker alone.

    def claim_slot(self) -> int | None:
        """A slot for this process's counts of exchanges in flight and requests picked (a free one, or a dead
        process's); None when all are taken by live processes (its requests then go uncounted)."""
        if not self._lock.acquire(timeout=1.0):  # held by a stopped worker: go uncounted rather than hang
            return None
        try:
            for slot in range(SLOTS):
                pid = int(self._get("i", _SLOTS + _SLOT_SIZE * slot))
                if pid == 0 or not pid_alive(pid):
                    _SLOT.pack_into(self._memory, self._base + _SLOTS + _SLOT_SIZE * slot, os.getpid(), 0, 0)
                    if slot >= self._get("q", _SLOTS_USED):
                        self._put("q", _SLOTS_USED, slot + 1)
                    return slot
            return None
        finally:
            self._lock.release()

    def set_in_flight(self, slot: int, count: int, picked: int = 0) -> None:
        """This process's exchanges in flight now, and its requests picked for the engine that have not opened one
        yet (each count is one aligned 4-byte store: a reader sees the old or the new value)."""
        self._put("i", _SLOTS + _SLOT_SIZE * slot + 4, count)
        self._put("i", _SLOTS + _SLOT_SIZE * slot + 8, picked)

    def in_flight(self, *, picked: bool = False) -> int:
        """Exchanges in flight in every live process of the gateway (the monitor's "idle or stalled"); `picked`: with
        the requests picked for the engine that have not opened theirs yet (a drain waits for those too)."""
        total = 0
        for slot in range(int(self._get("q", _SLOTS_USED))):
            pid, count, waiting = _SLOT.unpack_from(self._memory, self._base + _SLOTS + _SLOT_SIZE * slot)
            count += waiting if picked else 0
            if pid != 0 and count and pid_alive(pid):
                total += count
        return total

    def outstanding(self) -> int:
        """Requests of every process of the gateway on the engine: exchanges in flight and requests picked for it
        that have not opened theirs yet, as the slots say (a dead process's slot is counted until another process
        claims it): the picker's load figure, read for every request, so without a liveness check."""
        memory, start, total = self._memory, self._base + _SLOTS, 0
        for slot in range(int(self._get("q", _SLOTS_USED))):
            _, count, waiting = _SLOT.unpack_from(memory, start + _SLOT_SIZE * slot)
            total += count + waiting
        return total

    @property
    def probe_lease_until(self) -> float:
        """When the probe turn's last lease runs out (time.monotonic()): long past when no worker probes this
        engine any more (it left every worker's pool)."""
        return self._get("d", _LEASE_UNTIL)


# The pool's record: a header (the gateway's draining flag, then which replica holds each record), then the records.
POOL_RECORDS = 32
_POOL_DRAINING = 0
_POOL_TAGS = 8
_POOL_HEADER = _POOL_TAGS + 8 * POOL_RECORDS
# A record no worker has probed for this long belongs to a replica that left the pool: another may take it.
_RECLAIM_AFTER = 60.0


def _tag(replica_id: str) -> int:
    """A replica's id as one non-zero 63-bit word, the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "big") >> 1 | 1


class SharedPoolState:
    """The gateway-wide records of every replica in its pool, shared by this process and the processes it forks:
    one `SharedEngineState` per replica, found by the replica's id in every worker alike (a worker that learns of a
    replica from the watched file first claims it a record; the others find it there), and the gateway's draining
    flag."""

    def __init__(self, records: int = POOL_RECORDS) -> None:
        self._records = min(records, POOL_RECORDS)
        self._memory = mmap.mmap(-1, _POOL_HEADER + self._records * RECORD_SIZE)
        self._lock = multiprocessing.get_context("fork").Lock()
        self._views: dict[str, tuple[int, SharedEngineState]] = {}  # this process's: id -> (index, record)

    @property
    def draining(self) -> bool:
        """Whether the gateway got its stop signal."""
        draining: int = struct.unpack_from("q", self._memory, _POOL_DRAINING)[0]
        return draining != 0

    def mark_draining(self) -> None:
        """The gateway stops: every worker's /ready says 503 from now on (safe in a signal handler)."""
        struct.pack_into("q", self._memory, _POOL_DRAINING, 1)

    def record(self, replica_id: str) -> SharedEngineState:
        """The record of the replica `replica_id`: the one already claimed for it, else a free one (or one no worker
        has probed for a minute) claimed now; a private one, unshared, when every record is held."""
        tag = _tag(replica_id)
        known = self._views.get(replica_id)
        if known is not None and self._tag_at(known[0]) == tag:
            return known[1]
        if not self._lock.acquire(timeout=1.0):  # held by a stopped worker: go unshared rather than hang
            return SharedEngineState()
        try:
            index = self._find(tag)
            view = None if index is None else self._view(index)
            if view is not None and index is not None and self._tag_at(index) != tag:
                struct.pack_into("q", self._memory, _POOL_TAGS + 8 * index, tag)
                view.reset()
        finally:
            self._lock.release()
        if view is None or index is None:
            return SharedEngineState()
        self._views[replica_id] = (index, view)
        return view

    def _tag_at(self, index: int) -> int:
        tag: int = struct.unpack_from("q", self._memory, _POOL_TAGS + 8 * index)[0]
        return tag

    def _view(self, index: int) -> SharedEngineState:
        return SharedEngineState(self._memory, _POOL_HEADER + index * RECORD_SIZE, self._lock)

    def _find(self, tag: int) -> int | None:
        """The index holding `tag`, else a free one, else the longest unprobed one with nothing in flight."""
        free: int | None = None
        stale: tuple[float, int] | None = None
        now = time.monotonic()
        for index in range(self._records):
            held = self._tag_at(index)
            if held == tag:
                return index
            if held == 0:
                free = index if free is None else free
                continue
            lease = self._view(index).probe_lease_until
            if lease < now - _RECLAIM_AFTER and (stale is None or lease < stale[0]):
                stale = (lease, index)
        if free is not None:
            return free
        if stale is not None and self._view(stale[1]).in_flight() == 0:
            return stale[1]
        return None
