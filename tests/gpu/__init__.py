"""Functional checks of a running stack on a GPU machine: the APIs and the model presets through the gateway.

`loadtest/gpu/run presets` runs them there (`python3 tests/gpu/apis.py`, `python -m tests.gpu.presets`), beside the
benchmarks that stay in loadtest/gpu/; `tests/gpu/test_stack_checks.py` runs the same checks under pytest (marker
`gpu`) against a gateway named by NEMOTRON_TEST_GATEWAY_URL, and is skipped without one. They import nothing of the
gateway: the GPU machine runs them with the standard library (apis.py) or httpx (presets.py) alone.
"""
