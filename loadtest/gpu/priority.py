"""The priority step on the GPU: an interactive key's TTFT under a batch key's saturating load, and overload.

Every load is `vllm bench serve` (loadtest/gpu/bench.py); two keys are two client processes at once, each with
its key as OPENAI_API_KEY. Phases, in order, each written to priority.json / priority.md as it ends:

1. `alone`: the interactive load (short prompts, short answers, open loop at a fixed rate) through the gateway,
   nothing else running.
2. `gateway-loaded`: the batch load (long generations, open loop at about three times what the engine finishes)
   through the gateway with the batch key; once vLLM is saturated, the interactive load with its key. The
   gateway gives each request its key's priority, which the engine (`--scheduling-policy priority`) honours, and
   keeps NEMOTRON_ADMISSION__RESERVED_SEQS sequence slots for priority 0 (the batch beyond them is refused).
   `gateway-loaded-rN`: the same through another gateway on the same engine that keeps N slots
   (`--reserve-gateway N=URL`): the urgent key's TTFT against what the batch keeps, per reserve.
3. `direct-loaded`: the same two loads straight to vLLM, no priority fields: every request priority 0, which
   vLLM's priority scheduler orders by arrival and preempts latest-first, i.e. FCFS, on the same engine (the
   only difference from phase 2 is what the gateway adds).
4. `capacity`: a closed-loop direct point at the engine's batch size: the requests/s it completes.
5. `overload-gateway` / `overload-direct`: an open-loop load at OVERLOAD x that rate through a gateway whose
   admission bound (NEMOTRON_ADMISSION__MAX_WAITING) is set, then straight to vLLM; goodput = requests whose
   TTFT met the stated target, per second. While the gateway sheds, a probe sends its own requests and records
   every refusal's status, latency, Retry-After and error envelope.

vLLM's queue (`vllm:num_requests_running` / `_waiting` from its /metrics) is sampled during each loaded phase,
so the record shows the engine was saturated. Imports nothing from `gateway`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loadtest.gpu import bench

# Interactive TTFT p99 under the batch load through the gateway: at most this multiple of its unloaded value.
GOAL_LOADED_TTFT_P99_FACTOR = 2.0


_RUNNING, _WAITING, _GENERATED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:generation_tokens_total",
)


def engine_gauges(direct: str) -> dict[str, float] | None:
    """vLLM's running and waiting requests and its output tokens so far, from its /metrics, each summed over its
    label sets; None when unreadable."""
    return bench.metric_sums(direct, (_RUNNING, _WAITING, _GENERATED))


def engine_queue(direct: str) -> tuple[float, float]:
    """(running, waiting) requests from vLLM's /metrics, summed over its label sets; (-1, -1) when unreadable."""
    gauges = engine_gauges(direct)
    return (-1.0, -1.0) if gauges is None else (gauges[_RUNNING], gauges[_WAITING])


class QueueSampler:
    """vLLM's running/waiting counts every 0.5 s on a thread, between start() and stop(), and its output tokens
    per second over that time (what the batch kept while the interactive load was measured)."""

    def __init__(self, direct: str) -> None:
        self.direct, self._stop = direct, threading.Event()
        self.samples: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._first: tuple[float, float] | None = None  # (monotonic time, output tokens so far) at start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append(engine_queue(self.direct))

    def _generated(self) -> tuple[float, float] | None:
        gauges = engine_gauges(self.direct)
        return None if gauges is None else (time.monotonic(), gauges[_GENERATED])

    def start(self) -> QueueSampler:
        self._first = self._generated()
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        last = self._generated()
        running = [r for r, _ in self.samples if r >= 0]
        waiting = [w for _, w in self.samples if w >= 0]
        tokens_per_s = -1.0
        if self._first is not None and last is not None and last[0] > self._first[0]:
            tokens_per_s = (last[1] - self._first[1]) / (last[0] - self._first[0])
        return {
            "running_median": statistics.median(running) if running else -1,
            "waiting_median": statistics.median(waiting) if waiting else -1,
            "waiting_max": max(waiting, default=-1),
            "output_tokens_per_s": round(tokens_per_s, 1),
        }


