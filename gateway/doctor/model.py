"""Model-directory preflight checks: weights, config, tokenizer, chat template, BOS, rope_theta, context length.

Reads config.json and tokenizer_config.json as JSON (no transformers import). The derived context length
follows vLLM's `_get_and_verify_max_len`. What the directory must hold depends on the engine's flags:
`--load-format dummy` reads no weights, `--hf-overrides` changes the config vLLM sees, `--quantization` needs a
checkpoint of that scheme. Where a model preset fixes what is found, the fix names it. Imports only `check` and
`rows` of ours, and the presets' data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.doctor import rows
from gateway.doctor.check import Check, failed, gib, passed, skipped, warned
from gateway.engine.presets import Preset, load_presets

_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_UNSCALED_ROPE = ("su", "longrope", "llama3")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
_ROPE_THETA_RANGE = (1e3, 1e8)  # 10000 (Llama 2, Nemotron-4) .. 5e5 (Llama 3.1 Nemotron) .. 1e7 seen in long-context
# Load formats that read one kind of weight file only; `dummy` reads none (random weights, as benchmarks use).
_FORMAT_GLOBS = {"safetensors": ("*.safetensors",), "pt": ("*.bin", "*.pt")}
_DUMMY = "dummy"
# Quantization schemes vLLM reads from the checkpoint (config.json's quantization_config, or one of these files);
# other methods (fp8, bitsandbytes, ...) quantize an unquantized checkpoint while loading.
_CHECKPOINT_SCHEMES = frozenset(("awq", "gptq", "modelopt"))
_QUANT_CONFIG_FILES = ("quant_config.json", "quantize_config.json", "hf_quant_config.json")
_SCHEME_ALIASES = {"marlin": "gptq", "auto": "gptq"}  # marlin kernels serve GPTQ checkpoints; auto-gptq writes "auto"
# Kernels vLLM may pick for checkpoints of several schemes: no mismatch can be told from the names.
_ANY_SCHEME = frozenset(("moe_wna16", "inc", "humming"))
_JINJA_CHARS = "{}\n"  # vLLM takes a --chat-template holding any of these as the template itself
# A chat template with one of these has a reasoning mode: served without a reasoning parser, `</think>` and the
# reasoning text end up in `content` (and Nemotron 3 has hung streaming clients).
# A template that treats the first message as the system message fails or misrenders without one (the field
# reports' KeyError: 'system').
_NEEDS_SYSTEM = re.compile(r"messages\[0\]\[['\"]role['\"]\]\s*!=\s*['\"]system['\"]|messages\[0\]\[['\"]content")
# What vLLM builds the rotary embedding from (see effective_rope_theta); a flat rope_theta override does nothing.
_ROPE_OVERRIDE = '--hf-overrides \'{"rope_parameters": {"rope_theta": N}}\''
_REASONING_MARKERS = ("<think>", "enable_thinking", "/no_think", "detailed thinking")


@dataclass(frozen=True)
class _Files:
    tokenizer_dir: Path
    tokenizer_config: dict[str, Any]


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resolve_model(model: str, hub_cache: Path) -> Path | None:
    """A local directory as given, or the cached snapshot of a hub id (`org/name`), else None."""
    local = Path(model).expanduser()
    if local.exists() or model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return local
    repo = hub_cache / f"models--{model.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / revision
    return snapshot if snapshot.is_dir() else None


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a multimodal config (`text_config` / `llm_config`), else the config."""
    for key in ("text_config", "llm_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and any(k in sub for k in _LENGTH_KEYS):
            return sub
    return config


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_scaling (transformers 4) or rope_parameters (transformers 5), flattened to one dict."""
    found = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(found, dict) and found and all(isinstance(v, dict) for v in found.values()):
        return dict(next(iter(found.values())))  # per-layer-type parameters: vLLM assumes they agree
    return dict(found) if isinstance(found, dict) else {}


def derived_max_len(config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> int | None:
    """The longest context vLLM allows for this config (None if the config names no length)."""
    text = _text_config(config)
    lengths = [v for k in _LENGTH_KEYS if isinstance(v := text.get(k), int | float) and not isinstance(v, bool)]
    if not lengths:
        return None
    derived = float(min(lengths))
    rope = _rope(text)
    rope_type = rope.get("rope_type") or rope.get("type")
    if rope_type and rope_type not in _UNSCALED_ROPE and "gemma3" not in str(text.get("model_type", "")):
        if rope_type == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
            derived = float(rope["original_max_position_embeddings"])
        factor = rope.get("factor", 1.0)
        derived *= float(factor) if isinstance(factor, int | float) else 1.0
    model_max = tokenizer_config.get("model_max_length")
    if isinstance(model_max, int | float) and not isinstance(model_max, bool):
        derived = min(derived, float(model_max))
    return int(derived)


def _weights(path: Path, load_format: str | None) -> Check:
    row = rows.MODEL_DIRECTORY
    if load_format == _DUMMY:
        return passed(row, f"{path}: no weights read (--load-format dummy: random weights)")
    globs = _FORMAT_GLOBS.get(load_format or "", _WEIGHT_GLOBS)
    weights = [p for glob in globs for p in path.glob(glob)]
    if not weights:
        if load_format in _FORMAT_GLOBS:
            measured = f"{path}: no {', '.join(globs)} files for --load-format {load_format}"
            return failed(row, measured, "finish the download, or drop --load-format")
        return failed(row, f"{path}: no weight files (*.safetensors, *.bin)", "finish the download")
    index = _load_json(path / "model.safetensors.index.json")
    shards = set(index.get("weight_map", {}).values()) if index else set()
    missing = sorted(s for s in shards if not (path / s).exists())
    if missing:
        measured = f"{path}: {len(missing)} of {len(shards)} shards missing ({missing[0]}…)"
        return failed(row, measured, "re-run the download (huggingface-cli download …)")
    total = (index or {}).get("metadata", {}).get("total_size")
    size = total if isinstance(total, int) else sum(p.stat().st_size for p in weights if p.exists())
    return passed(row, f"{path}: {len(weights)} weight file(s), {gib(size)}")


def apply_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """config.json as vLLM sees it with `--hf-overrides`: a key replaces the config's value, except that a nested
    model config (text_config, llm_config, ...) is updated key by key."""
    merged = dict(config)
    for key, value in overrides.items():
        current = merged.get(key)
        nested = key.endswith("_config") and key != "quantization_config"
        if nested and isinstance(current, dict) and isinstance(value, dict):
            merged[key] = apply_overrides(current, value)
        else:
            merged[key] = value
    return merged


def _scheme(method: str) -> str:
    family = method.lower().replace("-", "_").split("_")[0]
    return _SCHEME_ALIASES.get(family, family)


def _checkpoint_scheme(config: Mapping[str, Any]) -> str | None:
    """The quantization scheme the checkpoint declares (config.json or its text_config), as vLLM reads it."""
    text = config.get("text_config")
    for holder in (config, text if isinstance(text, dict) else {}):
        for key in ("quantization_config", "compression_config"):
            found = holder.get(key)
            if isinstance(found, dict) and found.get("quant_method"):
                return str(found["quant_method"])
    return None


def _model_config(path: Path, config: Mapping[str, Any], flags: ModelFlags) -> Check:
    """config.json parsed; with --quantization, the checkpoint must be of that scheme (vLLM refuses otherwise)."""
    row = rows.MODEL_CONFIG
    measured = f"{config.get('model_type', '?')}: {config.get('architectures')}"
    if flags.hf_overrides_error is not None:
        fix = "pass --hf-overrides a JSON object, e.g. '{\"rope_theta\": 10000}'"
        return failed(row, f"{measured}; {flags.hf_overrides_error}", fix)
    if flags.hf_overrides:
        measured += f"; --hf-overrides {', '.join(sorted(flags.hf_overrides))}"
    method = flags.quantization
    if method is None:
        return passed(row, measured)
    declared = _checkpoint_scheme(config)
    if declared is not None:
        measured += f"; --quantization {method} on a {declared} checkpoint"
        if method in _ANY_SCHEME or _scheme(method) == _scheme(declared):
            return passed(row, measured)
        fix = f"drop --quantization (vLLM reads {declared} from config.json), or serve a {method} checkpoint"
        return failed(row, measured, fix)
    files = [f.name for f in path.glob("*.json") if f.name.endswith(_QUANT_CONFIG_FILES)]
    from_overrides = any(k in flags.hf_overrides for k in ("quantization_config_file", "quantization_config_dict_json"))
    if _scheme(method) in _CHECKPOINT_SCHEMES and not files and not from_overrides:
        measured += f"; --quantization {method}, but the checkpoint is not quantized (no quantization_config)"
        fix = f"point --model at a {method} checkpoint, or use a profile without --quantization (awq sets it)"
        return failed(row, measured, fix)
    return passed(row, f"{measured}; --quantization {method}" + (f" ({files[0]})" if files else ""))


def _tokenizer(files: _Files) -> Check:
    row = rows.TOKENIZER
    present = [f for f in _TOKENIZER_FILES if (files.tokenizer_dir / f).exists()]
    present += [p.name for p in files.tokenizer_dir.glob("*.tiktoken")]
    if not present:
        fix = "copy the tokenizer files in, or pass --tokenizer with the base model (AWQ repos often lack them)"
        return failed(row, f"no tokenizer files in {files.tokenizer_dir}", fix)
    if not files.tokenizer_config:
        return warned(row, f"{', '.join(present)}; no tokenizer_config.json", "add the base model's")
    kind = files.tokenizer_config.get("tokenizer_class", "?")
    return passed(row, f"{', '.join(present)} ({kind})")


def chat_template_text(tokenizer_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The default chat template: tokenizer_config.json, chat_template.jinja or chat_template.json."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str) and template.strip():
        return template
    try:
        return (tokenizer_dir / "chat_template.jinja").read_text()
    except OSError:
        pass
    separate = _load_json(tokenizer_dir / "chat_template.json") or {}
    found = separate.get("chat_template")
    return found if isinstance(found, str) and found.strip() else None


def suggested_preset(config: Mapping[str, Any], path: Path) -> Preset | None:
    """The shipped model preset for this checkpoint's architecture, if one fits (named in the doctor's fixes)."""
    architectures = config.get("architectures") or [""]
    arch = str(architectures[0]) if isinstance(architectures, list) and architectures else ""
    name = None
    if arch == "NemotronHForCausalLM":
        # Nemotron 3 Nano is the mixture-of-experts one; Nano-9B-v2 is dense.
        name = "nemotron-3-nano" if config.get("n_routed_experts") else "nemotron-nano-9b-v2"
    elif arch == "NemotronForCausalLM":
        name = "nemotron-mini-4b"
    elif arch == "DeciLMForCausalLM":
        name = "llama-nemotron-super-49b"
    elif arch == "LlamaForCausalLM" and "nemotron" in str(path).lower():
        name = "llama-nemotron-nano-8b"
    return load_presets().get(name) if name else None


def _preset_fix(preset: Preset | None, flag: str) -> str:
    """`; or serve with --preset X (sets --flag V)` when the suggested preset sets that flag."""
    if preset is None or flag not in preset.flags:
        return ""
    value = preset.flags[flag]
    shown = Path(str(value)).name if flag == "chat-template" else value
    return f"; or serve with --preset {preset.name} (sets --{flag} {shown})"


def _chat_template(
    tokenizer_dir: Path, tokenizer_config: Mapping[str, Any], override: str | Path | None, preset: Preset | None
) -> tuple[Check, str | None]:
    row = rows.CHAT_TEMPLATE
    if override is not None:
        try:
            text = Path(override).read_text()
        except OSError as exc:
            if isinstance(override, str) and any(c in override for c in _JINJA_CHARS):
                return passed(row, f"given inline to --chat-template ({len(override)} characters)"), override
            return failed(row, f"--chat-template {override}: {exc.strerror}", "pass an existing file"), None
        return passed(row, f"{override} ({len(text)} characters)"), text
    found = chat_template_text(tokenizer_dir, tokenizer_config)
    if found is None:
        fix = "pass --chat-template: vLLM answers chat requests 400 without" + _preset_fix(preset, "chat-template")
        return warned(row, "none in tokenizer_config.json, chat_template.jinja or .json", fix), None
    measured = f"from the tokenizer ({len(found)} characters)"
    if _NEEDS_SYSTEM.search(found):
        fix = (
            "keep the gateway's default system message on (NEMOTRON_INJECT_SYSTEM_MESSAGE), or pass a --chat-template "
            "that works without one" + _preset_fix(preset, "chat-template")
        )
        return warned(row, f"{measured}; it takes messages[0] to be the system message", fix), found
    return passed(row, measured), found


def _bos_content(tokenizer_config: Mapping[str, Any]) -> str | None:
    bos = tokenizer_config.get("bos_token")
    if isinstance(bos, dict):
        bos = bos.get("content")
    return bos if isinstance(bos, str) and bos else None


def _post_processor_adds(tokenizer_json: Path, bos: str) -> bool | None:
    """Whether tokenizer.json's post-processor puts `bos` first (None: no tokenizer.json or no template)."""
    data = _load_json(tokenizer_json)
    processor = data.get("post_processor") if data else None
    stack = [processor]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and node.get("type") == "TemplateProcessing":
            first = (node.get("single") or [{}])[0]
            return bool(isinstance(first, dict) and first.get("SpecialToken", {}).get("id") == bos)
        if isinstance(node, dict):
            stack.extend(node.get("processors") or [])
    return None if processor is None else False


