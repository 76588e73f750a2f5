"""A gateway in front of a pool of engines (the test engine): models, routing, failover, drains, the watched file.

Two replicas of one model and one of a second, each a real server on its own port; the gateway is a real
`nemotron-gateway serve` with its replicas in `NEMOTRON_REPLICAS` or its watched file, and a real Redis.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.pool.drain import DRAINED_KEY
from tests.integration.test_keys_limits import BASE_ENV, create_keys, keys_cli
from tests.procs import FakeEngineControl, ServerProcess, run_fake_engine, run_gateway, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("pool")]

MODEL_A = "nemo-a"
MODEL_B = "nemo-b"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, FakeEngineControl]]:
    started = {
        "a1": run_fake_engine(model=MODEL_A),
        "a2": run_fake_engine(model=MODEL_A),
        "b": run_fake_engine(model=MODEL_B),
    }
    try:
        yield {name: FakeEngineControl(process) for name, process in started.items()}
    finally:
        for process in started.values():
            process.stop()


def _gateway(engines: dict[str, FakeEngineControl], redis_url: str, **env: str) -> ServerProcess:
    return run_gateway(
        engines["a1"].base_url,
        redis_url,
        env={
            **BASE_ENV,
            "NEMOTRON_REPLICAS": json.dumps([engines["a2"].base_url, engines["b"].base_url]),
            "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2",
            "NEMOTRON_ROUTING__FILE_POLL_INTERVAL": "0.2",
            **env,
        },
    )


def _file_gateway(engine_url: str, redis_url: str, listed: Path) -> ServerProcess:
    """A gateway without keys in front of `engine_url` and the replicas of the watched file `listed`."""
    return run_gateway(
        engine_url,
        redis_url,
        env={
            "NEMOTRON_REPLICAS_FILE": str(listed),
            "NEMOTRON_AUTH__ENABLED": "false",
            "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2",
            "NEMOTRON_ROUTING__FILE_POLL_INTERVAL": "0.2",
        },
    )


def _chat(model: str, system: str, turns: list[str], **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for number, turn in enumerate(turns):
        if number:
            messages.append({"role": "assistant", "content": f"answer {number}"})
        messages.append({"role": "user", "content": turn})
    return {"model": model, "messages": messages, "max_tokens": 2, **extra}


def _served_by(engines: dict[str, FakeEngineControl], request_id: str) -> list[str]:
    """The engines that saw the request (its engine id is the client's plus a suffix)."""
    return [
        name
        for name, engine in engines.items()
        if any((r["request_id"] or "").startswith(request_id + "-") for r in engine.requests())
    ]


def _url(process: ServerProcess) -> str:
    return f"http://127.0.0.1:{process.port}"


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_every_model_is_listed_and_served_by_its_replicas_and_a_key_limited_to_one_is_refused_the_other(
    engines: dict[str, FakeEngineControl], redis_clean: str
) -> None:
    secrets = create_keys(redis_clean, {"pool-all": [], "pool-a": ["--models", MODEL_A]})
    gateway = _gateway(engines, redis_clean)
    try:
        with httpx.Client(base_url=_url(gateway), timeout=10) as client:
            ready = client.get("/ready").json()
            assert ready["status"] == "ready" and ready["models"] == [MODEL_A, MODEL_B]
            assert {(r["url"], r["model"], r["ready"]) for r in ready["replicas"]} == {
                (engines["a1"].base_url, MODEL_A, True),
                (engines["a2"].base_url, MODEL_A, True),
                (engines["b"].base_url, MODEL_B, True),
            }
            every = client.get("/v1/models", headers=_auth(secrets["pool-all"])).json()
            assert "data" in every, every
            assert [entry["id"] for entry in every["data"]] == [MODEL_A, MODEL_B]
            one = client.get(f"/v1/models/{MODEL_B}", headers=_auth(secrets["pool-all"]))
            assert one.status_code == 200 and one.json()["id"] == MODEL_B
            unknown = client.get("/v1/models/nemo-c", headers=_auth(secrets["pool-all"]))
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            limited = client.get("/v1/models", headers=_auth(secrets["pool-a"])).json()
            assert [entry["id"] for entry in limited["data"]] == [MODEL_A]
            hidden = client.get(f"/v1/models/{MODEL_B}", headers=_auth(secrets["pool-a"]))
            assert hidden.status_code == 404

            served = client.post(
                "/v1/chat/completions",
                json=_chat(MODEL_B, "s", ["q"]),
                headers={**_auth(secrets["pool-all"]), "X-Request-Id": "to-b"},
            )
            assert served.status_code == 200 and _served_by(engines, "to-b") == ["b"]
            refused = client.post(
                "/v1/chat/completions", json=_chat(MODEL_B, "s", ["q"]), headers=_auth(secrets["pool-a"])
            )
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
            # Every relayed route refuses it, each in its own envelope.
            anthropic = {"x-api-key": secrets["pool-a"], "anthropic-version": "2023-06-01"}
            message = {"model": MODEL_B, "max_tokens": 2, "messages": [{"role": "user", "content": "q"}]}
            by_messages = client.post("/v1/messages", json=message, headers=anthropic)
            assert by_messages.status_code == 403, by_messages.text
            assert by_messages.json()["type"] == "error"
            assert by_messages.json()["error"]["type"] == "permission_error"
            for path, body in (
                ("/v1/responses", {"model": MODEL_B, "input": "q", "max_output_tokens": 16}),
                ("/v1/completions", {"model": MODEL_B, "prompt": "q", "max_tokens": 2}),
            ):
                other = client.post(path, json=body, headers=_auth(secrets["pool-a"]))
                assert other.status_code == 403 and other.json()["error"]["code"] == "model_not_allowed", other.text
            unknown_message = client.post("/v1/messages", json={**message, "model": "nemo-c"}, headers=anthropic)
            assert unknown_message.status_code == 404 and unknown_message.json()["type"] == "error"
            wrong = client.post(
                "/v1/chat/completions", json=_chat("nemo-c", "s", ["q"]), headers=_auth(secrets["pool-all"])
            )
            assert wrong.status_code == 404 and "'nemo-a', 'nemo-b'" in wrong.json()["error"]["message"]
            served_a = client.post(
                "/v1/chat/completions", json=_chat(MODEL_A, "s", ["q"]), headers=_auth(secrets["pool-all"])
            )
            assert served_a.status_code == 200
        # A key's usage names each model that served it: one row per model, its limits still one key's.
        (usage,) = keys_cli(redis_clean, ["usage", "pool-all", "--json"])
        rows = json.loads(usage.stdout)
        assert sorted((row["api"], row["model"], row["requests"]) for row in rows) == [
            ("chat", MODEL_A, 1),
            ("chat", MODEL_B, 1),
        ]
    finally:
        gateway.stop()


def test_a_conversations_turns_stay_on_one_replica_and_a_burst_of_conversations_spreads(
    engines: dict[str, FakeEngineControl], redis_clean: str
) -> None:
    gateway = _gateway(engines, redis_clean, NEMOTRON_AUTH__ENABLED="false")
    try:
        with httpx.Client(base_url=_url(gateway), timeout=10) as client:
            for conversation in range(6):
                turns = [f"first question of conversation {conversation}"]
                homes = set()
                for turn in range(3):
                    request_id = f"conv-{conversation}-{turn}"
                    answer = client.post(
                        "/v1/chat/completions",
                        json=_chat(MODEL_A, "You are terse.", turns),
                        headers={"X-Request-Id": request_id},
                    )
                    assert answer.status_code == 200
                    homes.update(_served_by(engines, request_id))
                    turns.append(f"follow-up {turn}")
                assert len(homes) == 1 and homes <= {"a1", "a2"}, (conversation, homes)
            session = set()
            for turn in range(3):
                request_id = f"session-{turn}"
                client.post(
                    "/v1/chat/completions",
                    json=_chat(MODEL_A, f"a different start {turn}", ["q"]),
                    headers={"X-Request-Id": request_id, "X-Session-Id": "the-session"},
                )
                session.update(_served_by(engines, request_id))
            assert len(session) == 1

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=_url(gateway), timeout=20) as client:
                answers = await asyncio.gather(
                    *(
                        client.post(
                            "/v1/chat/completions",
                            json=_chat(MODEL_A, f"burst {n}", ["q"], fake_token_delay=0.05),
                            headers={"X-Request-Id": f"burst-{n}"},
                        )
                        for n in range(40)
                    )
                )
            return [answer.status_code for answer in answers]

        assert asyncio.run(burst()) == [200] * 40
        counts = {name: sum(1 for n in range(40) if name in _served_by(engines, f"burst-{n}")) for name in engines}
        assert counts["b"] == 0 and counts["a1"] >= 5 and counts["a2"] >= 5, counts
    finally:
        gateway.stop()