def wait_for(direct: str, condition: str, timeout_s: float, slots: int = 0) -> float | None:
    """Seconds until vLLM is `saturated` (requests waiting, or at least 80 % of its `slots` running: a gateway that
    keeps slots free for the urgent tier never lets the batch queue) or `idle` (nothing at all); None at the
    timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        running, waiting = engine_queue(direct)
        saturated = waiting > 0 or (slots > 0 and running >= 0.8 * slots)
        if (condition == "saturated" and saturated) or (condition == "idle" and running == 0 and waiting == 0):
            return round(time.monotonic() - started, 2)
        time.sleep(0.5)
    return None


def probe_once(gateway: str, api_key: str, model: str) -> dict[str, Any]:
    """One streamed request; for a refusal its status, latency, Retry-After and whether the body is the envelope."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 8, "stream": True}
    ).encode()
    request = urllib.request.Request(f"{gateway}/v1/chat/completions", data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {api_key}")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return {"status": answer.status, "ms": round((time.monotonic() - started) * 1000, 2)}
    except urllib.error.HTTPError as refused:
        with refused:
            text = refused.read()
        ms = round((time.monotonic() - started) * 1000, 2)
        retry_after = refused.headers.get("Retry-After")
        try:
            error = json.loads(text)["error"]
            envelope = isinstance(error["message"], str) and isinstance(error["type"], str) and "code" in error
        except (ValueError, KeyError, TypeError):
            envelope = False
        well_formed = refused.code in (429, 503) and envelope and bool(retry_after and retry_after.isdigit())
        return {"status": refused.code, "ms": ms, "retry_after": retry_after, "well_formed": well_formed}
    except OSError as failed:
        return {"status": 0, "ms": round((time.monotonic() - started) * 1000, 2), "error": str(failed)[:120]}


class ShedProbe:
    """Probe requests at a fixed rate on threads while the gateway is overloaded (see probe_once)."""

    def __init__(self, gateway: str, api_key: str, model: str, rate: float) -> None:
        self.args, self.interval = (gateway, api_key, model), 1.0 / rate
        self._stop, self._pool = threading.Event(), ThreadPoolExecutor(max_workers=16)
        self._futures: list[Any] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._futures.append(self._pool.submit(probe_once, *self.args))

    def start(self) -> ShedProbe:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        answers = [future.result() for future in self._futures]
        self._pool.shutdown()
        shed = [a for a in answers if a["status"] in (429, 503)]
        shed_ms = sorted(a["ms"] for a in shed)
        return {
            "probes": len(answers),
            "statuses": dict(Counter(str(a["status"]) for a in answers)),
            "shed": len(shed),
            "shed_well_formed": sum(1 for a in shed if a["well_formed"]),
            "shed_all_well_formed": bool(shed) and all(a["well_formed"] for a in shed),
            "shed_ms_p50": statistics.median(shed_ms) if shed_ms else None,
            "shed_ms_p99": shed_ms[min(len(shed_ms) - 1, int(len(shed_ms) * 0.99))] if shed_ms else None,
            "shed_ms_max": shed_ms[-1] if shed_ms else None,
            "other_refusals": [a for a in answers if a["status"] not in (200, 429, 503)][:5],
        }


class Step:
    """The phases' shared state: arguments, results so far, the time box."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.phases: dict[str, dict[str, Any]] = {}
        self.notes: list[str] = []
        self.started, self.seed = time.monotonic(), args.seed

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.started) if self.args.deadline else 1e9

    def load(self, base_url: str, shape: str, **overrides: Any) -> bench.Load:
        self.seed += 1
        a = self.args
        if shape == "interactive":
            overrides = {"rate": a.interactive_rate, **overrides}
        if shape == "batch" and a.batch_rate > 0:
            # Open loop: a refused request does not come straight back (a closed loop would turn every 429 into
            # the next request at once), and the offered load is the same through the gateway and directly.
            overrides = {"rate": a.batch_rate, "concurrency": None, **overrides}
        lengths = {
            "interactive": (
                a.interactive_concurrency or None,
                int(a.interactive_rate * a.interactive_seconds),
                a.interactive_in,
                a.interactive_out,
            ),
            "batch": (
                a.batch_concurrency,
                int(a.batch_rate * a.batch_seconds) if a.batch_rate > 0 else a.batch_prompts,
                a.batch_in,
                a.batch_out,
            ),
            "overload": (a.capacity_concurrency, 3 * a.capacity_concurrency, a.overload_in, a.overload_out),
        }[shape]
        concurrency, prompts, input_len, output_len = lengths
        fields: dict[str, Any] = {
            "base_url": base_url, "tokenizer": a.tokenizer, "concurrency": concurrency, "prompts": prompts,
            "input_len": input_len, "output_len": output_len, "seed": self.seed,
        }  # fmt: skip
        return bench.Load(**{**fields, **overrides})

    def record(self, name: str, result: dict[str, Any]) -> None:
        self.phases[name] = result
        write(self.args.out, self.phases, self.notes)
        sys.stdout.write(f"{name}: {json.dumps(_brief(result))}\n")
        sys.stdout.flush()

    def drain(self) -> None:
        if wait_for(self.args.direct, "idle", min(90.0, max(self.left(), 1.0))) is None:
            self.notes.append("the engine had not drained within 90 s after a phase")


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("completed", "failed", "ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s", "request_goodput", "errors")
    inner = result.get("interactive", result)
    return {k: inner.get(k) for k in keep if k in inner}


def alone(step: Step) -> dict[str, Any]:
    a = step.args
    client = bench.start(step.load(a.gateway, "interactive"), a.work, "alone-interactive", a.interactive_key)
    return {"interactive": bench.finish([client], min(a.phase_timeout, step.left()))[0]}


def loaded(step: Step, name: str) -> dict[str, Any]:
    """The batch load, then (once vLLM queues) the interactive one; the batch is ended when it is measured. `name`
    is `direct-loaded` (straight to vLLM, no keys), `gateway-loaded` (--gateway) or `gateway-loaded-rN` (the
    gateway given as --reserve-gateway N=URL)."""
    a = step.args
    url = a.direct if name == "direct-loaded" else loaded_gateways(a)[name]
    keys = (None, None) if name == "direct-loaded" else (a.batch_key, a.interactive_key)
    batch = bench.start(step.load(url, "batch"), a.work, f"{name}-batch", keys[0])
    # A gateway keeping N slots lets the batch hold only the rest: saturated is 80 % of that running.
    reserve = int(name.rpartition("-r")[2]) if name.startswith("gateway-loaded-r") else 0
    saturated_after = wait_for(a.direct, "saturated", 60.0, a.capacity_concurrency - reserve)
    sampler = QueueSampler(a.direct).start()
    interactive = bench.start(step.load(url, "interactive"), a.work, f"{name}-interactive", keys[1])
    [measured] = bench.finish([interactive], min(a.phase_timeout, step.left()))
    queue = sampler.stop()
    batch_running_at_end = bench.running(batch)
    bench.stop(batch)
    [background] = bench.finish([batch], 30.0)
    step.drain()
    return {
        "interactive": measured,
        "batch": background,
        "batch_ran_throughout": batch_running_at_end,
        "saturated_after_s": saturated_after,
        "engine_queue": queue,
    }


def loaded_gateways(args: argparse.Namespace) -> dict[str, str]:
    """The loaded phases through a gateway, by name: `gateway-loaded` (--gateway), one `gateway-loaded-rN` per
    --reserve-gateway N=URL (a gateway keeping N sequence slots for priority 0)."""
    phases = {"gateway-loaded": args.gateway}
    for given in args.reserve_gateway:
        reserve, _, url = given.partition("=")
        phases[f"gateway-loaded-r{reserve}"] = url
    return phases


def loaded_phases(args: argparse.Namespace) -> list[str]:
    """Every loaded phase this run knows, in the order they run."""
    return [*loaded_gateways(args), "direct-loaded"]


def capacity(step: Step) -> dict[str, Any]:
    a = step.args
    client = bench.start(step.load(a.direct, "overload"), a.work, "capacity", None)
    [result] = bench.finish([client], min(a.phase_timeout, step.left()))
    duration = result.get("duration_s") or 0.0
    result["requests_per_s"] = (result.get("completed") or 0) / duration if duration else 0.0
    step.drain()
    return result


def overload(step: Step, target: str, rate: float) -> dict[str, Any]:
    a = step.args
    url = a.overload_gateway if target == "gateway" else a.direct
    prompts = max(int(rate * a.overload_seconds), 1)
    load = step.load(url, "overload", concurrency=None, prompts=prompts, rate=rate, goodput_ttft_ms=a.ttft_target_ms)
    client = bench.start(load, a.work, f"overload-{target}", a.overload_key if target == "gateway" else None)
    probe = ShedProbe(url, a.overload_key, "nemotron", a.probe_rate).start() if target == "gateway" else None
    [result] = bench.finish([client], min(a.phase_timeout, step.left()))
    if probe is not None:
        result["shed_probe"] = probe.stop()
    goodput, duration = result.get("request_goodput"), result.get("duration_s") or 0.0
    result["good_requests"] = round(goodput * duration) if goodput is not None else None
    result.update(rate=round(rate, 2), prompts=prompts, ttft_target_ms=a.ttft_target_ms)
    step.drain()
    return result


def _ms(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "-"


def markdown(phases: dict[str, dict[str, Any]], notes: list[str]) -> str:
    """The priority tables: interactive TTFT per phase against the goal, then overload goodput and the shed."""
    alone_p99 = (phases.get("alone", {}).get("interactive") or {}).get("ttft_p99_ms")
    lines = [
        f"| phase | interactive ok/failed | TTFT p50 / p99 ms | p99 / alone (goal ≤ {GOAL_LOADED_TTFT_P99_FACTOR:g}x "
        "through the gateway) | vLLM running / waiting (median, max waiting) | batch tok/s (ok / refused) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in [n for n in phases if n == "alone" or n.startswith(("gateway-loaded", "direct-loaded"))]:
        phase, inter = phases[name], phases[name]["interactive"]
        p99 = inter.get("ttft_p99_ms")
        ratio = f"{p99 / alone_p99:.2f}x" if isinstance(p99, int | float) and alone_p99 else "-"
        queue = phase.get("engine_queue")
        queued = (
            f"{queue['running_median']:g} / {queue['waiting_median']:g}, {queue['waiting_max']:g}" if queue else "-"
        )
        batch = phase.get("batch", {})
        tokens = batch.get("output_tokens_per_s")
        served = f"{_ms(tokens)} ({batch.get('completed')} ok / {batch.get('failed')} refused)" if tokens else "-"
        # The batch's own count is lost when it is stopped mid-run: the engine's output tokens/s while the
        # interactive load was measured, less the interactive load's own, is what the batch kept.
        engine_tokens = (queue or {}).get("output_tokens_per_s", -1)
        if not tokens and engine_tokens >= 0:
            served = f"{_ms(engine_tokens - (inter.get('output_tokens_per_s') or 0.0))} (engine, less interactive)"
        lines.append(
            f"| {name} | {inter.get('completed')}/{inter.get('failed')} | {_ms(inter.get('ttft_p50_ms'))} / "
            f"{_ms(p99)} | {ratio} | {queued} | {served} |"
        )
    lines += [
        "",
        "| overload | rate req/s | requests ok / failed | good (TTFT ≤ target) | goodput req/s | TTFT p50 / p99 ms |"
        " failures |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("overload-gateway", "overload-direct"):
        if name not in phases:
            continue
        o = phases[name]
        lines.append(
            f"| {name} | {o.get('rate')} | {o.get('completed')} / {o.get('failed')} | {o.get('good_requests')} | "
            f"{_ms(o.get('request_goodput'))} | {_ms(o.get('ttft_p50_ms'))} / {_ms(o.get('ttft_p99_ms'))} | "
            f"{json.dumps(o.get('errors'))} |"
        )
    probe = phases.get("overload-gateway", {}).get("shed_probe")
    if probe:
        lines += [
            "",
            f"Shed answers (probe): {probe['shed']} of {probe['probes']} probes refused ({probe['statuses']}), "
            f"{probe['shed_well_formed']} well-formed (429/503, error envelope, Retry-After); latency p50 "
            f"{_ms(probe['shed_ms_p50'])} ms, p99 {_ms(probe['shed_ms_p99'])} ms, max {_ms(probe['shed_ms_max'])} ms.",
        ]
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def write(out: Path, phases: dict[str, dict[str, Any]], notes: list[str]) -> None:
    """priority.json and priority.md from the phases so far."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "priority.json").write_text(json.dumps({"phases": phases, "notes": notes}, indent=1))
    (out / "priority.md").write_text(markdown(phases, notes))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `python -m loadtest.gpu.priority --gateway URL --direct URL --tokenizer DIR --*-key K ...`."""
    parser = argparse.ArgumentParser(prog="loadtest.gpu.priority", description=__doc__)
    add = parser.add_argument
    add("--gateway", default="http://127.0.0.1:8000", help="the gateway (no admission bound)")
    add("--overload-gateway", default="http://127.0.0.1:8002", help="a gateway with the admission bound set")
    add("--direct", default="http://127.0.0.1:8001", help="vLLM itself")
    add("--tokenizer", required=True)
    add("--interactive-key", required=True)
    add("--batch-key", required=True)
    add("--overload-key", required=True)
    # Open loop: every interactive request arrives on time whatever the engine does, so a phase lasts its arrival
    # window plus the queue's wait (a closed loop of 16 behind vLLM's FCFS queue of 1024-token answers would take
    # many minutes for a few hundred requests). --interactive-concurrency caps the requests in flight (0: none).
    add("--interactive-rate", type=float, default=4.0, help="interactive requests per second")
    add("--interactive-seconds", type=float, default=20.0, help="how long the interactive arrivals last")
    add("--interactive-concurrency", type=int, default=0)
    add("--interactive-in", type=int, default=64)
    add("--interactive-out", type=int, default=32)
    add("--batch-concurrency", type=int, default=512)
    add("--batch-prompts", type=int, default=2048, help="the closed loop's requests (without --batch-rate)")
    # ~2x what 256 slots finish of 1,024-token answers (~10 s each on the H200 at full batch: ~25 req/s); at 3x
    # vLLM's FCFS queue grew past 3,500 and the direct interactive load did not finish within its phase.
    add("--batch-rate", type=float, default=50.0, help="batch requests per second, open loop (0: closed loop)")
    add("--batch-seconds", type=float, default=45.0, help="how long the open-loop batch arrivals last")
    add("--batch-in", type=int, default=256)
    add("--batch-out", type=int, default=1024)
    add("--capacity-concurrency", type=int, default=256, help="the engine's batch (max-num-seqs)")
    add("--overload-in", type=int, default=200)
    add("--overload-out", type=int, default=128)
    add("--overload", type=float, default=3.0, help="offered load as a multiple of the measured capacity")
    add("--overload-seconds", type=float, default=15.0, help="how long the open-loop arrivals last")
    add("--ttft-target-ms", type=float, default=1000.0, help="the TTFT a request must meet to count as goodput")
    add("--probe-rate", type=float, default=5.0, help="shed probes per second during the gateway overload")
    add("--phases", default="alone,gateway-loaded,direct-loaded,overload")
    add(
        "--reserve-gateway",
        action="append",
        default=[],
        metavar="N=URL",
        help="a gateway keeping N sequence slots for priority 0: adds the phase gateway-loaded-rN (repeatable)",
    )
    add("--phase-timeout", type=float, default=150.0)
    add("--deadline", type=float, default=0.0, help="seconds for the whole step (0: none)")
    add("--seed", type=int, default=5000)
    add("--out", type=Path, required=True)
    add("--work", type=Path, default=Path("/tmp/gpu-priority"))
    args = parser.parse_args(argv)
    step = Step(args)
    # A gateway given with --reserve-gateway is measured whatever --phases says: that is what it was started for.
    wanted = [*args.phases.split(","), *(name for name in loaded_gateways(args) if name != "gateway-loaded")]
    for name in ["alone", *loaded_phases(args)]:
        if name not in wanted:
            continue
        if step.left() < 30:
            step.notes.append(f"time box: {name} and later phases not run")
            write(args.out, step.phases, step.notes)
            return 0
        step.record(name, alone(step) if name == "alone" else loaded(step, name))
    if "overload" in wanted:
        if step.left() < 60:
            step.notes.append("time box: the overload phases not run")
        else:
            measured = capacity(step)
            step.record("capacity", measured)
            rate = args.overload * measured["requests_per_s"]
            for target in ("gateway", "direct"):
                if rate <= 0 or step.left() < 30:
                    step.notes.append(f"overload-{target} not run (capacity {measured['requests_per_s']:.2f} req/s)")
                    continue
                step.record(f"overload-{target}", overload(step, target, rate))
    write(args.out, step.phases, step.notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
