"""Writes a tiny random-weight NemotronForCausalLM model directory that `vllm serve` (CPU build) can load.
For tests/engine, the load tool's CPU runs and the quickstart (`make run`, through `nemotron-gateway demo-model`).
Needs the cpu/gpu extra (torch, tokenizers, safetensors). A development tool: not part of the gateway package.

    python -m tools.demo_model DIR [--seed N] [--defect double-bos|no-template|needs-system]... [--vocab-size N]
    python -m tools.demo_model DIR --vocab-size N --tokenizer-only

`defects` seeds chat-format faults that Nemotron templates in circulation have, for the doctor to find and a
preset to fix: `double-bos` (the template writes BOS twice), `no-template`, `needs-system` (the template fails
without a system message). The tokenizer also holds one added token whose text is a whole Nano-9B-v2 tool call
(`TOOL_CALL_TEXT`), so a request can make the random model emit it (logit_bias) and the engine's tool parser is
exercised for real.

`--vocab-size N` grows the tokenizer to exactly N ids (`write_tokenizer`): the GPU runs serve a real architecture's
config.json (vocab 131,072 or 256,000) with random weights, which emit ids across that whole vocabulary, and an id the
tokenizer lacks decodes to nothing (a Responses stream of such ids has no text, so vLLM's client counts no tokens). The
ids past the demo vocabulary are generated words; the special tokens keep their ids, the template and the tool-call
token stay. `--tokenizer-only` writes just the tokenizer files (no config.json, no weights).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "CHAT_TEMPLATE",
    "DEFECTS",
    "SPECIAL_TOKENS",
    "TOOL_CALL_TEXT",
    "write_demo_model",
    "write_tiny_nemotron_h",
    "write_tokenizer",
]

logger = logging.getLogger(__name__)

HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
# vLLM's CPU attention backend needs head_dim >= 32: with 16 the engine starts, then dies on the first request.
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
MAX_POSITION_EMBEDDINGS = 4096
VOCAB_SIZE = 1024

PAD, BOS, EOS, SYSTEM_MARK, TURN_MARK = "<pad>", "<s>", "</s>", "<extra_id_0>", "<extra_id_1>"
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM_MARK, TURN_MARK]

# The Nemotron-Mini-Instruct prompt format. It starts with the BOS itself: chat requests tokenize the rendered
# prompt without special tokens, so the BOS appears once. Unknown roles fail loudly instead of vanishing.
CHAT_TEMPLATE = (
    "{{ bos_token }}{{ '<extra_id_0>System' }}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '\\n' + message['content'] | trim }}"
    "{% endif %}{% endfor %}{{ '\\n\\n' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<extra_id_1>User\\n' + message['content'] | trim + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<extra_id_1>Assistant\\n' + message['content'] | trim + '\\n' }}"
    "{% elif message['role'] == 'tool' %}{{ '<extra_id_1>Tool\\n' + message['content'] | trim + '\\n' }}"
    "{% elif message['role'] != 'system' %}{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<extra_id_1>Assistant\\n' }}{% endif %}"
)

# The Nano-9B-v2 tool-call format, as one token (not special: it is decoded into the text the parser reads).
TOOL_CALL_TEXT = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
# A template that breaks without a system message, as some Llama-Nemotron templates do (KeyError: 'system').
_NEEDS_SYSTEM = "{% if messages[0]['role'] != 'system' %}{{ raise_exception(\"KeyError: 'system'\") }}{% endif %}"
DEFECTS = ("double-bos", "no-template", "needs-system")
# `thinking=True`: Nemotron 3's think markers as tokens of their own, and its template's habit: the generation
# prompt opens `<think>`, or writes `<think></think>` with `enable_thinking` false (vLLM's nemotron_v3 parser).
THINK_START, THINK_END = "<think>", "</think>"
_THINKING_PROMPT = (
    "{% if add_generation_prompt %}{{ '<extra_id_1>Assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% else %}{{ '<think>' }}"
    "{% endif %}{% endif %}"
)

_SUBJECTS = (
    "The gateway|A client|The engine|Our operator|The model|Every request|The cache|A stream|The supervisor|"
    "This key|The user|The assistant|The system|A token"
).split("|")
_VERBS = (
    "answers|checks|sends|reads|writes|counts|limits|starts|stops|restarts|streams|measures|rejects|accepts|"
    "returns|waits for|logs|serves"
).split("|")
_OBJECTS = (
    "the request|a long answer|every chunk|the health probe|ten tokens|the usage numbers|a short reply|"
    "the chat template|the rate limit|an error|the metrics|the next message|a friendly greeting|"
    "the weather report|a small poem|the final result"
).split("|")
_ENDINGS = [".", "!", "?", " today.", " again.", " quickly.", " in time.", " without delay."]
_PHRASES = [
    "Hello! How can I help you today?",
    "You are a helpful assistant.",
    "What is the capital of France?",
    "Paris is the capital of France.",
    "Thank you very much.",
    "Please write a short story.",
    "Sure, here is a short story about a robot.",
    "I do not know.",
    "Let me think step by step.",
    "def main() -> int:\n    return 0\n",
    '{"role": "user", "content": "hi"}',
    "1 + 1 = 2, 2 * 3 = 6.",
]


def _corpus() -> list[str]:
    """English-like text made here, so the tokenizer needs no download and is the same on every machine."""
    rng = random.Random(1234)
    lines = list(_PHRASES)
    for index in range(4000):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        if index % 7 == 0:
            sentence += f" It took {rng.randint(0, 9999)} ms."
        lines.append(sentence)
    for role in ("System", "User", "Assistant", "Tool"):
        lines.extend([f"{role}\n{phrase}\n" for phrase in _PHRASES])
    return lines


def _train_tokenizer(*, thinking: bool = False) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(TOOL_CALL_TEXT, normalized=False, special=False)])
    if thinking:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in (THINK_START, THINK_END)])
    bos_id = tokenizer.token_to_id(BOS)
    # Plain completions get one BOS, like the real Nemotron tokenizers; chat prompts carry it in the template.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


# The words of the ids past the demo vocabulary: consonant-vowel syllables, so a random model's output reads as
# pronounceable words (" bakomi tepu ..."), short enough that 256,000 of them keep tokenizer.json at 4.5 MB.
_CONSONANTS = "bdfghjklmnprstvz"
_VOWELS = "aeiou"
_SPACE = "\u0120"  # "Ġ": the space in the byte-level alphabet, so each word decodes with the space before it


def _words(count: int, taken: set[str]) -> list[str]:
    """`count` distinct byte-level tokens (space, then one syllable or more), none of them in `taken`."""
    syllables = [consonant + vowel for consonant in _CONSONANTS for vowel in _VOWELS]
    words: list[str] = []
    for length in itertools.count(1):
        if len(words) >= count:
            break
        for parts in itertools.product(syllables, repeat=length):
            word = _SPACE + "".join(parts)
            if word not in taken:
                words.append(word)
                if len(words) == count:
                    break
    return words


def _sized_tokenizer(vocab_size: int, *, thinking: bool = False) -> Tokenizer:
    """The demo tokenizer with exactly `vocab_size` ids, every one of them decoding to text.

    The trained vocabulary keeps its ids (the special tokens among them), generated words fill the ids after it, and
    the added tokens (the tool call, the think markers) move to the last ids. The words have no merges: BPE with
    `ignore_merges` takes a word found whole in the vocabulary as one token, so a decoded run of word ids encodes
    back to the same ids (vLLM's random prompts keep their length) and any other text still encodes byte-level.
    """
    data = json.loads(_train_tokenizer(thinking=thinking).to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    added = [token for token in data["added_tokens"] if token["id"] >= len(vocab)]
    least = len(vocab) + len(added)
    if vocab_size < least:
        raise ValueError(f"vocab size {vocab_size} is below the demo tokenizer's own {least} ids")
    for word in _words(vocab_size - least, set(vocab)):
        vocab[word] = len(vocab)
    for offset, token in enumerate(added):
        token["id"] = len(vocab) + offset
    data["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(data))


def _config(vocab_size: int, tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "architectures": ["NemotronForCausalLM"],
        "model_type": "nemotron",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "relu2",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "initializer_range": 0.02,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": tokenizer.token_to_id(PAD),
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "torch_dtype": "bfloat16",
    }


def _weights(vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the Hugging Face names that vLLM's Nemotron loader maps (q/k/v -> qkv_proj)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def zeros() -> torch.Tensor:
        # Nemotron's LayerNorm1P scales by (1 + weight), so zero weight and bias is the identity norm.
        return torch.zeros(HIDDEN_SIZE, dtype=torch.bfloat16)

    attention_size = NUM_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.self_attn.q_proj.weight"] = normal(attention_size, HIDDEN_SIZE)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = normal(attention_size, HIDDEN_SIZE)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = normal(attention_size, HIDDEN_SIZE)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, attention_size)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = zeros()
            tensors[f"{prefix}.{norm}.bias"] = zeros()
    tensors["model.norm.weight"] = zeros()
    tensors["model.norm.bias"] = zeros()
    tensors["lm_head.weight"] = normal(vocab_size, HIDDEN_SIZE)
    return tensors


def _chat_template(defects: frozenset[str], *, thinking: bool = False) -> str | None:
    if "no-template" in defects:
        return None
    template = CHAT_TEMPLATE
    if thinking:
        template = template.replace(
            "{% if add_generation_prompt %}{{ '<extra_id_1>Assistant\\n' }}{% endif %}", _THINKING_PROMPT
        )
    if "double-bos" in defects:
        template = "{{ bos_token }}" + template
    if "needs-system" in defects:
        template = _NEEDS_SYSTEM + template
    return template


def _tokenizer_config(
    tokenizer: Tokenizer, defects: frozenset[str] = frozenset(), *, thinking: bool = False
) -> dict[str, Any]:
    added_tokens = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    for text in (TOOL_CALL_TEXT, THINK_START, THINK_END) if thinking else (TOOL_CALL_TEXT,):
        added_tokens[str(tokenizer.token_to_id(text))] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": False,
        }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "added_tokens_decoder": added_tokens,
    }
    template = _chat_template(defects, thinking=thinking)
    if template is not None:
        config["chat_template"] = template
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tokenizer_files(
    directory: Path,
    *,
    vocab_size: int | None,
    defects: frozenset[str] = frozenset(),
    thinking: bool = False,
) -> Tokenizer:
    """tokenizer.json, tokenizer_config.json and generation_config.json: the demo tokenizer, or it grown to
    `vocab_size` ids."""
    directory.mkdir(parents=True, exist_ok=True)
    if vocab_size is None:
        tokenizer = _train_tokenizer(thinking=thinking)
        tokenizer.save(str(directory / "tokenizer.json"))
    else:
        tokenizer = _sized_tokenizer(vocab_size, thinking=thinking)
        # Compact: indented, 256,000 entries take 6.6 MB instead of 4.5, and this file travels to the GPU machine.
        tokenizer.save(str(directory / "tokenizer.json"), pretty=False)
    _write_json(directory / "tokenizer_config.json", _tokenizer_config(tokenizer, defects, thinking=thinking))
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": tokenizer.token_to_id(BOS), "eos_token_id": tokenizer.token_to_id(EOS)},
    )
    return tokenizer


def write_tokenizer(directory: Path, vocab_size: int, *, thinking: bool = False) -> Path:
    """Write the demo tokenizer grown to exactly `vocab_size` ids into `directory` (created if needed); return it.

    For a real architecture's config.json served with random weights (`--load-format dummy`): every id decodes to
    text (the trained vocabulary's, or a generated word with a space before it), the special tokens keep the demo
    tokenizer's ids, and the chat template and the tool-call token (now the last id) stay. No config.json, no weights.
    The only ids that decode to no visible character are the trained vocabulary's few byte-level whitespace and
    control-character tokens (space, newline, "\n\n", ...): any text, the template's own, needs them to encode.
    """
    _write_tokenizer_files(directory, vocab_size=vocab_size, thinking=thinking)
    logger.info("wrote the demo tokenizer grown to %d ids to %s", vocab_size, directory)
    return directory


def write_demo_model(
    directory: Path,
    *,
    seed: int = 0,
    defects: frozenset[str] = frozenset(),
    thinking: bool = False,
    vocab_size: int | None = None,
) -> Path:
    """Write config, weights and tokenizer into `directory` (created if needed) and return it.

    The same seed gives the same files; the tokenizer does not depend on the seed. `defects` (see DEFECTS) seeds
    chat-template faults; `thinking` adds Nemotron 3's think markers and its template's think prompt. `vocab_size`
    grows the tokenizer (and the embeddings) to that many ids, as `write_tokenizer` does; by default the vocabulary
    is the demo tokenizer's own.
    """
    unknown = defects - set(DEFECTS)
    if unknown:
        raise ValueError(f"unknown defects {sorted(unknown)}; choose from {', '.join(DEFECTS)}")
    tokenizer = _write_tokenizer_files(directory, vocab_size=vocab_size, defects=defects, thinking=thinking)
    vocab_size = tokenizer.get_vocab_size()
    _write_json(directory / "config.json", _config(vocab_size, tokenizer))
    weights = directory / "model.safetensors"
    save_file(_weights(vocab_size, seed), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it 0600; the engine may run as another user
    logger.info("wrote demo Nemotron model (vocab %d, seed %d) to %s", vocab_size, seed, directory)
    return directory


def _nemotron_h_config(vocab_size: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """NVIDIA-Nemotron-Nano-9B-v2's config (loadtest/gpu/nvidia-nemotron-nano-9b-v2.json) shrunk: Mamba-2, attention
    and MLP layers in its order (`M*M-`), relu2 MLP, the same field names vLLM's NemotronHConfig reads."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": 4,
        "hybrid_override_pattern": "M*M-",
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "n_groups": 2,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 128,
        "mamba_hidden_act": "silu",
        "mlp_hidden_act": "relu2",
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": False,
        "pad_token_id": tokenizer.token_to_id(PAD),
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "torch_dtype": "bfloat16",
    }


def write_tiny_nemotron_h(directory: Path) -> Path:
    """A tiny NemotronHForCausalLM (hybrid Mamba-2, Nano-9B-v2's layout) with the demo tokenizer and no weights: it is
    served with `--load-format dummy` (random weights), which is what the Nano-9B-v2 preset is checked with."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(directory / "config.json", _nemotron_h_config(tokenizer.get_vocab_size(), tokenizer))
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.demo_model", description="Write a tiny random-weight Nemotron model directory."
    )
    parser.add_argument("directory", type=Path, help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")
    parser.add_argument("--defect", action="append", choices=DEFECTS, default=[], help="seed a chat-template fault")
    parser.add_argument(
        "--vocab-size", type=int, help="grow the tokenizer to exactly this many ids (a real config's vocab_size)"
    )
    parser.add_argument(
        "--tokenizer-only", action="store_true", help="write only the tokenizer files (needs --vocab-size)"
    )
    args = parser.parse_args(argv)
    if args.tokenizer_only:
        if args.vocab_size is None:
            parser.error("--tokenizer-only needs --vocab-size")
        if args.defect:
            parser.error("--defect applies to a whole model, not --tokenizer-only")
        path = write_tokenizer(args.directory, args.vocab_size)
    else:
        path = write_demo_model(
            args.directory, seed=args.seed, defects=frozenset(args.defect), vocab_size=args.vocab_size
        )
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
