"""The pickers: rendezvous affinity moves only a leaving replica's share, spills past the load bound, and the least
loaded and round-robin pickers spread."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as redis_asyncio

from gateway.api.validation import leading_messages
from gateway.metrics.instruments import GatewayMetrics
from gateway.pool.pickers import AFFINITY, LEAST_LOADED, ROUND_ROBIN, SPILL, Picker
from gateway.pool.replica import Replica
from gateway.relay.readiness import SharedEngineState
from gateway.settings import RoutingSettings, Settings


@dataclass(eq=False)
class _Replica:
    url: str
    outstanding: int = 0

    def load(self) -> int:
        return self.outstanding


def _pool(count: int) -> list[_Replica]:
    return [_Replica(f"http://10.0.0.{n}:8000") for n in range(count)]


def test_affinity_is_stable_and_a_leaving_replica_moves_only_its_own_conversations() -> None:
    picker = Picker(AFFINITY, RoutingSettings())
    replicas = _pool(5)
    keys = [f"key\0conversation {n}".encode() for n in range(2000)]
    before = {key: picker.pick(replicas, key)[0] for key in keys}
    assert all(picker.pick(list(reversed(replicas)), key)[0] is before[key] for key in keys[:200])  # order-free
    shares = {replica.url: sum(1 for home in before.values() if home is replica) for replica in replicas}
    assert min(shares.values()) > 300, shares  # about 400 each
    leaving = replicas[2]
    after = {key: picker.pick([r for r in replicas if r is not leaving], key)[0] for key in keys}
    moved = [key for key in keys if after[key] is not before[key]]
    assert moved and all(before[key] is leaving for key in moved)
    assert len(moved) == shares[leaving.url]


def test_affinity_spills_to_the_least_loaded_replica_past_the_bound_and_comes_back_below_it() -> None:
    picker = Picker(AFFINITY, RoutingSettings(spill_load=2.0, spill_slack=4))
    replicas = _pool(3)
    key = b"key\0a long shared system prompt"
    home, how = picker.pick(replicas, key)
    assert how == AFFINITY
    others = [r for r in replicas if r is not home]
    others[0].outstanding, others[1].outstanding = 3, 1
    home.outstanding = 2 * 1 + 4  # at the bound: stays
    assert picker.pick(replicas, key) == (home, AFFINITY)
    home.outstanding = 7
    assert picker.pick(replicas, key) == (others[1], SPILL)
    others[1].outstanding = 9
    assert picker.pick(replicas, key)[1] == AFFINITY  # 7 <= 2 x 3 + 4


def test_least_loaded_takes_the_fewest_outstanding_and_round_robin_takes_each_in_turn() -> None:
    replicas = _pool(3)
    replicas[0].outstanding, replicas[1].outstanding, replicas[2].outstanding = 5, 2, 9
    least = Picker(LEAST_LOADED, RoutingSettings())
    assert least.pick(replicas, b"anything") == (replicas[1], LEAST_LOADED)
    idle = _pool(2)
    assert {least.pick(idle, None)[0].url for _ in range(200)} == {r.url for r in idle}  # ties spread
    turns = Picker(ROUND_ROBIN, RoutingSettings())
    assert [turns.pick(replicas, b"k")[0] for _ in range(6)] == replicas * 2
    assert Picker(AFFINITY, RoutingSettings()).pick(replicas, None) == (replicas[1], LEAST_LOADED)


def test_every_turn_of_a_conversation_has_the_leading_messages_of_its_first() -> None:
    first_chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]}
    later_chat = {
        "messages": [*first_chat["messages"], {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    }
    assert leading_messages(first_chat, 2048) == leading_messages(later_chat, 2048)
    first_responses = {"instructions": "be brief", "input": "q1"}
    continued = {
        "instructions": "be brief",
        "input": [
            {"type": "message", "role": "user", "content": "q1"},
            {"type": "message", "role": "assistant", "content": "a"},
        ],
    }
    assert leading_messages(first_responses, 2048) == leading_messages(continued, 2048)
    assert leading_messages({"input": "q9"}, 2048) != leading_messages(first_responses, 2048)
    long_prompt = {"prompt": "x" * 5000 + "unique tail"}
    assert leading_messages(long_prompt, 100) == leading_messages({"prompt": "x" * 5000 + "another"}, 100)
    # A system prompt past the limit, shared by many conversations, leaves each its own first turn.
    shared = {"role": "system", "content": "You are the help desk. " * 400}
    one, other = (
        {"messages": [shared, {"role": "user", "content": question}]} for question in ("my order?", "my refund?")
    )
    assert leading_messages(one, 2048) != leading_messages(other, 2048)
    answered = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    one_later = {"messages": [*one["messages"], *answered]}
    assert leading_messages(one, 2048) == leading_messages(one_later, 2048)


def test_a_replicas_load_is_this_gateways_requests_or_its_engines_own_queue_and_its_kv_cache_breaks_ties() -> None:
    settings = Settings(engine_url="http://10.0.0.1:8000")
    metrics = GatewayMetrics()
    store = redis_asyncio.Redis()  # never called: nothing here reaches Redis
    first, second = (
        Replica(url, settings, metrics, store, SharedEngineState(), state_dir=None)
        for url in ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    )
    picker = Picker(LEAST_LOADED, settings.routing)
    slot = first.activity.shared.claim_slot()
    assert slot is not None
    first.activity.shared.set_in_flight(slot, 3)  # three exchanges of this gateway's workers
    assert picker.pick([first, second], None)[0] is second
    # Other gateways' requests, seen only in the second engine's own gauges (running + waiting): it is the busier.
    second.activity.shared.publish_engine_load(5.0, 0.0)
    assert (first.load(), second.load()) == (3.0, 5.0)
    assert picker.pick([first, second], None)[0] is first
    # As many requests on each: the emptier KV cache is the lighter.
    first.activity.shared.publish_engine_load(5.0, 0.9)
    second.activity.shared.publish_engine_load(5.0, 0.2)
    assert picker.pick([first, second], None)[0] is second


def test_a_request_counts_on_its_replica_from_its_pick_so_a_burst_arriving_together_spreads() -> None:
    settings = Settings(engine_url="http://10.0.0.1:8000")
    metrics = GatewayMetrics()
    store = redis_asyncio.Redis()  # never called: nothing here reaches Redis
    replicas = [
        Replica(f"http://10.0.0.{n}:8000", settings, metrics, store, SharedEngineState(), state_dir=None)
        for n in (1, 2)
    ]
    picker = Picker(AFFINITY, settings.routing)
    # Twelve turns of one conversation arrive together: none has opened its exchange with the engine yet.
    picks = []
    for _ in range(12):
        replica, how = picker.pick(replicas, b"key\0one conversation")
        picks.append((replica, how, replica.activity.picked()))
    home = picks[0][0]
    other = next(replica for replica in replicas if replica is not home)
    assert sum(1 for replica, _, _ in picks if replica is other) > 0, "past the bound, the burst spills"
    assert {how for replica, how, _ in picks if replica is other} == {SPILL}
    assert home.load() + other.load() == 12
    # A pick that opens its exchange is counted once, as in flight; one refused before the engine, no more.
    _, _, picked = picks[0]

    class _Exchange:
        def abort_frozen(self) -> None:
            raise AssertionError("not called here")

    exchange = _Exchange()
    home.activity.begin(exchange, picked)
    assert home.load() + other.load() == 12
    assert home.activity.shared.in_flight() == 1, "the monitor counts exchanges only"
    assert home.activity.shared.in_flight(picked=True) == home.activity.shared.outstanding() == home.load()
    for _, _, pick in picks[1:]:
        pick.release()
        pick.release()  # twice is once
    home.activity.end(exchange)
    assert home.load() + other.load() == 0
