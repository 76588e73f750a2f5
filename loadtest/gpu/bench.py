"""vLLM's own benchmark client (`vllm bench serve`) as the GPU steps and `nemotron-loadtest` drive it: argv,
processes, their CPU, results.

`python -m loadtest.gpu.bench ARGS...` runs vLLM's `vllm bench serve` in this process with ARGS, unchanged, except
that a vLLM without the Responses backend (0.26.0, the GPU machine's) gets one registered first (`openai-responses`:
the same stream reading as vLLM 0.32's, POST /v1/responses, `response.output_text.delta` events timed as tokens,
usage from `response.completed`). The gateway's key travels as `OPENAI_API_KEY` in the child's environment (vLLM's
client reads it), never as `--header` (vLLM's client prints its arguments, headers included).

`start`/`finish` run one bench process each (several at once for two keys or a split load) and read each child's
own CPU seconds from `os.wait4` and its share of a core while the benchmark ran (from /proc), so a client-bound
point shows as a client near one full core. Imports no vLLM
at module level and nothing from `gateway`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.processes import cpu_seconds


@dataclass(frozen=True)
class Load:
    """One `vllm bench serve` run: where, what shape, how much."""

    base_url: str  # without /v1: vLLM's client appends the endpoint
    tokenizer: str  # the model dir (its tokenizer makes the random prompts)
    concurrency: int | None  # --max-concurrency (None: open loop at `rate`)
    prompts: int
    input_len: int
    output_len: int
    seed: int
    api: str = "chat"  # chat | responses
    rate: float | None = None  # --request-rate (requests/s); None: all at once, bounded by concurrency
    goodput_ttft_ms: float | None = None
    warmups: int = 0
    model: str = "nemotron"
    # Optional, for `nemotron-loadtest`; their defaults give the GPU steps' command line unchanged.
    ignore_eos: bool = True
    temperature: float = 0.0
    range_ratio: float | None = None  # --random-range-ratio: lengths uniform in [len * (1 - r), len * (1 + r)]
    prompts_file: Path | None = None  # vLLM's custom dataset (JSONL) instead of random prompts
    shuffle: bool = True  # False: the prompts file's lines go in file order (--disable-shuffle)
    burstiness: float | None = None  # --burstiness: 1 is Poisson arrivals (vLLM's default)
    goodput_e2el_ms: float | None = None
    percentile_metrics: str = "ttft,itl,e2el"
    metric_percentiles: str = "50,99"


_BACKENDS = {
    "chat": ("openai-chat", "/v1/chat/completions"),
    "responses": ("openai-responses", "/v1/responses"),
    "completions": ("openai", "/v1/completions"),
}


def argv(load: Load, result_dir: Path, name: str) -> list[str]:
    """The command line of one run: random prompts of fixed lengths (or a prompts file), ignore_eos, streamed, the
    chosen percentiles saved with every request's figures."""
    backend, endpoint = _BACKENDS[load.api]
    if load.prompts_file is None:
        dataset = [
            "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len),
        ]  # fmt: skip
        if load.range_ratio is not None:
            dataset += ["--random-range-ratio", f"{load.range_ratio:g}"]
    else:  # the prompt is sent as written: the chat endpoint applies the server's own template
        dataset = [
            "--dataset-name", "custom", "--dataset-path", str(load.prompts_file),
            "--custom-output-len", str(load.output_len), "--skip-chat-template",
        ]  # fmt: skip
        if not load.shuffle:
            dataset.append("--disable-shuffle")
    args = [
        sys.executable, "-m", "loadtest.gpu.bench", "--backend", backend, "--base-url", load.base_url,
        "--endpoint", endpoint, "--model", load.model, "--tokenizer", load.tokenizer,
        *dataset, *(["--ignore-eos"] if load.ignore_eos else []), "--num-prompts", str(load.prompts),
        "--seed", str(load.seed), "--temperature", f"{load.temperature:g}",
        "--percentile-metrics", load.percentile_metrics, "--metric-percentiles", load.metric_percentiles,
        "--num-warmups", str(load.warmups), "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", f"{name}.json",
        "--ready-check-timeout-sec", "0",
    ]  # fmt: skip
    if load.concurrency is not None:
        args += ["--max-concurrency", str(load.concurrency)]
    if load.rate is not None:
        args += ["--request-rate", f"{load.rate:.3f}"]
    objectives = (("ttft", load.goodput_ttft_ms), ("e2el", load.goodput_e2el_ms))
    goodput = [f"{metric}:{ms:g}" for metric, ms in objectives if ms is not None]
    if goodput:
        args += ["--goodput", *goodput]
    if load.burstiness is not None:
        args += ["--burstiness", f"{load.burstiness:g}"]
    return args


@dataclass
class Client:
    """One running bench process."""

    name: str
    load: Load
    process: subprocess.Popen[bytes]
    result: Path
    log: Path
    started: float = field(default_factory=time.monotonic)


def start(load: Load, work: Path, name: str, api_key: str | None) -> Client:
    """Start one bench process; its output goes to WORK/NAME.log, its results to WORK/NAME.json."""
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    log = work / f"{name}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(argv(load, work, name), stdout=sink, stderr=subprocess.STDOUT, env=env)
    return Client(name, load, process, work / f"{name}.json", log)


