"""Writes a tiny random-weight NemotronForCausalLM model directory that `vllm serve` (CPU build) can load.
For tests/engine and the quickstart. Needs the cpu/gpu extra (torch, tokenizers, safetensors): the gateway
core never imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["CHAT_TEMPLATE", "write_demo_model"]

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


def _train_tokenizer() -> Tokenizer:
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
    bos_id = tokenizer.token_to_id(BOS)
    # Plain completions get one BOS, like the real Nemotron tokenizers; chat prompts carry it in the template.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


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


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
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
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "added_tokens_decoder": added_tokens,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_demo_model(directory: Path, *, seed: int = 0) -> Path:
    """Write config, weights and tokenizer into `directory` (created if needed) and return it.

    The same seed gives the same files; the tokenizer does not depend on the seed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(directory / "config.json", _config(vocab_size, tokenizer))
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": tokenizer.token_to_id(BOS), "eos_token_id": tokenizer.token_to_id(EOS)},
    )
    weights = directory / "model.safetensors"
    save_file(_weights(vocab_size, seed), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it 0600; the engine may run as another user
    logger.info("wrote demo Nemotron model (vocab %d, seed %d) to %s", vocab_size, seed, directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.demo_model", description="Write a tiny random-weight Nemotron model directory."
    )
    parser.add_argument("directory", type=Path, help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")
    args = parser.parse_args(argv)
    path = write_demo_model(args.directory, seed=args.seed)
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
