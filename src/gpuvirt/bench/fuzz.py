"""bench fuzz: a million random and mutated mailbox frames at a live host.

One honest tenant (VF0) checks every result throughout; hostile peers on VFs
1-3 send frames over real connections: random words, known ids with random
data, mutations (bit flips) of valid frames, alive replies with wrong nonces,
and, every so often, a frame cut mid-way followed by a disconnect; before
ATTACH, mutated and truncated ATTACH frames. Each peer reads the host's
replies (and answers QUERY_ALIVE) on a thread of its own, as a guest must.
Peers reconnect when the host closes on them, and clear the guard of a VF that
their random REQ_GPU_RESET_ACCESS frames got quarantined.

The host under test runs with `host.max_frames_per_s` raised: the rate limit
is tested on its own (tests/test_untrusted_mailbox.py), and at the default a
million frames would take a quarter of an hour per VF. Reported: frames sent,
seconds, frames confirmed (sent on a connection whose closing marker the host
answered, so it read and handled every one), host alive, honest results
checked and wrong, honest VF resets.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any

import numpy as np

from gpuvirt.bench.common import Result, Target, scratch_host
from gpuvirt.bench.hostile import RawGuest
from gpuvirt.bench.tenants import verified_guest
from gpuvirt.bench.workers import Workers
from gpuvirt.config import parse_token
from gpuvirt.errors import GpuvirtError
from gpuvirt.host.process import HostProcess
from gpuvirt.protocol.mailbox import (
    ALIVE_MARK,
    FRAME_SIZE,
    Attach,
    Frame,
    HostMsg,
    alive_reply,
)

HONEST_VF = 0
HOSTILE = (1, 2, 3)
MARKER = 0xFEEDFACE  # an id the host does not know and the generator never draws
# Frames per write, then a marker: the host answers each frame, and its socket buffer
# (~200 KiB of per-message overhead) holds a few hundred answers, not thousands.
BATCH = 128
KNOWN_IDS = np.array([2, 3, 4, 6, 200, 201, 0, 7, 8, 199, 202, 0xFFFFFFFF], dtype=np.uint32)
RARE_IDS = np.array([1, 5], dtype=np.uint32)  # init access and reset requests: costly, kept rare


def frames(rng: np.random.Generator, n: int) -> bytes:
    """n frames: a quarter random words, the rest known ids with random or mutated data."""
    words = rng.integers(0, 1 << 32, (n, 4), dtype=np.uint32)
    kind = rng.random(n)
    known = kind >= 0.25
    words[known, 0] = rng.choice(KNOWN_IDS, int(known.sum()))
    rare = kind >= 0.99998  # about one a connection: each may start a whole init and fini
    words[rare, 0] = rng.choice(RARE_IDS, int(rare.sum()))
    small = (kind >= 0.25) & (kind < 0.6)  # small data words, as real frames carry
    words[small, 1:] &= 0xFF
    alive = (kind >= 0.6) & (kind < 0.7)  # alive replies with nonces that never match
    words[alive, 0] = 6
    words[alive, 2] = ALIVE_MARK
    flips = np.flatnonzero((kind >= 0.7) & (kind < 0.8))  # one bit flipped anywhere
    bit = rng.integers(0, 128, len(flips))
    words[flips, bit // 32] ^= np.left_shift(np.uint32(1), (bit % 32).astype(np.uint32))
    words[words[:, 0] == MARKER, 0] = 0
    return words.astype("<u4").tobytes()


def _drain(g: RawGuest, markers: threading.Semaphore, closed: threading.Event) -> None:
    """Read the host's replies in bulk, answer QUERY_ALIVE, count the markers' FAILs."""
    buf = b""
    with contextlib.suppress(OSError):
        while chunk := g.sock.recv(1 << 16):
            buf += chunk
            whole = len(buf) - len(buf) % FRAME_SIZE
            words = np.frombuffer(buf[:whole], dtype="<u4").reshape(-1, 4)
            buf = buf[whole:]
            for nonce in words[words[:, 0] == HostMsg.QUERY_ALIVE, 1]:
                g.send(alive_reply(int(nonce)))
            mark = (words[:, 0] == HostMsg.FAIL) & (words[:, 1] == MARKER) & (words[:, 2] == 1)
            for _ in range(int(mark.sum())):
                markers.release()
    closed.set()
    markers.release()  # wake a waiter: nothing more will come


class Peer:
    """One hostile connection to a VF, re-made whenever the host ends it."""

    def __init__(self, hp: HostProcess, vf: int, seed: int) -> None:
        self.hp, self.vf = hp, vf
        self.token = parse_token(hp.token(vf))
        self.rng = np.random.default_rng(seed)
        self.py = random.Random(seed)
        self.sent = 0
        self.confirmed = 0
        self.reconnects = 0
        self.garbage_attaches = 0

    def _connect(self) -> RawGuest:
        while True:
            try:
                return RawGuest.attached(self.hp.socket, self.vf, self.token)
            except ConnectionError:
                self.reconnects += 1
                if self.hp.admin.vf(self.vf)["state"] == "QUARANTINED":
                    with contextlib.suppress(GpuvirtError):
                        self.hp.admin.vf(self.vf, "clear-guard")
                else:  # taken while the host finishes the last session: its next event
                    self.hp.admin.events(after=10**12, vf=self.vf, wait=0.05)

    def _garbage_attach(self) -> None:
        data = bytearray(Attach(self.vf, self.token).encode())
        data[self.py.randrange(len(data))] ^= 1 << self.py.randrange(8)
        with RawGuest(self.hp.socket) as g, contextlib.suppress(OSError):
            g.send_raw(bytes(data[: self.py.randint(1, len(data))]))
            g.sock.shutdown(1)
            while g.recv() is not None:
                pass
        self.garbage_attaches += 1

    def run(self, quota: int) -> None:
        while self.sent < quota:
            if self.py.random() < 0.05:
                self._garbage_attach()
            g = self._connect()
            markers, closed = threading.Semaphore(0), threading.Event()
            reader = threading.Thread(target=_drain, args=(g, markers, closed), daemon=True)
            reader.start()
            try:
                for _ in range(self.py.randint(1, 64)):
                    n = min(BATCH, quota - self.sent)
                    if n <= 0:
                        break
                    # A marker after each batch: everything before it was read and handled
                    # once its FAIL is back, and the host's replies never pile up unread.
                    g.send_raw(frames(self.rng, n) + Frame(MARKER).encode())
                    self.sent += n
                    markers.acquire(timeout=60)
                    if closed.is_set():
                        break
                    self.confirmed += n
                if self.py.random() < 0.5:  # and end mid-frame
                    g.send_raw(self.rng.bytes(self.py.randint(1, FRAME_SIZE - 1)))
            except OSError:
                pass  # the host closed on us (a fini in the garbage, say): reconnect
            finally:
                g.close()
                reader.join(30)


def run(quick: bool = False, backend: str = "emu", frames: int | None = None) -> Result:
    total = frames if frames is not None else (20_000 if quick else 1_000_000)
    seed = random.SystemRandom().getrandbits(32)
    host = {"max_frames_per_s": 10_000_000}
    with scratch_host(host=host, device={"backend": backend}, sriov={"vf_num": 4}) as hp:
        with Workers() as w:
            w.start(verified_guest, str(hp.socket), HONEST_VF, hp.token(HONEST_VF), seed)
            w.wait_ready()
            peers = [Peer(hp, vf, seed + vf) for vf in HOSTILE]
            share = -(-total // len(peers))
            t0 = time.monotonic()
            threads = [threading.Thread(target=p.run, args=(share,)) for p in peers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.monotonic() - t0
            alive = hp.alive()
            reports = w.stop() if alive else [None]
        honest_flrs = hp.admin.vf(HONEST_VF)["flr_count"] if alive else None
    report: dict[str, Any] = reports[0] or {
        "checked": 0, "wrong": 0, "errors": ["the honest tenant sent no report"], "resets": 0,
    }  # fmt: skip
    sent = sum(p.sent for p in peers)
    figures = {
        "frames_sent": sent,
        "frames_confirmed": sum(p.confirmed for p in peers),
        "seconds": round(seconds, 1),
        "frames_per_s": round(sent / seconds) if seconds else 0,
        "garbage_attaches": sum(p.garbage_attaches for p in peers),
        "reconnects": sum(p.reconnects for p in peers),
        "host_alive": alive,
        "host_crashes": 0 if alive else 1,
        "results_checked": report["checked"],
        "results_wrong": report["wrong"],
        "honest_errors": len(report["errors"]),
        "honest_flrs": honest_flrs,
        "seed": seed,
    }
    rows = [(k.replace("_", " "), v, "") for k, v in figures.items()]
    targets = [
        Target("host_crashes", figures["host_crashes"], 0, "<="),
        Target("frames_sent", sent, total, ">="),
        Target("results_wrong", report["wrong"], 0, "<="),
        Target("results_checked", report["checked"], 1, ">="),
        Target("honest_errors", len(report["errors"]), 0, "<="),
        Target("honest_flrs", honest_flrs if honest_flrs is not None else 1, 0, "<="),
    ]
    return Result("fuzz", backend, figures, targets, rows, report["errors"][:5])