def test_a_drained_replica_gets_nothing_new_and_is_put_back(
    engines: dict[str, FakeEngineControl], redis_clean: str
) -> None:
    gateway = _gateway(engines, redis_clean, NEMOTRON_AUTH__ENABLED="false", NEMOTRON_ROUTING__PICKER="round_robin")
    store = redis.Redis.from_url(redis_clean)
    try:
        with httpx.Client(base_url=_url(gateway), timeout=10) as client:
            store.hset(DRAINED_KEY, engines["a2"].base_url, "1")
            wait_until(lambda: any(r["drained"] for r in client.get("/ready").json()["replicas"]), message="drain seen")
            assert client.get("/ready").status_code == 200  # its model still has a ready replica
            for n in range(6):
                client.post(
                    "/v1/chat/completions", json=_chat(MODEL_A, "s", [f"q{n}"]), headers={"X-Request-Id": f"dr-{n}"}
                )
            assert [_served_by(engines, f"dr-{n}") for n in range(6)] == [["a1"]] * 6
            store.hdel(DRAINED_KEY, engines["a2"].base_url)
            wait_until(lambda: not any(r["drained"] for r in client.get("/ready").json()["replicas"]))
            for n in range(4):
                client.post(
                    "/v1/chat/completions", json=_chat(MODEL_A, "s", [f"p{n}"]), headers={"X-Request-Id": f"back-{n}"}
                )
            assert {name for n in range(4) for name in _served_by(engines, f"back-{n}")} == {"a1", "a2"}
    finally:
        store.hdel(DRAINED_KEY, engines["a2"].base_url)
        gateway.stop()