def check_bos(bos: str | None, add_bos_token: bool | None, template: str | None, preset: Preset | None = None) -> Check:
    """Two BOS tokens (tokenizer adds one, the template writes another) turn Nemotron output into garbage."""
    row = rows.BOS
    if bos is None:
        return passed(row, "the tokenizer has no BOS token")
    writes = 0 if template is None else template.count("bos_token") + template.count(bos)
    template_adds = writes > 0
    measured = f"bos {bos!r}; tokenizer adds it: {add_bos_token}; template writes it: {template_adds}"
    if writes > 1:
        # Every chat prompt starts with two BOS: vLLM tokenizes the rendered prompt without adding its own.
        fix = "serve a --chat-template that writes the BOS once" + _preset_fix(preset, "chat-template")
        return warned(row, f"{measured} ({writes} times: double BOS in every chat prompt)", fix)
    if template_adds and add_bos_token:
        fix = (
            "double BOS wherever the rendered prompt is tokenized with special tokens (/v1/completions with a "
            "templated prompt): serve a --chat-template without the BOS, or set add_bos_token false"
        ) + _preset_fix(preset, "chat-template")
        return warned(row, measured, fix)
    return passed(row, measured)


def check_reasoning_parser(template: str | None, reasoning_parser: str | None, preset: Preset | None = None) -> Check:
    """A chat template with a reasoning mode needs --reasoning-parser, or reasoning leaks into the answer."""
    row = rows.REASONING_PARSER
    if reasoning_parser:
        return passed(row, f"--reasoning-parser {reasoning_parser}")
    found = [marker for marker in _REASONING_MARKERS if template is not None and marker in template]
    if not found:
        return passed(row, "the chat template has no reasoning mode")
    measured = f"the chat template has a reasoning mode ({found[0]!r}) and no --reasoning-parser is given"
    fix = (
        "add --reasoning-parser (nemotron_v3 for Nemotron 3 and Nano-9B-v2, deepseek_r1 for Llama-Nemotron): without "
        "one, </think> and the reasoning land in the answer" + _preset_fix(preset, "reasoning-parser")
    )
    return failed(row, measured, fix)


