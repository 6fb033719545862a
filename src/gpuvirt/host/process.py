"""Run a host daemon as a child process: for the demo, the benchmarks and the tests.

The child is a real `gpuvirt host`; readiness is its "gpuvirt host: mailbox …"
line on stdout, printed only once the mailbox and admin endpoint listen.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuvirt.admin_client import AdminClient
from gpuvirt.config import HostConfig, load_or_create_token
from gpuvirt.errors import GpuvirtError

READY_PREFIX = "gpuvirt host: mailbox"


class HostProcess:
    def __init__(
        self, config: HostConfig, workdir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.config = config
        self.workdir = workdir
        self.config_path = workdir / "gpuvirt.toml"
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.log = workdir / "host.log"
        self.socket = config.host.socket_path()
        self.admin = AdminClient.of(config.host)

    def start(self, timeout: float = 120.0) -> HostProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config.dump_toml())
        self._log = open(self.log, "w")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuvirt", "host", "--config", str(self.config_path)],
            stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, **self.env}, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                self.stop()
                raise GpuvirtError(f"host did not become ready in {timeout} s; see {self.log}")
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise GpuvirtError(
                    f"host exited with {code} before it was ready:\n{self.log.read_text()[-3000:]}"
                )
            if line.startswith(READY_PREFIX):
                return self

    def token(self, vf: int) -> str:
        plan = self.config.vf_layout()[vf]
        return load_or_create_token(plan.token_file).hex()

    def status(self) -> dict[str, Any]:
        return self.admin.status()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> HostProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
