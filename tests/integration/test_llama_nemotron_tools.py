"""The Llama-Nemotron presets' tool convention on the installed vLLM's own code, and the Super presets' MTP opt-in
on its speculative-decoding config; no engine is started.

NVIDIA's cookbook serves Llama-Nemotron with vLLM's `llama3_json` tool parser; the presets pair it with the shipped
Llama 3.1 template. vLLM's chat renderer (`safe_apply_chat_template`, what `/v1/chat/completions` runs) must put
the request's tools into the prompt the way that parser reads replies (the function list and the JSON reply
format in the first user message), next to the `detailed thinking` switch the gateway writes; and the parser
must turn a reply in that format into a tool call. `--preset llama-nemotron-nano-8b` itself cannot be served on
the demo tokenizer: vLLM refuses `llama3_json` and `deepseek_r1` on a tokenizer without `<|python_tag|>` and
`<think>` tokens. MTP: Super's published config has an MTP layer vLLM drafts with; Nano 30B-A3B has none and is
refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.engine.presets import load_presets, select_preset
from tests.engine import _vllm
from tests.engine.test_nemotron_presets import WEATHER_TOOL
from tests.procs import REPO_ROOT
from tools import demo_model

# Importing vLLM in this process (its renderer and parser are what is checked) imports torch, which warns of its own
# deprecations. Not the `engine` tier (no `vllm serve`): it runs beside that tier's chain of engine starts.
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CONFIGS = REPO_ROOT / "tests" / "data" / "model-configs"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model.write_demo_model(tmp_path_factory.mktemp("llama") / "model"))


@pytest.mark.parametrize("preset", ["llama-nemotron-nano-8b", "llama-nemotron-super-49b"])
def test_vllm_renders_the_tools_the_way_llama3_json_reads_replies(tokenizer: Any, preset: str) -> None:
    from vllm.renderers.hf import safe_apply_chat_template

    flags = select_preset(load_presets(), preset).flags
    assert flags["tool-call-parser"] == "llama3_json"
    messages = [{"role": "system", "content": "detailed thinking off"}, {"role": "user", "content": "Paris?"}]
    text = safe_apply_chat_template(
        None,  # type: ignore[arg-type]  # only read to find a template; the preset gives it
        tokenizer,
        messages,  # type: ignore[arg-type]
        tools=[WEATHER_TOOL],
        chat_template=Path(str(flags["chat-template"])).read_text(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|start_header_id|>system<|end_header_id|>\n\ndetailed thinking off<|eot_id|>" in text
    user = text.split("<|start_header_id|>user<|end_header_id|>\n\n", 1)[1]
    assert user.startswith("Given the following functions, please respond with a JSON for a function call")
    assert 'Respond in the format {"name": function name, "parameters": dictionary of argument name' in user
    assert user.index('"name": "get_weather"') < user.index("Paris?<|eot_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    plain = safe_apply_chat_template(
        None,  # type: ignore[arg-type]
        tokenizer,
        messages,  # type: ignore[arg-type]
        chat_template=Path(str(flags["chat-template"])).read_text(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "Given the following functions" not in plain


def test_llama3_json_turns_a_reply_in_that_format_into_a_tool_call(tokenizer: Any) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})  # a Llama 3 tokenizer has it
    parser = Llama3JsonToolParser(tokenizer)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER_TOOL])
    found = parser.extract_tool_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}', request)
    assert found.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in found.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


_SPECULATIVE_PROBE = """
import json, sys, warnings
warnings.simplefilter("ignore")
from vllm.config import ParallelConfig
from vllm.engine.arg_utils import EngineArgs
args = EngineArgs(model=sys.argv[1], tokenizer=sys.argv[2], load_format="dummy", max_model_len=4096,
                  speculative_config=json.loads(sys.argv[3]))
try:
    spec = args.create_speculative_config(args.create_model_config(), ParallelConfig())
    print("\\n" + json.dumps({"method": spec.method, "draft": spec.draft_model_config.architecture}))
except Exception as exc:
    print("\\n" + json.dumps({"refused": f"{type(exc).__name__}: {exc}"}))
"""


@pytest.mark.parametrize(
    ("config", "accepted"),
    [
        (CONFIGS / "nvidia-nemotron-3-super-120b-a12b.json", True),
        (REPO_ROOT / "loadtest" / "gpu" / "nemotron-3-nano-30b-a3b.json", False),
    ],
)
def test_the_mtp_opt_in_is_vllms_own_method_for_super(tmp_path: Path, config: Path, accepted: bool) -> None:
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config.read_text())
    tokenizer = demo_model.write_demo_model(tmp_path / "tokenizer")
    speculative = select_preset(load_presets(), "nemotron-3-super-fp8-mtp").flags["speculative-config"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CONFIGURE_LOGGING": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _SPECULATIVE_PROBE, str(model), str(tokenizer), str(speculative)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    if accepted:
        assert verdict == {"method": "mtp", "draft": "NemotronHMTPModel"}, result.stderr[-2000:]
    else:
        assert "Unsupported speculative method: 'mtp'" in verdict["refused"]
