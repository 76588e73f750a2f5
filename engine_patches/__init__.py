"""vLLM plugin loaded inside the engine process (entry point `vllm.general_plugins`); never imported by the gateway."""
