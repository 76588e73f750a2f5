"""SharedInstant: a value recorded in a forked worker is what its parent and its sibling read."""

from __future__ import annotations

import multiprocessing
import time

from gateway.relay.shared import SharedInstant


def _record(instant: SharedInstant) -> None:
    instant.record_now()


def test_a_value_recorded_in_a_forked_process_is_seen_by_the_others() -> None:
    instant = SharedInstant()
    assert instant.value() == 0.0
    before = time.monotonic()
    child = multiprocessing.get_context("fork").Process(target=_record, args=(instant,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert before <= instant.value() <= time.monotonic()
