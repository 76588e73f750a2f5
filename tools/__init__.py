"""Development tools of the repository, not shipped in the wheel (which holds gateway, engine_patches and loadtest).

`demo_model` writes the tiny model `make run`, the real-vLLM tests and the load tool's CPU runs serve.
"""