def test_a_replica_that_refuses_connections_is_failed_over_before_the_first_byte_and_a_queue_full_answer_too(
    redis_clean: str,
) -> None:
    first, second = run_fake_engine(model=MODEL_A), run_fake_engine(model=MODEL_A)
    controls = {"first": FakeEngineControl(first), "second": FakeEngineControl(second)}
    gateway = run_gateway(
        _url(first),
        redis_clean,
        env={
            "NEMOTRON_REPLICAS": json.dumps([_url(second)]),
            "NEMOTRON_AUTH__ENABLED": "false",
            "NEMOTRON_ROUTING__PICKER": "round_robin",
            # The monitor does not see the stop before the requests do: each one that is given the dead replica
            # must be tried on the other.
            "NEMOTRON_RELAY__PROBE_INTERVAL": "30",
        },
    )
    try:
        with httpx.Client(base_url=_url(gateway), timeout=10) as client:
            busy = client.post(
                "/v1/chat/completions",
                json=_chat(MODEL_A, "s", ["q"], fake_status=503),
                headers={"X-Request-Id": "queue-full"},
            )
            assert busy.status_code == 503 and set(busy.json()) == {"error"}
            assert sorted(_served_by(controls, "queue-full")) == ["first", "second"]  # tried once more, not again
            second.stop()
            answers = [
                client.post(
                    "/v1/chat/completions", json=_chat(MODEL_A, "s", [f"q{n}"]), headers={"X-Request-Id": f"fo-{n}"}
                )
                for n in range(4)
            ]
            assert [a.status_code for a in answers] == [200] * 4
            assert [_served_by({"first": controls["first"]}, f"fo-{n}") for n in range(4)] == [["first"]] * 4
            metrics = client.get("/metrics").text
            assert 'nemotron_gateway_routed_total{how="failover",model="nemo-a"}' in metrics
            assert (
                f'nemotron_gateway_engine_errors_total{{kind="refused",model="{MODEL_A}",replica="{_url(second)}"}}'
                in metrics
            )
    finally:
        gateway.stop()
        first.stop()
        second.stop()


