"""The coordinator's handle on one guest process and what it has reported."""

from __future__ import annotations

import contextlib
import json as json_mod
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpuvirt.cli.demo.knobs import QUIET_BLAS


class Guest:
    """One guest process and what it has reported."""

    def __init__(
        self, vf: int, role: str, weight: float, params: dict[str, Any], log: Path
    ) -> None:
        self.vf, self.role, self.weight = vf, role, weight
        self.log = log
        self._log = open(log, "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from gpuvirt.cli.demo.worker import guest_main; "
             "guest_main(sys.argv[1])", json_mod.dumps(params)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env={**os.environ, **QUIET_BLAS},
        )  # fmt: skip
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._buf = b""
        self.attached = False
        self.last: dict[str, Any] = {}
        self.done: dict[str, Any] | None = None
        self.incidents: dict[str, dict[str, Any]] = {}  # kind -> what the guest reported
        self.netgpu_bytes = 0
        self.netgpu_over = False  # the guest's receiver ended: all in, or failed
        self.eof = False

    @property
    def fd(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.eof = True
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                self._on(json_mod.loads(line))

    def _on(self, m: dict[str, Any]) -> None:
        ev = m["ev"]
        if ev == "attached":
            self.attached = True
        elif ev == "progress":
            self.last = m
        elif ev in ("incident", "recovering", "recovered"):
            self.incidents[m["kind"]] = m["info"]
        elif ev == "netgpu":
            self.netgpu_bytes = m["bytes"]
            self.netgpu_over = bool(m.get("final"))
        elif ev == "done":
            self.done = m

    def tell(self, order: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{order}\n".encode())
            self.proc.stdin.flush()

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def finish(self, timeout: float) -> None:
        """Wait for the process; kill it past the timeout. Never leaves it behind."""
        self.close_stdin()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.read()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._log.close()

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""
