"""Priority tiers: the client's clamped priority, the tier rule, Retry-After from the drain, the engine's gauges
and its launched policy, and the body sent to the engine."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.api.validation import effective_priority, prepare_chat
from gateway.engine.supervisor_state import EngineStatus, launched_policy, launched_sequence_slots, sequence_slots
from gateway.errors import InvalidRequestError
from gateway.ratelimit.admission import parse_load, retry_after, tier_bounds
from gateway.relay.served_model import ModelInfo
from gateway.settings import AdmissionSettings, Settings

pytestmark = pytest.mark.timeout(5)


def test_a_client_may_ask_for_less_urgency_never_more() -> None:
    assert effective_priority(None, 3, None) == 3  # the server default
    assert effective_priority(5, 0, None) == 5  # the key's own
    assert effective_priority(5, 0, 0) == 5  # more urgent than the key: clamped
    assert effective_priority(5, 0, -10) == 5
    assert effective_priority(5, 0, 9) == 9  # less urgent: taken


def _prepare(body: dict[str, object]) -> bytes:
    settings = Settings(inject_system_message=False)
    info = ModelInfo(name="nemotron", context_length=4096)
    prepared = prepare_chat(orjson.dumps(body), settings, info)
    return prepared.engine_body(effective_priority(2, 0, prepared.requested_priority))


def test_the_engine_gets_one_priority_field_and_a_wrong_type_is_a_400_naming_it() -> None:
    body = {"model": "nemotron", "messages": [{"role": "user", "content": "hi"}]}
    assert orjson.loads(_prepare(body))["priority"] == 2
    sent = orjson.loads(_prepare({**body, "priority": 7}))
    assert sent["priority"] == 7 and sent["messages"] == body["messages"]
    for wrong in ("high", 1.5, True, [1], 2**63):
        with pytest.raises(InvalidRequestError) as caught:
            _prepare({**body, "priority": wrong})
        assert caught.value.param == "priority"


def test_tiers_get_shares_of_the_bounds_the_most_urgent_all_of_them() -> None:
    settings = AdmissionSettings(max_waiting=64, max_kv_cache_use=0.9, shares=(1.0, 0.5, 0.25))
    assert (tier_bounds(0, settings).waiting, tier_bounds(0, settings).kv_cache_use) == (64, 0.9)
    assert (tier_bounds(1, settings).tier, tier_bounds(1, settings).waiting) == (1, 32)
    assert (tier_bounds(9, settings).tier, tier_bounds(9, settings).waiting) == (2, 16)  # the last share
    assert tier_bounds(2, settings).kv_cache_use == pytest.approx(0.225)
    # Every tier is served while the queue is short: a tier's waiting bound is at least 1.
    assert tier_bounds(5, AdmissionSettings(max_waiting=2, shares=(1.0, 0.1))).waiting == 1
    assert tier_bounds(0, AdmissionSettings()).waiting is None
    with pytest.raises(ValueError, match="share"):
        AdmissionSettings(shares=(1.0, 0.0))


def test_reserved_slots_bound_what_lower_tiers_may_hold_never_the_most_urgent() -> None:
    settings = AdmissionSettings(reserved_seqs=32)
    assert settings.enabled
    assert tier_bounds(0, settings, 256).held is None  # priority 0 may take every slot
    assert tier_bounds(1, settings, 256).held == 224
    assert tier_bounds(7, settings, 256).held == 224
    assert tier_bounds(1, settings, None).held is None  # the engine's slots unknown: nothing reserved
    assert tier_bounds(1, AdmissionSettings(reserved_seqs=300), 256).held == 1  # every tier keeps one place
    assert tier_bounds(1, AdmissionSettings(max_waiting=8), 256).held is None  # no reserve set


def test_the_sequence_slots_are_the_launched_argvs(tmp_path: Path) -> None:
    assert sequence_slots(["--model", "m", "--max-num-seqs", "256"]) == 256
    assert sequence_slots(["--max-num-seqs=64", "--data-parallel-size", "2"]) == 128  # per data-parallel rank
    assert sequence_slots(["--max-num-seqs", "8", "--max-num-seqs", "16"]) == 16  # the last wins, as in argparse
    assert sequence_slots(["--model", "m"]) is None  # vLLM's default depends on the GPU
    path = tmp_path / "engine.json"
    assert launched_sequence_slots(path) is None
    EngineStatus(sequence_slots=96).write(path)
    assert launched_sequence_slots(path) == 96


def test_retry_after_follows_the_drain_rate_within_bounds() -> None:
    settings = AdmissionSettings(max_waiting=10, max_retry_after=30)
    assert retry_after(waiting=20, bound=10, drain=2.0, settings=settings) == pytest.approx(5.5)
    assert retry_after(waiting=10, bound=10, drain=100.0, settings=settings) == 1.0
    assert retry_after(waiting=500, bound=10, drain=1.0, settings=settings) == 30
    assert retry_after(waiting=11, bound=10, drain=0.0, settings=settings) == 30  # nothing seen draining


def test_the_engine_load_is_read_from_vllms_gauges() -> None:
    text = (
        "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 10.0\n'
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5.0\n'
    )
    load = parse_load(text)
    assert load is not None
    assert (load.waiting, load.running, load.kv_cache_use, load.finished) == (5.0, 7.0, 0.75, 15.0)
    assert parse_load("up 1\n") is None


def test_the_policy_is_the_launched_engines_and_fcfs_when_unknown(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    assert launched_policy(path) == "fcfs"
    EngineStatus(scheduling_policy="priority").write(path)
    assert launched_policy(path) == "priority"