def test_a_replica_written_into_the_watched_file_serves_within_seconds_and_leaves_when_taken_out(
    engines: dict[str, FakeEngineControl], redis_clean: str, tmp_path: Path
) -> None:
    listed = tmp_path / "replicas"
    listed.write_text("# replicas of this gateway\n")
    gateway = _file_gateway(engines["a1"].base_url, redis_clean, listed)
    try:
        with httpx.Client(base_url=_url(gateway), timeout=10) as client:
            assert client.get("/ready").json()["models"] == [MODEL_A]
            listed.write_text(f"# replicas of this gateway\n{engines['b'].base_url}  # the second model\nnot-a-url\n")
            wait_until(lambda: MODEL_B in client.get("/ready").json()["models"], timeout=10, message="joined")
            answer = client.post(
                "/v1/chat/completions", json=_chat(MODEL_B, "s", ["q"]), headers={"X-Request-Id": "file"}
            )
            assert answer.status_code == 200 and _served_by(engines, "file") == ["b"]
            listed.write_text("")
            wait_until(lambda: len(client.get("/ready").json()["replicas"]) == 1, timeout=10, message="left")
            gone = client.post("/v1/chat/completions", json=_chat(MODEL_B, "s", ["q"]))
            assert gone.status_code == 404
    finally:
        gateway.stop()


def test_many_replicas_spread_conversations_a_burst_of_one_spills_and_a_leaving_replica_moves_only_its_own(
    redis_clean: str, tmp_path: Path
) -> None:
    started = {f"r{n}": run_fake_engine(model=MODEL_A) for n in range(6)}
    controls = {name: FakeEngineControl(process) for name, process in started.items()}
    listed = tmp_path / "replicas"
    listed.write_text("".join(f"{control.base_url}\n" for control in controls.values()))
    gateway = _file_gateway(controls["r0"].base_url, redis_clean, listed)

    def homes_of(prefix: str) -> dict[str, str]:
        """Request id -> the replica that served it, for the ids that start with `prefix` (one read per engine)."""
        return {
            (record["request_id"] or "").rsplit("-", 1)[0]: name
            for name, control in controls.items()
            for record in control.requests()
            if (record["request_id"] or "").startswith(prefix)
        }

    try:
        with httpx.Client(base_url=_url(gateway), timeout=10) as client:
            wait_until(lambda: sum(r["ready"] for r in client.get("/ready").json()["replicas"]) == 6, timeout=10)
            # 120 conversations: rendezvous hashing gives each replica a share.
            for n in range(120):
                answer = client.post(
                    "/v1/chat/completions",
                    json=_chat(MODEL_A, f"conversation {n}", ["q"]),
                    headers={"X-Request-Id": f"spread-{n}"},
                )
                assert answer.status_code == 200
            served = homes_of("spread-")
            homes = {n: served[f"spread-{n}"] for n in range(120)}
            shares = {name: list(homes.values()).count(name) for name in controls}
            assert all(shares.values()), shares

            # One replica (not r0, the engine URL) leaves the file: its conversations move, every other stays where
            # its prefix is cached.
            leaving = max((name for name in shares if name != "r0"), key=lambda name: shares[name])
            listed.write_text("".join(f"{c.base_url}\n" for name, c in controls.items() if name != leaving))
            wait_until(lambda: len(client.get("/ready").json()["replicas"]) == 5, timeout=10, message="left")
            for n in range(120):
                client.post(
                    "/v1/chat/completions",
                    json=_chat(MODEL_A, f"conversation {n}", ["q", "again"]),
                    headers={"X-Request-Id": f"after-{n}"},
                )
            after = homes_of("after-")
            moved = {n for n in range(120) if after[f"after-{n}"] != homes[n]}
            assert moved == {n for n in range(120) if homes[n] == leaving}

        # A burst of one conversation, each request held for a while: its replica takes what the bound allows
        # (2 x the least loaded one's + 4), the rest spill to the least loaded of the others.
        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=_url(gateway), timeout=30) as client:
                answers = await asyncio.gather(
                    *(
                        client.post(
                            "/v1/chat/completions",
                            json=_chat(MODEL_A, "one conversation", ["q"], fake_token_delay=0.2),
                            headers={"X-Request-Id": f"spill-{n}"},
                        )
                        for n in range(30)
                    )
                )
            return [answer.status_code for answer in answers]

        assert asyncio.run(burst()) == [200] * 30
        spilled = list(homes_of("spill-").values())
        assert len(spilled) == 30
        counts = {name: spilled.count(name) for name in controls if name != leaving}
        preferred = max(counts, key=lambda name: counts[name])
        assert 5 <= counts[preferred] < 30 and sum(1 for c in counts.values() if c) >= 3, counts
        metrics = httpx.get(f"{_url(gateway)}/metrics").text
        assert 'nemotron_gateway_routed_total{how="spill",model="nemo-a"}' in metrics
    finally:
        gateway.stop()
        for process in started.values():
            process.stop()