def _override_theta(overrides: Mapping[str, Any]) -> tuple[str, object] | None:
    """("rope_parameters" | "rope_theta", value) when --hf-overrides sets a rope_theta (top level or text_config)."""
    for holder in (overrides, overrides.get("text_config"), overrides.get("llm_config")):
        if not isinstance(holder, Mapping):
            continue
        nested = holder.get("rope_parameters")
        if isinstance(nested, Mapping) and "rope_theta" in nested:
            return "rope_parameters", nested["rope_theta"]
        if "rope_theta" in holder:
            return "rope_theta", holder["rope_theta"]
    return None


def effective_rope_theta(stored: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[object, Check | None]:
    """The rope_theta vLLM builds the rotary embedding from, and a warning when a flat override is ignored.

    With transformers 5, vLLM's config loader turns config.json's rope_theta into `rope_parameters` before it
    applies --hf-overrides; Nemotron's attention reads `rope_parameters`, so `{"rope_theta": N}` changes nothing
    (tests/unit/doctor/test_rope_override.py shows it on vLLM's own loader). `{"rope_parameters": {"rope_theta":
    N}}` does.
    """
    text = _text_config(stored)
    stored_theta = _rope(text).get("rope_theta", text.get("rope_theta"))
    override = _override_theta(overrides)
    if override is None:
        return stored_theta, None
    kind, value = override
    if kind == "rope_parameters":
        return value, None
    shown = stored_theta if stored_theta is not None else "the default"
    measured = f"--hf-overrides rope_theta {value} is ignored: vLLM reads rope_parameters, which keeps {shown}"
    fix = f'override what vLLM reads: --hf-overrides \'{{"rope_parameters": {{"rope_theta": {value}}}}}\''
    return stored_theta, warned(rows.ROPE_THETA, measured, fix)


def check_rope_theta(value: object) -> Check:
    """A rope_theta stored as a string, or far from any trained value, silently breaks long prompts."""
    row = rows.ROPE_THETA
    if value is None:
        return passed(row, "not set (no RoPE, or the architecture's default)")
    if isinstance(value, bool) or not isinstance(value, int | float):
        fix = f"write rope_theta as a number in config.json, or pass {_ROPE_OVERRIDE}"
        return warned(row, f"{value!r} is not a number", fix)
    low, high = _ROPE_THETA_RANGE
    if not low <= value <= high:
        fix = f"compare with the base model's config.json; override with {_ROPE_OVERRIDE}"
        return warned(row, f"{value:g} is outside the usual {low:g}..{high:g}", fix)
    return passed(row, f"{value:g}")


def check_context_length(derived: int | None, max_model_len: int | None) -> Check:
    """vLLM refuses a --max-model-len above what the config allows (fatal). The preset's context-length sets it,
    a profile's max-model-len caps it, an extra --max-model-len replaces it."""
    row = rows.CONTEXT_LENGTH
    if derived is None:
        return warned(row, "config.json names no context length: vLLM assumes 2048", "pass --max-model-len")
    if max_model_len is None:
        return passed(row, f"model allows {derived}; --max-model-len not given")
    measured = f"--max-model-len {max_model_len}, model allows {derived}"
    if max_model_len > derived:
        fix = (
            f"lower --max-model-len to {derived} or less (the preset's context-length, capped by the profile, or an "
            "extra --max-model-len); VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 forces it, output degrades"
        )
        return failed(row, measured, fix)
    return passed(row, measured)


@dataclass(frozen=True)
class ModelFlags:
    """The engine flags that change what the model directory must hold (see `flags.EngineFlags`)."""

    max_model_len: int | None = None
    tokenizer_dir: Path | None = None  # --tokenizer, resolved; None: the model directory
    chat_template: str | Path | None = None  # --chat-template: a file, or the template itself
    load_format: str | None = None
    quantization: str | None = None
    hf_overrides: Mapping[str, Any] = field(default_factory=dict)
    hf_overrides_error: str | None = None
    reasoning_parser: str | None = None


def check_model_dir(path: Path | None, flags: ModelFlags, *, model: str = "") -> list[Check]:
    """Every model-directory check; `path` None means a hub id (`model`) that is not downloaded yet."""
    rest = rows.MODEL_ROWS[1:]
    if path is None:
        fix = "vLLM downloads it at first start (needs network: see the proxy row); or download it beforehand"
        return [
            warned(rows.MODEL_DIRECTORY, f"{model}: not in the Hugging Face cache", fix),
            *(skipped(r, "model not downloaded") for r in rest),
        ]
    if not path.is_dir():
        fix = "pass --model an existing directory or a hub id (org/name)"
        return [
            failed(rows.MODEL_DIRECTORY, f"{path}: no such directory", fix),
            *(skipped(r, "no model directory") for r in rest),
        ]
    checks = [_weights(path, flags.load_format)]
    stored = _load_json(path / "config.json")
    if stored is None:
        what = "unreadable" if (path / "config.json").exists() else "missing"
        checks.append(failed(rows.MODEL_CONFIG, f"config.json {what}", "copy config.json from the model repo"))
        return [*checks, *(skipped(r, "no config.json") for r in rest[1:])]
    config = apply_overrides(stored, flags.hf_overrides)
    checks.append(_model_config(path, config, flags))
    where = flags.tokenizer_dir or path
    files = _Files(where, _load_json(where / "tokenizer_config.json") or {})
    checks.append(_tokenizer(files))
    preset = suggested_preset(config, path)
    template_check, template = _chat_template(where, files.tokenizer_config, flags.chat_template, preset)
    checks.append(template_check)
    checks.append(check_reasoning_parser(template, flags.reasoning_parser, preset))
    bos = _bos_content(files.tokenizer_config)
    adds = files.tokenizer_config.get("add_bos_token")
    if not isinstance(adds, bool) and bos is not None:
        adds = _post_processor_adds(where / "tokenizer.json", bos)
    checks.append(check_bos(bos, adds if isinstance(adds, bool) else None, template, preset))
    theta, ignored = effective_rope_theta(stored, flags.hf_overrides)
    checks.append(ignored or check_rope_theta(theta))
    checks.append(check_context_length(derived_max_len(config, files.tokenizer_config), flags.max_model_len))
    return checks
