"""Multi-turn conversations that share long prefixes, as a prompts file for vLLM's own benchmark client.

`python -m loadtest.conversations OUT.jsonl --conversations N --turns T [--prefix-tokens D] [--turn-tokens U]
[--seed S] [--tokenizer DIR]` writes one JSON line per request, `{"prompt": ..., "conversation": i, "turn": k}`:
the format of `vllm bench serve --dataset-name custom` (vLLM 0.26 and 0.32 read the `prompt` column and keep the
others; `--disable-shuffle` sends the lines in file order, `--skip-chat-template` counts the prompt as written).

Each conversation opens with a document of its own (about D tokens; its first characters name the conversation, so
no two share a leading 2,048 characters), and turn k's prompt is turn k-1's followed by the assistant's answer to it
and the next question (about U tokens together): every turn repeats the earlier turns word for word, so its tokens
up to the previous question are a prefix the engine may have cached. The chat client sends a prompt as one user
message, so a conversation's leading characters, the ones a prefix-affinity router hashes, are its document's.

The lines go turn by turn (every conversation's first turn, then every second turn, ...): with at most N requests
in flight (`--max-concurrency` ≤ N), a turn is sent only once its conversation's previous turn has finished, as a
user would. Bounded: at most `MAX_CONVERSATIONS` conversations of `MAX_TURNS` turns, each prompt within
`--max-prompt-tokens` (the engine's context less the answer). Imports nothing from `gateway`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_CONVERSATIONS = 4096
MAX_TURNS = 64
# Syllables of the made-up words: lower-case text that any tokenizer splits into a steady number of tokens.
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")


@dataclass(frozen=True)
class Shape:
    """How many conversations, how long each, in tokens."""

    conversations: int
    turns: int
    prefix_tokens: int = 2000
    turn_tokens: int = 200
    max_prompt_tokens: int = 3900

    def __post_init__(self) -> None:
        if not 1 <= self.conversations <= MAX_CONVERSATIONS:
            raise ValueError(f"conversations must be 1 to {MAX_CONVERSATIONS}, not {self.conversations}")
        if not 1 <= self.turns <= MAX_TURNS:
            raise ValueError(f"turns must be 1 to {MAX_TURNS}, not {self.turns}")
        longest = self.prefix_tokens + (self.turns - 1) * self.turn_tokens + self.turn_tokens // 2
        if longest > self.max_prompt_tokens:
            raise ValueError(
                f"the last turn would take about {longest} tokens, past --max-prompt-tokens {self.max_prompt_tokens}"
            )

    @property
    def requests(self) -> int:
        """Lines in the file: one per turn of every conversation."""
        return self.conversations * self.turns


def word_counter(tokenizer: str | None) -> Callable[[str], int]:
    """Tokens of a text by the model's tokenizer (DIR/tokenizer.json), or an estimate of 1.5 a word without one."""
    if tokenizer is None:
        return lambda text: round(len(text.split()) * 1.5)
    from tokenizers import Tokenizer  # the model's own; only where a tokenizer is named

    loaded = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    return lambda text: len(loaded.encode(text, add_special_tokens=False).ids)


def tokens_per_word(count: Callable[[str], int], seed: int) -> float:
    """The tokenizer's tokens for one made-up word, measured on a sample."""
    sample = _words(random.Random(seed), 2000)
    return max(count(sample) / 2000, 0.1)


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))) for _ in range(n))


def conversations(shape: Shape, seed: int, per_word: float) -> Iterator[dict[str, object]]:
    """Every request, turn by turn: `prompt`, `conversation`, `turn`."""
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        return _words(rng, max(1, round(tokens / per_word)))

    question, answer = shape.turn_tokens // 2, shape.turn_tokens - shape.turn_tokens // 2
    # Every conversation's document: its own name first, so its leading characters are its own.
    prompts = [f"Conversation {seed}-{i}. Document:\n{text(shape.prefix_tokens)}" for i in range(shape.conversations)]
    for turn in range(shape.turns):
        for i in range(shape.conversations):
            if turn:
                prompts[i] += f"\nAssistant: {text(answer)}"
            prompts[i] += f"\nUser: {text(question)}"
            yield {"prompt": prompts[i], "conversation": i, "turn": turn}


def write(path: Path, shape: Shape, seed: int, tokenizer: str | None = None) -> dict[str, object]:
    """Write the prompts file; return what it holds (requests, prompt tokens of the first and last turn)."""
    count = word_counter(tokenizer)
    per_word = tokens_per_word(count, seed)
    lines = list(conversations(shape, seed, per_word))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    first, last = lines[0]["prompt"], lines[-1]["prompt"]
    assert isinstance(first, str) and isinstance(last, str)
    return {
        "requests": len(lines),
        "conversations": shape.conversations,
        "turns": shape.turns,
        "first_turn_tokens": count(first),
        "last_turn_tokens": count(last),
        "tokens_counted_by": "tokenizer" if tokenizer else "estimate",
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Write one prompts file; print what it holds as a JSON line."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.conversations", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--conversations", type=int, required=True)
    parser.add_argument("--turns", type=int, required=True)
    parser.add_argument("--prefix-tokens", type=int, default=2000, help="each conversation's document")
    parser.add_argument("--turn-tokens", type=int, default=200, help="an answer and the next question together")
    parser.add_argument("--max-prompt-tokens", type=int, default=3900, help="the engine's context less the answer")
    parser.add_argument("--seed", type=int, default=0, help="another seed, other text: a cache never helps a rerun")
    parser.add_argument("--tokenizer", help="the model dir whose tokenizer.json counts the tokens")
    args = parser.parse_args(argv)
    try:
        shape = Shape(args.conversations, args.turns, args.prefix_tokens, args.turn_tokens, args.max_prompt_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(json.dumps(write(args.out, shape, args.seed, args.tokenizer)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
