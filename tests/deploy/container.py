"""A real systemd as PID 1 of its own Debian root: `systemd-nspawn --boot` on scripts/deploy-root's root.

Never systemd on the host's own filesystem (its boot-time tmpfiles clean-up would empty the host's /tmp):
the root is the cached debootstrap tree under .cache/, booted with `--volatile=overlay`, so whatever the
test installs lives in a tmpfs layer and is gone when the container stops. `--private-network` gives the
container its own loopback, so its Redis, engine, gateway and nginx take their usual ports. Commands run
inside through `nsenter` into the container's namespaces (the host runs no systemd-machined).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from tests.procs import wait_until

# The container's own PATH: nsenter keeps the caller's environment otherwise.
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Container:
    """One booted container; `with Container(root, binds) as c: c.run("systemctl ...")`, powered off on exit."""

    def __init__(self, root: Path, binds: Sequence[tuple[Path, str]] = ()) -> None:
        self.root = root
        self.binds = list(binds)
        self.name = f"nemotron-{uuid.uuid4().hex[:8]}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="nspawn-", suffix=".log")[1])
        self.leader = 0

    def __enter__(self) -> Self:
        # `with` calls __exit__ only after __enter__ returned: a failed boot must not leave nspawn running.
        try:
            return self.boot()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def boot(self, timeout: float = 120.0) -> Self:
        argv = ["systemd-nspawn", "--boot", "--keep-unit", "--register=no", "--private-network"]
        argv += ["--volatile=overlay", "--console=passive", f"--machine={self.name}", "-D", str(self.root)]
        argv += [f"--bind-ro={host}:{inside}" for host, inside in self.binds]
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.leader = wait_until(self._find_leader, timeout=30, message=f"nspawn started no init:\n{self.log()}")
        # `is-system-running --wait` blocks until start-up finished; "degraded" still means systemd runs. Asked before
        # systemd's bus is up (a loaded machine), it answers "offline" at once: not yet, ask again.
        state = wait_until(
            lambda: self._system_state(timeout),
            timeout=timeout,
            message=f"the container's systemd did not come up:\n{self.log()}",
        )
        assert state in ("running", "degraded"), f"systemd in the container is {state!r}:\n{self.log()}"
        return self

    def _system_state(self, timeout: float) -> str | None:
        state = self.run("systemctl is-system-running --wait", check=False, timeout=timeout).stdout.strip()
        return None if state in ("", "offline") else state

    def _find_leader(self) -> int | None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise RuntimeError(f"systemd-nspawn exited with {self._proc.returncode}:\n{self.log()}")
        children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children").read_text().split()
        for child in children:
            try:
                name = Path(f"/proc/{child}/comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):  # a helper that exited since the listing
                continue
            if name == "systemd":
                return int(child)
        return None

    def run(
        self, command: str, *, check: bool = True, timeout: float = 120.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`command` (a shell line) inside the container as root; raises with its output when it fails."""
        argv = ["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "-C", "--root", "--wd"]
        argv += ["/usr/bin/env", "-i", f"PATH={_PATH}", "LANG=C.UTF-8", "/bin/sh", "-c", command]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise AssertionError(
                f"in the container: {command}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def show(self, unit: str, prop: str) -> str:
        return self.run(f"systemctl show -P {shlex.quote(prop)} {shlex.quote(unit)}").stdout.strip()

    def journal(self, unit: str, lines: int = 80) -> str:
        return self.run(f"journalctl -u {shlex.quote(unit)} -n {lines} --no-pager", check=False).stdout

    def log(self) -> str:
        return self._log.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 60.0) -> None:
        """Power off (SIGTERM to nspawn asks the container's systemd to shut down), SIGKILL past `timeout`."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._log.unlink(missing_ok=True)


def nspawn_usable() -> str | None:
    """Why this machine cannot run the tier (None when it can). scripts/deploy-root installs debootstrap and
    systemd-nspawn from Debian's packages when they are missing, which needs root as booting does."""
    if os.geteuid() != 0:
        return "needs root (debootstrap, systemd-nspawn)"
    if shutil.which("apt-get") is None and shutil.which("systemd-nspawn") is None:
        return "needs systemd-nspawn (Debian's systemd-container) or apt-get to install it"
    return None
