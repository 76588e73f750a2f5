"""SharedEngineState: what one worker of a gateway records, every worker forked from the same parent reads;
one verdict for all, the probe turn held by one of them, and "not generating" cleared only by progress."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

from gateway.relay.readiness import HEALTH_STATUS, REFUSED, SharedEngineState

_fork = multiprocessing.get_context("fork")


def _in_child(action: Callable[[], object]) -> None:
    child = _fork.Process(target=action)
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0


def test_a_verdict_published_in_a_forked_worker_is_what_its_siblings_and_parent_read() -> None:
    shared = SharedEngineState()
    assert shared.verdict().reason == "not probed yet"
    _in_child(lambda: shared.publish_up(time.monotonic()))
    assert shared.verdict().reason is None
    epoch = shared.verdict().epoch
    _in_child(lambda: shared.publish_down(HEALTH_STATUS, time.monotonic(), detail=503))
    assert shared.verdict().reason == "/health answered 503"
    _in_child(lambda: shared.publish_up(time.monotonic()))
    assert shared.verdict().epoch == epoch + 1, "it came up again: every worker relearns the model"


def test_not_generating_is_cleared_by_progress_in_any_worker_and_by_nothing_else() -> None:
    shared = SharedEngineState()
    shared.publish_up(time.monotonic())
    failed_probe_started = time.monotonic()
    _in_child(lambda: shared.mark_stuck(failed_probe_started))
    assert shared.verdict().reason == "engine not generating"
    # What a /health 200 leads a worker to do while the engine stays up: nothing is published, so nothing clears.
    _in_child(lambda: shared.take_probe_turn(1, 1.0))
    assert shared.verdict().reason == "engine not generating"
    _in_child(lambda: setattr(shared, "last_progress", time.monotonic()))  # a token reached another worker
    assert shared.verdict().reason is None


def test_the_probe_turn_is_held_by_one_worker_until_its_lease_runs_out() -> None:
    shared = SharedEngineState()
    results = _fork.Queue()
    # A lease longer than forking eight processes can take on a busy machine: only one of them may win it.
    takers = [_fork.Process(target=lambda n=n: results.put((n, shared.take_probe_turn(n, 30.0)))) for n in range(1, 9)]
    for taker in takers:
        taker.start()
    for taker in takers:
        taker.join(timeout=30)
    won = [n for n, took in (results.get(timeout=5) for _ in takers) if took]
    assert len(won) == 1, won
    assert not shared.take_probe_turn(99, 0.5)
    assert shared.take_probe_turn(won[0], 0.2), "the holder renews it (for a short lease now)"
    assert not shared.take_probe_turn(99, 0.5)
    time.sleep(0.3)
    assert shared.take_probe_turn(99, 0.5), "a lease not renewed runs out"


def test_draining_and_exchanges_in_flight_are_seen_across_the_fork() -> None:
    shared = SharedEngineState()

    def worker() -> None:
        slot = shared.claim_slot()
        assert slot is not None
        shared.set_in_flight(slot, 3)
        shared.mark_draining()

    _in_child(worker)
    assert shared.draining
    assert shared.in_flight() == 0, "the worker that had them in flight is gone"
    slot = shared.claim_slot()
    assert slot is not None
    shared.set_in_flight(slot, 2)
    assert shared.in_flight() == 2
    shared.publish_down(REFUSED, time.monotonic())
    assert shared.verdict().reason == "connection refused"
