"""The supervisors of several engine replicas in one process: each runs on its own, a stop reaches them all.

One replica's crash, restart, backoff or crash budget is its own: the others never notice. A replica that spends its
crash budget stays FAILED while the others serve (under systemd, a template instance per replica lets systemd restart
that one alone). A preflight refusal is about the configuration all replicas share, so it stops them all. Imports
the supervisor only.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence

from gateway.supervisor.supervisor import EngineSupervisor

# EngineSupervisor.run()'s code for a start the preflight refused.
_REFUSED = 2


class ReplicaSet:
    """Runs every replica's supervisor at once; `run()` returns the worst of their exit codes once all have ended."""

    def __init__(self, supervisors: Sequence[EngineSupervisor]) -> None:
        """`supervisors`: one per replica this process runs, at least one."""
        if not supervisors:
            raise ValueError("a replica set needs at least one supervisor")
        self.supervisors = list(supervisors)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT ask every replica for a clean stop; a second one forces it."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_exit)

    def handle_exit(self) -> None:
        """Record a stop request in every replica's supervisor (each loop acts on it)."""
        for supervisor in self.supervisors:
            supervisor.handle_exit()

    async def run(self) -> int:
        """Supervise every replica until each has ended: 0 when all stopped, else the highest exit code."""
        tasks = [
            asyncio.create_task(supervisor.run(), name=f"supervisor-{supervisor.name}")
            for supervisor in self.supervisors
        ]
        pending: set[asyncio.Task[int]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(task.result() == _REFUSED for task in done):
                for supervisor in self.supervisors:
                    if not supervisor.should_exit.is_set():  # a second request would force the stop
                        supervisor.handle_exit()
        return max(task.result() for task in tasks)
