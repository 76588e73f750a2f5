"""loadtest.idle_cpu: a process tree's CPU over a window, vLLM's processes (and their children) apart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from loadtest.idle_cpu import groups, measure


def test_vllms_processes_are_counted_apart_from_the_rest() -> None:
    # A parent that sleeps, with a busy child whose command line reads as `vllm serve`, which has a child of its own.
    busy = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    busy += "exec('while True: pass')"
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {busy!r}, 'vllm', 'serve']); time.sleep(60)"
    )
    root = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)  # its own group, ended by id
    try:
        deadline = time.monotonic() + 20
        while len(groups(root.pid)["vllm"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = groups(root.pid)
        assert found["ours"] == [root.pid]
        assert len(found["vllm"]) == 2
        result = measure(root.pid, 1.0)
        ours, vllm = result["ours"], result["vllm"]
        assert isinstance(ours, dict) and isinstance(vllm, dict)
        assert ours["core_percent"] < 10 < vllm["core_percent"]
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
