"""vLLM plugin loaded inside the engine process (entry point `vllm.general_plugins`); never imported by the gateway.

`plugin.register` is what vLLM calls; `toolcall` holds the `nemotron_json` tool parser; `templates/` the chat
templates the model presets pass with `--chat-template`. This package imports nothing on import.
"""
