"""Pickers: which ready replica of a model gets a request.

- `least_loaded`: the replica with the least outstanding work (the exchanges every worker of this gateway has in
  flight with it, or the requests its engine runs and queues where its own gauges say more, its KV-cache use
  breaking ties), exact ties broken at random so that a burst on an idle pool spreads;
- `affinity`: rendezvous (highest random weight) hashing of the request's affinity key over the replicas, so the
  turns of one conversation go to the replica whose prefix cache holds them, and a replica that leaves moves only
  the conversations it had; a request spills to the least loaded replica when the preferred one carries more than
  `spill_load` times the least loaded one's requests plus `spill_slack`;
- `round_robin`: each in turn (the baseline the benchmarks compare with).

Pure functions of the candidates and their loads: no I/O. Imports settings only.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

from gateway.settings import RoutingSettings

AFFINITY = "affinity"
SPILL = "spill"
LEAST_LOADED = "least_loaded"
ROUND_ROBIN = "round_robin"


class Candidate(Protocol):
    """A replica as a picker sees it."""

    @property
    def url(self) -> str:
        """Its name, hashed for affinity."""
        ...

    def load(self) -> float:
        """Its outstanding work (requests, in flight or queued in the engine)."""
        ...


C = TypeVar("C", bound=Candidate)


def rendezvous_weight(affinity: bytes, url: str) -> int:
    """The weight of replica `url` for `affinity`: the replica with the highest weight is preferred. A keyed hash, so
    the order is the same in every worker and every gateway."""
    return int.from_bytes(hashlib.blake2b(affinity, key=url.encode()[:64], digest_size=8).digest(), "big")


def least_loaded(candidates: Sequence[C]) -> C:
    """The candidate with the least outstanding work (one of them at random when several tie)."""
    loads = [candidate.load() for candidate in candidates]
    lowest = min(loads)
    tied = [candidate for candidate, load in zip(candidates, loads, strict=True) if load == lowest]
    return tied[0] if len(tied) == 1 else random.choice(tied)  # spreading, not a secret


class Picker:
    """Picks among a model's ready replicas by `how` (affinity, least_loaded or round_robin)."""

    def __init__(self, how: str, settings: RoutingSettings) -> None:
        self.how = how
        self._spill_load = settings.spill_load
        self._spill_slack = settings.spill_slack
        self._turns = itertools.count()

    def pick(self, candidates: Sequence[C], affinity: bytes | None) -> tuple[C, str]:
        """One of `candidates` (not empty) and how it was chosen (`affinity`, `spill`, `least_loaded`,
        `round_robin`); affinity without a key falls back to the least loaded."""
        if len(candidates) == 1:
            return candidates[0], self.how
        if self.how == ROUND_ROBIN:
            return candidates[next(self._turns) % len(candidates)], ROUND_ROBIN
        if self.how == AFFINITY and affinity is not None:
            preferred = max(candidates, key=lambda candidate: rendezvous_weight(affinity, candidate.url))
            lightest = least_loaded(candidates)
            if preferred.load() > self._spill_load * lightest.load() + self._spill_slack:
                return lightest, SPILL
            return preferred, AFFINITY
        return least_loaded(candidates), LEAST_LOADED
