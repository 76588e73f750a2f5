"""What a load run sends: prompts (synthetic, lengths from a distribution, or a JSONL file) and request bodies.

Request `i` is the same bytes in every run with the same seed, so sweep points and profiles see one workload.
Synthetic prompt lengths are in words from a small English vocabulary: about one token per word for the
tokenizers of Llama-family models, Nemotron's included. Imports nothing from `gateway`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

Endpoint = Literal["chat", "completions"]
DISTRIBUTIONS = ("normal", "lognormal", "uniform", "exponential", "fixed")
PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

_VOCABULARY = (
    "the of and to in is was for on that with as by at from his her they this which be are or an had not but "
    "what all were when we there can more if no out so said time about other into than its only new some could "
    "these two may first then do any like my now over such our man me even most made after also did many off "
    "before must well back through years where much your way down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year since come against go came right used take three "
    "engine model token cache memory request latency throughput river garden window market story music paper"
).split()


class PromptFileError(ValueError):
    """A prompts file line that is not a JSON object with `prompt` or `messages`."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: plain text (completions) or chat messages, and its own max_tokens if the file gave one."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int | None = None

    def as_messages(self) -> list[dict[str, Any]]:
        """Chat messages (a text prompt becomes one user message)."""
        if self.messages is not None:
            return list(self.messages)
        return [{"role": "user", "content": self.text or ""}]

    def as_text(self) -> str:
        """A completions prompt (chat messages are joined by newlines)."""
        if self.text is not None:
            return self.text
        return "\n".join(str(m.get("content") or "") for m in self.messages or ())


@dataclass(frozen=True, slots=True)
class SyntheticPrompts:
    """Prompts of random words whose lengths follow `distribution` with the given mean and standard deviation."""

    mean: float = 128.0
    stddev: float = 32.0
    distribution: str = "normal"

    def length(self, rng: random.Random) -> int:
        """One prompt length in words (at least 1)."""
        mean, sd = max(1.0, self.mean), max(0.0, self.stddev)
        if self.distribution == "fixed" or sd == 0:
            value = mean
        elif self.distribution == "normal":
            value = rng.gauss(mean, sd)
        elif self.distribution == "lognormal":
            sigma2 = math.log1p((sd / mean) ** 2)
            value = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
        elif self.distribution == "uniform":
            half = sd * math.sqrt(3)
            value = rng.uniform(mean - half, mean + half)
        elif self.distribution == "exponential":
            value = rng.expovariate(1 / mean)
        else:
            raise ValueError(f"unknown distribution {self.distribution!r}; one of {', '.join(DISTRIBUTIONS)}")
        return max(1, round(value))

    def prompt(self, rng: random.Random) -> Prompt:
        """A prompt of `length(rng)` words."""
        words = rng.choices(_VOCABULARY, k=self.length(rng))
        return Prompt(text=" ".join(words))

    def describe(self) -> dict[str, Any]:
        """For results.json."""
        return {"source": "synthetic", "distribution": self.distribution, "mean": self.mean, "stddev": self.stddev}


@dataclass(frozen=True, slots=True)
class FilePrompts:
    """Prompts read from a JSONL file, used in turn: `{"prompt": "..."}` or `{"messages": [...]}` per line."""

    path: Path
    prompts: tuple[Prompt, ...]

    @classmethod
    def load(cls, path: Path) -> FilePrompts:
        """Read every non-empty line; PromptFileError names the first bad one."""
        prompts: list[Prompt] = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                prompts.append(_parse_line(line, f"{path}:{number}"))
        if not prompts:
            raise PromptFileError(f"{path}: no prompts")
        return cls(path, tuple(prompts))

    def prompt(self, index: int) -> Prompt:
        """The prompt for request `index` (the file repeats)."""
        return self.prompts[index % len(self.prompts)]

    def describe(self) -> dict[str, Any]:
        """For results.json."""
        return {"source": "file", "path": str(self.path), "count": len(self.prompts)}


def _parse_line(line: str, where: str) -> Prompt:
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PromptFileError(f"{where}: not a JSON object")
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise PromptFileError(f"{where}: max_tokens must be a positive integer")
    if isinstance(data.get("prompt"), str):
        return Prompt(text=data["prompt"], max_tokens=max_tokens)
    messages = data.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return Prompt(messages=tuple(messages), max_tokens=max_tokens)
    raise PromptFileError(f'{where}: needs "prompt" (a string) or "messages" (a list of objects)')


def parse_token_range(text: str) -> tuple[int, int]:
    """`"64"` or `"16:128"` into (low, high); ValueError when not positive or low > high."""
    low_text, sep, high_text = text.partition(":")
    low = int(low_text)
    high = int(high_text) if sep else low
    if low < 1 or high < low:
        raise ValueError(f"max tokens {text!r}: want N or LOW:HIGH with 1 <= LOW <= HIGH")
    return low, high


@dataclass(frozen=True, slots=True)
class Traffic:
    """The request bodies of a run: endpoint, streaming, prompts, output lengths, sampling."""

    model: str
    endpoint: Endpoint = "chat"
    stream: bool = True
    prompts: SyntheticPrompts | FilePrompts = SyntheticPrompts()
    max_tokens: tuple[int, int] = (64, 64)
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0

    @property
    def path(self) -> str:
        """The URL path requests go to."""
        return PATHS[self.endpoint]

    def body(self, index: int) -> bytes:
        """The JSON body of request `index`: the same bytes for the same seed and index."""
        rng = random.Random(f"{self.seed}:{index}")
        prompts = self.prompts
        prompt = prompts.prompt(index) if isinstance(prompts, FilePrompts) else prompts.prompt(rng)
        data: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            data["messages"] = prompt.as_messages()
        else:
            data["prompt"] = prompt.as_text()
        data["max_tokens"] = prompt.max_tokens or rng.randint(*self.max_tokens)
        data["temperature"] = self.temperature
        if self.ignore_eos:
            data["ignore_eos"] = True  # vLLM's extension: every request generates exactly max_tokens
        if self.stream:
            data["stream"] = True
            data["stream_options"] = {"include_usage": True}
        return orjson.dumps(data)

    def describe(self) -> dict[str, Any]:
        """For results.json."""
        return {
            "endpoint": self.endpoint,
            "stream": self.stream,
            "prompts": self.prompts.describe(),
            "max_tokens": list(self.max_tokens),
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }


def parse_list(text: str, kind: type[int] | type[float]) -> list[Any]:
    """`"1,2,4"` into numbers; ValueError for an empty list or a value not above zero."""
    values: Sequence[int | float] = [kind(part) for part in text.split(",") if part.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{text!r}: want a comma-separated list of positive numbers")
    return list(values)
