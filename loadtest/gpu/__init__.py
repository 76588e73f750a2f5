"""The GPU proof: scripts that carry vLLM to the GPU machine and measure there (see README.md here)."""
