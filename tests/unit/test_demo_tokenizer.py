"""The demo tokenizer grown to a real architecture's vocabulary (tools/demo_model.py, `--vocab-size N
--tokenizer-only`), as the GPU runs serve it with random weights: every id decodes to text, the ids past the demo
vocabulary to visible words, and the special tokens, chat template and tool-call token are the demo tokenizer's."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tools.demo_model import SPECIAL_TOKENS, TOOL_CALL_TEXT, main, write_demo_model, write_tokenizer

pytestmark = pytest.mark.timeout(120)  # two tokenizers trained (a few seconds each on a busy machine)

VOCAB = 3000
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. /no_think"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Thank you  very much!\n\nBye."},
]


@pytest.fixture(scope="module")
def grown_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("grown") / "tokenizer"
    assert main([str(directory), "--vocab-size", str(VOCAB), "--tokenizer-only"]) == 0
    return directory


@pytest.fixture(scope="module")
def grown(grown_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(grown_dir))  # how vLLM and its benchmark client load it


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(str(write_demo_model(tmp_path_factory.mktemp("demo") / "model")))


def test_only_the_tokenizer_files_are_written(grown_dir: Path) -> None:
    assert sorted(path.name for path in grown_dir.iterdir()) == [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_the_tokenizer_has_exactly_the_asked_ids(grown: Any) -> None:
    assert len(grown) == VOCAB
    assert max(grown.get_vocab().values()) == VOCAB - 1
    assert sorted(grown.get_vocab().values()) == list(range(VOCAB))


def test_every_id_decodes_to_text_and_each_past_the_demo_vocabulary_to_a_visible_word(grown: Any, demo: Any) -> None:
    texts = [grown.decode([token_id], skip_special_tokens=False) for token_id in range(VOCAB)]
    assert all(texts), [token_id for token_id, text in enumerate(texts) if not text]
    # vLLM decodes with skip_special_tokens: only the five special tokens go silent there.
    silent = [token_id for token_id in range(VOCAB) if not grown.decode([token_id], skip_special_tokens=True)]
    assert silent == sorted(grown.convert_tokens_to_ids(SPECIAL_TOKENS))
    # Whitespace alone only where the demo tokenizer has it (the byte-level space, newline, ... the template needs).
    blank = {token_id for token_id, text in enumerate(texts) if not text.strip()}
    demo_blank = {token_id for token_id in range(len(demo)) if not demo.decode([token_id]).strip()}
    assert blank == demo_blank
    assert len(blank) < 20
    # Past the demo's trained vocabulary (its last id is the tool call): a space and a word, every one different.
    words = texts[len(demo) - 1 : VOCAB - 1]
    assert len(words) == VOCAB - len(demo)
    assert all(re.fullmatch(r" [a-z]+", word) for word in words), [w for w in words if not re.fullmatch(r" [a-z]+", w)]
    assert len(set(words)) == len(words)
    assert set(words).isdisjoint(texts[: len(demo) - 1])


def test_special_tokens_keep_the_demo_ids(grown: Any, demo: Any) -> None:
    assert grown.convert_tokens_to_ids(SPECIAL_TOKENS) == demo.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert grown.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert (grown.pad_token_id, grown.bos_token_id, grown.eos_token_id) == (
        demo.pad_token_id,
        demo.bos_token_id,
        demo.eos_token_id,
    )
    # Plain completions still get one BOS.
    assert grown("Hello")["input_ids"][0] == grown.bos_token_id


def test_the_tool_call_is_still_one_token_and_the_last_id(grown: Any) -> None:
    assert grown.encode(TOOL_CALL_TEXT, add_special_tokens=False) == [VOCAB - 1]
    assert grown.decode([VOCAB - 1]) == TOOL_CALL_TEXT


def test_the_chat_template_renders_as_the_demo_one(grown: Any, demo: Any) -> None:
    rendered = grown.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == demo.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s><extra_id_0>System\nYou are a helpful assistant. /no_think\n\n")
    assert rendered.endswith("<extra_id_1>Assistant\n")
    # Tokenized as vLLM does (no special tokens added: the template writes the BOS), it decodes back unchanged.
    ids = grown.encode(rendered, add_special_tokens=False)
    assert ids.count(grown.bos_token_id) == 1
    assert grown.decode(ids) == rendered


def test_text_round_trips_and_word_ids_encode_back_to_themselves(grown: Any, demo: Any) -> None:
    for text in ("Hello! How can I help you today?", "def main() -> int:\n    return 0\n", "naïve café, 1 + 1 = 2"):
        assert grown.decode(grown.encode(text, add_special_tokens=False)) == text
    # A decoded run of word ids encodes back to the same ids, so vLLM's random prompts keep their length.
    rng = random.Random(7)
    ids = [rng.randrange(len(demo) - 1, VOCAB - 1) for _ in range(200)]
    assert grown.encode(grown.decode(ids), add_special_tokens=False) == ids


def test_a_vocabulary_below_the_demo_tokenizers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="below the demo tokenizer's own 1025 ids"):
        write_tokenizer(tmp_path / "small", 1000)


def test_tokenizer_only_needs_a_vocab_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "t"), "--tokenizer-only"])
    assert exited.value.code == 2
    assert "--tokenizer-only needs --vocab-size" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
