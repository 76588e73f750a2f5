"""Liveness of a ready engine: does it generate? Read from vLLM's /metrics, and a one-token probe when idle.

vLLM's /health only says that its API process answers: with the engine core frozen it keeps answering
200, and under load it answers late while tokens flow at full speed. So a ready engine is
judged by progress: its token counters grow, or, when nothing runs, a one-token generation finishes.
A slow answer alone never condemns it; no progress for `stall_timeout` seconds, or `probe_failures`
refused or failed checks in a row, does. The probe carries the engine's API key when it has one; a probe
the API server refuses (4xx: a key it was not told, a model name it does not serve) says nothing about
generation, so it is warned about once and the token counters alone judge. Imports httpx and our leaves only.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import httpx

from gateway.engine.supervisor_state import RestartCause
from gateway.settings import EngineSettings

logger = logging.getLogger(__name__)

# vLLM's Prometheus names (vllm/v1/metrics/loggers.py): counters get `_total` in the exposition.
_TOKENS = re.compile(r"^vllm:(?:generation|prompt)_tokens_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)
# Marks the idle probe's request in vLLM's access log (the query string is logged, and ignored by vLLM's
# routes), so the supervisor can leave those lines out of its output.
PROBE_MARK = "source=nemotron-supervisor"
_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


@dataclass(frozen=True)
class Sample:
    """What one scrape of vLLM's /metrics says: tokens processed so far, requests being generated for."""

    tokens: float
    running: float


def parse_metrics(text: str) -> Sample | None:
    """The token counters and running gauge summed over their labels; None when the text has no token counter."""
    tokens = [float(value) for value in _TOKENS.findall(text)]
    if not tokens:
        return None
    return Sample(tokens=sum(tokens), running=sum(float(value) for value in _RUNNING.findall(text)))


@dataclass(frozen=True)
class Verdict:
    """One check's outcome: `problem` is None when the engine showed progress; `cause` set means restart it.

    `failed`: the engine answered with an error or refused the connection (not merely late or idle).
    """

    problem: str | None = None
    cause: RestartCause | None = None
    failed: bool = False


class Liveness:
    """Checks a ready engine once per call of `check()`; remembers progress between calls."""

    def __init__(self, settings: EngineSettings, client: httpx.AsyncClient, api_key: str | None = None) -> None:
        self.settings = settings
        self.client = client
        self._probe_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._refusal_warned = False
        base = f"http://127.0.0.1:{settings.port}"
        self._metrics_url = f"{base}/metrics"
        self._completions_url = f"{base}/v1/completions?{PROBE_MARK}"
        self._tokens: float | None = None
        self._failures = 0
        self.last_progress = time.monotonic()

    def reset(self) -> None:
        """A new engine life: progress counts from now."""
        self._tokens = None
        self._failures = 0
        self.last_progress = time.monotonic()

    @property
    def stalled_for(self) -> float:
        """Seconds since the last evidence of generation."""
        return time.monotonic() - self.last_progress

    async def check(self) -> Verdict:
        """Scrape /metrics; tokens grew: alive. Requests running without tokens, or idle and the probe fails: not."""
        try:
            sample = await self._sample()
        except httpx.TimeoutException:
            return self._no_progress(f"/metrics did not answer within {self.settings.stall_timeout:g} s")
        except httpx.HTTPError as exc:
            return self._failed(f"/metrics failed ({type(exc).__name__})")
        self._failures = 0
        if self._grew(sample):
            return self._progress()
        if sample is not None and sample.running > 0:
            return self._no_progress(
                f"{sample.running:g} request(s) running and no token generated", RestartCause.NOT_GENERATING
            )
        return await self._generate_one()

    async def _sample(self) -> Sample | None:
        # A saturated API server answers late but answers: it gets the whole stall bound, not probe_timeout.
        response = await self.client.get(self._metrics_url, timeout=self.settings.stall_timeout)
        # An engine without vLLM's metrics (another server, metrics off) is judged by the probe alone.
        return parse_metrics(response.text) if response.status_code == 200 else None

    def _grew(self, sample: Sample | None) -> bool:
        previous, self._tokens = self._tokens, (None if sample is None else sample.tokens)
        return sample is not None and previous is not None and sample.tokens > previous

    async def _generate_one(self) -> Verdict:
        """Idle: one token of generation, bounded by the stall bound; a late answer is checked against the counter."""
        body = {"model": self.settings.served_model_name, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        try:
            response = await self.client.post(
                self._completions_url, json=body, headers=self._probe_headers, timeout=self.settings.stall_timeout
            )
        except httpx.TimeoutException:
            # Load may have arrived meanwhile and queued the probe: tokens flowing still count as alive.
            try:
                if self._grew(await self._sample()):
                    return self._progress()
            except httpx.HTTPError:
                pass
            return self._no_progress(
                f"a one-token generation did not finish within {self.settings.stall_timeout:g} s",
                RestartCause.NOT_GENERATING,
            )
        except httpx.HTTPError as exc:
            return self._failed(f"a one-token generation failed ({type(exc).__name__})")
        if 400 <= response.status_code < 500:
            if not self._refusal_warned:
                self._refusal_warned = True
                logger.warning(
                    "the engine refused the idle generation probe (%d%s); idle liveness rests on its token counters",
                    response.status_code,
                    ", is NEMOTRON_ENGINE_API_KEY its key?" if response.status_code == 401 else "",
                )
            return self._progress()
        if response.status_code != 200:
            return self._failed(f"a one-token generation answered {response.status_code}")
        return self._progress()

    def _progress(self) -> Verdict:
        self._failures = 0
        self.last_progress = time.monotonic()
        return Verdict()

    def _no_progress(self, problem: str, cause: RestartCause = RestartCause.UNRESPONSIVE) -> Verdict:
        stalled = self.stalled_for
        if stalled < self.settings.stall_timeout:
            return Verdict(problem=problem)
        return Verdict(problem=f"{problem}; no progress for {stalled:.0f} s", cause=cause)

    def _failed(self, problem: str) -> Verdict:
        self._failures += 1
        problem = f"{problem} ({self._failures}/{self.settings.probe_failures})"
        if self._failures >= self.settings.probe_failures:
            return Verdict(problem=problem, cause=RestartCause.UNRESPONSIVE, failed=True)
        verdict = self._no_progress(problem)
        return Verdict(problem=verdict.problem, cause=verdict.cause, failed=True)