def stop(client: Client) -> None:
    """End a client early (a background load once the measured one is done); vLLM aborts its streams.

    A signal by pid, not Popen.send_signal: that polls, and a reaped child's CPU could no longer be read."""
    if client.process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(client.process.pid, signal.SIGINT)


def running(client: Client) -> bool:
    """Whether the client is still running (waitid with WNOWAIT: its exit and CPU stay for finish to read)."""
    if client.process.returncode is not None:
        return False
    return os.waitid(os.P_PID, client.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def metric_sums(base_url: str, names: Sequence[str]) -> dict[str, float] | None:
    """Each of `names` in an engine's /metrics, summed over its label sets (0 when absent); None when unreadable."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _cpu(pid: int) -> float | None:
    try:
        user, system = cpu_seconds(pid)
    except OSError:
        return None
    return user + system


def finish(clients: Sequence[Client], timeout_s: float) -> list[dict[str, Any]]:
    """Wait for clients together (SIGKILL at the time box) and summarise each: vLLM's figures, its exit, its CPU
    (all of it from wait4, and its share of a core over the benchmark's own duration, sampled from /proc every
    0.5 s: a client near 1.0 core is what would bound a point)."""
    deadline = time.monotonic() + timeout_s
    samples: dict[str, list[tuple[float, float]]] = {c.name: [] for c in clients}
    reaped: dict[str, tuple[int, float, float, bool]] = {}
    while len(reaped) < len(clients):
        now = time.monotonic()
        for client in clients:
            if client.name in reaped:
                continue
            timed_out = now >= deadline
            if timed_out:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(client.process.pid, signal.SIGKILL)
            cpu = _cpu(client.process.pid)
            pid, status, usage = os.wait4(client.process.pid, 0 if timed_out else os.WNOHANG)
            if pid:
                client.process.returncode = os.waitstatus_to_exitcode(status)
                reaped[client.name] = (
                    client.process.returncode,
                    usage.ru_utime + usage.ru_stime,
                    now - client.started,
                    timed_out,
                )
            elif cpu is not None:
                samples[client.name].append((now, cpu))
        time.sleep(0.5)
    return [_summary(client, *reaped[client.name], samples[client.name]) for client in clients]


def run_share(samples: list[tuple[float, float]], duration: float) -> float | None:
    """The client's CPU share (cores) over the last `duration` seconds it was seen alive: the benchmark itself,
    not its start (importing vLLM, making the prompts), which is CPU-bound whatever the load."""
    if duration <= 0 or len(samples) < 2:
        return None
    end, cpu_end = samples[-1]
    earlier = [(t, c) for t, c in samples if t <= end - duration] or samples[:1]
    start, cpu_start = earlier[-1]
    return round((cpu_end - cpu_start) / (end - start), 3) if end > start else None


def _summary(
    client: Client, returncode: int, cpu: float, wall: float, timed_out: bool, samples: list[tuple[float, float]]
) -> dict[str, Any]:
    summary = summarise(client.result)
    lines = _log_lines(client.log)
    share = run_share(samples, summary.get("duration_s") or 0.0)
    return {
        **summary,
        "client": {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "run_cpu_share": share},
        "returncode": returncode,
        "timed_out": timed_out,
        "prompts_realigned": any("re-aligning prompts" in line for line in lines),
        **({} if summary.get("completed") is not None else {"log_tail": lines[-8:]}),
    }


def _log_lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines() if log.exists() else []


def summarise(result: Path) -> dict[str, Any]:
    """The figures of one saved result (vLLM's names), errors counted by what vLLM recorded (HTTP reason)."""
    if not result.exists():
        return {"completed": None}
    data = json.loads(result.read_text())
    errors = Counter(str(error)[:120] for error in data.get("errors") or () if error)
    duration = float(data.get("duration") or 0.0)
    return {
        "completed": data.get("completed"),
        "failed": data.get("failed", 0),
        "duration_s": round(duration, 3),
        "output_tokens": data.get("total_output_tokens", 0),
        "output_tokens_per_s": float(data.get("output_throughput") or 0.0),
        "request_goodput": data.get("request_goodput"),
        "ttft_p50_ms": data.get("p50_ttft_ms"),
        "ttft_p99_ms": data.get("p99_ttft_ms"),
        "itl_p50_ms": data.get("p50_itl_ms"),
        "itl_p99_ms": data.get("p99_itl_ms"),
        "e2el_p50_ms": data.get("p50_e2el_ms"),
        "errors": dict(errors),
    }


def _register_responses_backend() -> None:
    """Give a vLLM without `openai-responses` (0.26.0) one, reading the stream as vLLM 0.32's does."""
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    if "openai-responses" in funcs.ASYNC_REQUEST_FUNCS:
        return
    from loadtest.gpu.responses_client import request_openai_responses

    funcs.ASYNC_REQUEST_FUNCS["openai-responses"] = request_openai_responses
    funcs.OPENAI_COMPATIBLE_BACKENDS.append("openai-responses")  # ignore_eos and sampling params apply


def main(args: Sequence[str] | None = None) -> int:
    """Entry point: vLLM's `vllm bench serve` with ARGS (see the module docstring)."""
    _register_responses_backend()
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m loadtest.gpu.bench")
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(list(sys.argv[1:] if args is None else args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