def test_a_responses_conversation_stays_on_its_replica_through_stored_turns_and_background_runs(
    engines: dict[str, FakeEngineControl], redis_clean: str
) -> None:
    secret = create_keys(redis_clean, {"pool-responses": ["--rpm", "0"]})["pool-responses"]
    gateway = _gateway(engines, redis_clean)
    try:
        with httpx.Client(base_url=_url(gateway), timeout=10, headers=_auth(secret)) as client:

            def respond(request_id: str, session: str | None = None, **fields: Any) -> dict[str, Any]:
                headers = {"X-Request-Id": request_id, **({"X-Session-Id": session} if session else {})}
                answer = client.post(
                    "/v1/responses", json={"model": MODEL_A, "max_output_tokens": 2, **fields}, headers=headers
                )
                assert answer.status_code == 200, answer.text
                body: dict[str, Any] = answer.json()
                return body

            def settled(response_id: str) -> list[str]:
                # The replica whose engine ran a background response, once the response is done.
                wait_until(
                    lambda: client.get(f"/v1/responses/{response_id}").json()["status"] == "completed",
                    timeout=10,
                    interval=0.1,
                    message=f"{response_id} never completed",
                )
                return _served_by(engines, f"background-{response_id}")

            homes: dict[str, set[str]] = {}
            for n in range(6):
                # Turns continued from stored responses, the first in the foreground or in the background.
                first = respond(f"chain-{n}-0", input=f"question {n}")
                homes[f"chain-{n}"] = set(_served_by(engines, f"chain-{n}-0"))
                queued = respond(f"bg-{n}", input=f"background question {n}", background=True)
                homes[f"bg-{n}"] = set(settled(queued["id"]))
                previous = {f"chain-{n}": first["id"], f"bg-{n}": queued["id"]}
                for conversation, previous_id in previous.items():
                    for turn in (1, 2):
                        request_id = f"{conversation}-next-{turn}"
                        previous_id = respond(request_id, input=f"more {turn}", previous_response_id=previous_id)["id"]
                        homes[conversation].update(_served_by(engines, request_id))
                # A session header: its background run goes where its foreground turns go.
                session = f"pool-session-{n}"
                homes[session] = set(settled(respond(f"s-bg-{n}", session, input=f"s {n}", background=True)["id"]))
                for turn in (1, 2):
                    respond(f"{session}-{turn}", session, input=f"another start {n}-{turn}")
                    homes[session].update(_served_by(engines, f"{session}-{turn}"))
            assert all(len(home) == 1 and home <= {"a1", "a2"} for home in homes.values()), homes
            assert {name for home in homes.values() for name in home} == {"a1", "a2"}  # 18 spread over both
    finally:
        gateway.stop()


def test_a_remote_replica_declared_to_schedule_by_priority_gets_the_keys_priority_and_an_fcfs_one_none(
    redis_clean: str,
) -> None:
    local, remote = run_fake_engine(model=MODEL_A), run_fake_engine(model=MODEL_B, scheduling_policy="priority")
    controls = {"local": FakeEngineControl(local), "remote": FakeEngineControl(remote)}
    secrets = create_keys(redis_clean, {"pool-batch": ["--priority", "5"]})
    try:
        for policy, sent in (("priority", 5), ("fcfs", None)):
            gateway = run_gateway(
                _url(local),
                redis_clean,
                env={
                    **BASE_ENV,
                    "NEMOTRON_REPLICAS": json.dumps([_url(remote)]),
                    "NEMOTRON_ROUTING__REMOTE_SCHEDULING": policy,
                },
            )
            try:
                request_id = f"priority-{policy}"
                answer = httpx.post(
                    f"{_url(gateway)}/v1/chat/completions",
                    json=_chat(MODEL_B, "s", ["q"]),
                    headers={**_auth(secrets["pool-batch"]), "X-Request-Id": request_id},
                    timeout=10,
                )
                assert answer.status_code == 200, answer.text
                [record] = [
                    r for r in controls["remote"].requests() if (r["request_id"] or "").startswith(request_id + "-")
                ]
                assert record["body"].get("priority") == sent, record["body"]
            finally:
                gateway.stop()
    finally:
        local.stop()
        remote.stop()
