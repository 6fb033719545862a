"""The network side of the NetGPU part of the demo."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import socket
import threading
import time

from gpuvirt.cli.demo.knobs import ATTACH_TIMEOUT_S, NETGPU_CHUNK


def netgpu_available() -> str | None:
    """None when NetGPU can be shown, else why not."""
    # pool imports rx only when a receive starts; a build with one and not the
    # other would fail mid-demo instead of saying so here.
    for module in ("gpuvirt.netgpu.pool", "gpuvirt.netgpu.rx"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not in this build"
    return None


class StreamSender(threading.Thread):
    """The network side of the NetGPU demo: one TCP stream of seeded bytes, paced."""

    def __init__(self, total: int, rate: float, seed: int) -> None:
        super().__init__(name="demo-netgpu-sender", daemon=True)
        self.total, self.rate, self.seed = total, rate, seed
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(ATTACH_TIMEOUT_S)
        self.addr = self.srv.getsockname()[:2]
        self.sent = 0
        self.sha256 = ""
        self.error: str | None = None
        self._abort = threading.Event()

    def abort(self) -> None:
        """Stop sending (the receiver gave up); unblocks a pending accept too."""
        self._abort.set()
        with contextlib.suppress(OSError):
            self.srv.shutdown(socket.SHUT_RDWR)  # wakes the accept(); close() alone need not

    def run(self) -> None:
        import numpy as np

        rng = np.random.default_rng(self.seed)
        h = hashlib.sha256()
        try:
            conn, _ = self.srv.accept()
            with conn:
                t0 = time.monotonic()
                while self.sent < self.total and not self._abort.is_set():
                    chunk = rng.bytes(min(NETGPU_CHUNK, self.total - self.sent))
                    conn.sendall(chunk)
                    h.update(chunk)
                    self.sent += len(chunk)
                    ahead = self.sent / self.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)  # pacing: the stream's rate, not a wait for anything
                conn.shutdown(socket.SHUT_WR)
        except OSError as e:
            if not self._abort.is_set():
                self.error = f"sender: {e}"
        finally:
            self.srv.close()
            self.sha256 = h.hexdigest()
