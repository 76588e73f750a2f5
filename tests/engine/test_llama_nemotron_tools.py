"""The Llama-Nemotron presets' tool convention on the real CPU engine, one `vllm serve` start: `--preset
llama-nemotron-nano-8b` unchanged serves vLLM's `llama3_json` tool parser (NVIDIA's cookbook) with the shipped
Llama 3.1 template, which renders the request's tools the way that parser reads replies (the function list and
the JSON reply format in the first user message), next to the `detailed thinking` switch. And the installed
vLLM's own speculative-decoding config: the Super presets' MTP opt-in finds the MTP layer of Super's published
config, and Nano 30B-A3B, which has none, is refused.

The rendered prompt is read back as in test_nemotron_presets.py: `return_token_ids`, then the engine's /detokenize.
The demo model stands in for the Llama architecture: the template and the parsers are what is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import demo_model
from gateway.supervisor.presets import load_presets, select_preset
from tests.engine import _vllm
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import running_up, up_settings
from tests.engine.test_nemotron_presets import WEATHER_TOOL, Stack
from tests.procs import REPO_ROOT, free_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

STATE_DIR = CACHE_ROOT / "engine-tests-llama-tools"
CONFIGS = REPO_ROOT / "tests" / "data" / "model-configs"


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    model = demo_model.write_demo_model(tmp_path_factory.mktemp("llama-tools") / "model")
    engine_port, gateway_port = free_port(), free_port()
    env = up_settings(model, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=STATE_DIR)
    env.update({"NEMOTRON_RELAY__GENERATION_PROBE_TIMEOUT": "60", "NEMOTRON_INJECT_SYSTEM_MESSAGE": "false"})
    with running_up(env, "--preset", "llama-nemotron-nano-8b", key_prefix="llama-tools") as (proc, key):
        yield Stack(proc, f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", key, Path(model))


def test_the_engine_runs_the_cookbooks_tool_parser(stack: Stack) -> None:
    log = stack.proc.log_text()
    assert "--tool-call-parser llama3_json" in log and "--enable-auto-tool-choice" in log
    assert "llama-nemotron.jinja" in log


def test_the_tools_and_the_switch_reach_the_rendered_prompt(stack: Stack) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    _, text = stack.rendered_prompt(messages=messages, tools=[WEATHER_TOOL], reasoning_effort="none")
    assert "detailed thinking off" in text
    user = text.split("<|start_header_id|>user<|end_header_id|>\n\n", 1)[1]
    assert user.startswith("Given the following functions, please respond with a JSON for a function call")
    assert 'Respond in the format {"name": function name, "parameters": dictionary of argument name' in user
    assert '"name": "get_weather"' in user
    assert user.index('"name": "get_weather"') < user.index("Weather in Paris?")


def test_without_tools_the_prompt_has_no_function_list(stack: Stack) -> None:
    _, text = stack.rendered_prompt(messages=[{"role": "user", "content": "Hi"}])
    assert "Given the following functions" not in text


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
    [("nvidia-nemotron-3-super-120b-a12b.json", True), ("../../../loadtest/gpu/nemotron-3-nano-30b-a3b.json", False)],
)
def test_the_mtp_opt_in_is_vllms_own_method_for_super(tmp_path: Path, config: str, accepted: bool) -> None:
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / config).read_text())
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
