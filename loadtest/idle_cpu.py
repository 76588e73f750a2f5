"""`python -m loadtest.idle_cpu PID`: the CPU a process tree spends over a window, ours apart from vLLM's.

Reads /proc/<pid>/stat (user + system time) of every descendant of PID at the start and the end of the window,
and sums it in two groups: vLLM's own processes (its API server, engine core, and whatever they start) and the
rest (for `nemotron-gateway up`: the supervisor, its process-group reapers, the gateway's pool parent and its
workers). Prints one JSON object: each group's share of one core, and the processes it counted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from loadtest.gpu.sweep import children_by_parent, command_line, role_of
from loadtest.processes import cpu_seconds

_VLLM_ROLES = ("vllm-api", "engine-core")


def groups(root: int) -> dict[str, list[int]]:
    """`root` and its descendants, as {"ours": [...], "vllm": [...]}: a vLLM process's descendants are vLLM's."""
    tree = children_by_parent()
    found: dict[str, list[int]] = {"ours": [], "vllm": []}
    todo = [(root, False)]
    while todo:
        pid, in_vllm = todo.pop()
        in_vllm = in_vllm or role_of(command_line(pid)) in _VLLM_ROLES
        found["vllm" if in_vllm else "ours"].append(pid)
        todo.extend((child, in_vllm) for child in tree.get(pid, ()))
    return found


def _spent(pids: list[int]) -> dict[int, float]:
    spent = {}
    for pid in pids:
        try:
            user, system = cpu_seconds(pid)
        except OSError:
            continue  # gone meanwhile
        spent[pid] = user + system
    return spent


def measure(root: int, seconds: float) -> dict[str, object]:
    """Each group's CPU over `seconds`, as a percentage of one core, with its process count, and each busy
    process's share (`by_process`: command line and percentage, the busiest first)."""
    found = groups(root)
    every = [pid for pids in found.values() for pid in pids]
    before = _spent(every)
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    after = _spent(every)
    share = {pid: 100 * (after[pid] - before[pid]) / wall for pid in after if pid in before}
    result: dict[str, object] = {"seconds": round(wall, 1)}
    for name, pids in found.items():
        result[name] = {"processes": len(pids), "core_percent": round(sum(share.get(pid, 0.0) for pid in pids), 2)}
    busy = sorted((pid for pid in share if share[pid] > 0), key=lambda pid: -share[pid])
    result["by_process"] = [[pid, command_line(pid)[:80].strip(), round(share[pid], 2)] for pid in busy]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, measure, print the JSON object."""
    parser = argparse.ArgumentParser(prog="loadtest.idle_cpu", description=__doc__)
    parser.add_argument("pid", type=int, help="the root of the tree (e.g. `nemotron-gateway up`'s pid)")
    parser.add_argument("--seconds", type=float, default=30.0, help="the window (default 30)")
    args = parser.parse_args(argv)
    sys.stdout.write(json.dumps(measure(args.pid, args.seconds)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
