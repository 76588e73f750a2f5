"""nemotron-gateway: the production front door for a Nemotron model served by vLLM."""

__version__ = "0.1.0"
