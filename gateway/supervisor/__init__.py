"""The engine supervisor: runs vLLM under a reaper, judges its liveness, restarts it; and its verbs' runners.

Reads the engine package (profiles, presets, argv, status file) and, for its preflight, the doctor; only the
command line (`gateway.cli` and the `__main__` modules) imports it.
"""
