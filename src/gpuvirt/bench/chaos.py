"""bench chaos: eight VFs, four honest tenants checking every result, four VFs under attack.

DESIGN.md, "Reliability". VFs 0-3 run verified workloads (bench/tenants.py:
matmuls checked against numpy) for the whole run; a fault injector attacks VFs
4-7 one fault at a time, in random order, every kind once before any kind again
(`deal`; a run lasts one such pass at least, so even a short one meets each
kind): SIGKILL of an engine or of a guest that filled its FB with a pattern,
hung kernels, a guest's ftruncate of its FB, garbage before and after ATTACH,
frames cut mid-way, LOG_VF_ERROR and connection floods, FLR storms that trip the
guard (then clear-guard), disable/enable and admin resets. After a guest is
killed, the next tenant of its VF counts the FB bytes that are not zero.

A fault is survived when the host is still up and the fault had the effect it
should (EPERM for ftruncate, a reset for a hang, quarantine for a storm, the
next tenant reading zeros). JSON keys (DESIGN.md): faults_injected,
faults_survived, faults_by_kind, results_checked, results_wrong, bytes_leaked,
vfs_stuck, host_rss_start_mib, host_rss_end_mib; beside them honest_vfs_lost
(an honest VF reset or errored), honest_errors, minutes, and host_rss_by_minute_mib
(the RSS at the start of each minute, to tell warming up from a leak).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import select
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpuvirt.bench.common import Result, Target, scratch_host
from gpuvirt.bench.hostile import RawGuest
from gpuvirt.bench.tenants import leaked_bytes, pattern_guest, verified_guest
from gpuvirt.bench.workers import Workers, hang
from gpuvirt.config import parse_token
from gpuvirt.errors import GpuvirtError
from gpuvirt.host.process import HostProcess
from gpuvirt.protocol.mailbox import Attach, Frame, GuestMsg

HONEST = (0, 1, 2, 3)
HOSTILE = (4, 5, 6, 7)
SETTLE_S = 60.0  # how long a hostile VF may take to come back before it counts as stuck
PATTERN_BYTES = 4 << 20
MiB = 1 << 20


# The faults, each an Injector method of that name.
KINDS = (
    "sigkill_engine", "sigkill_guest", "hung_kernel", "guest_ftruncate", "garbage_attach",
    "garbage_frames", "mid_frame_disconnect", "log_flood", "connection_flood", "flr_storm",
    "enable_disable", "admin_reset",
)  # fmt: skip


class Injector:
    """One fault at a time at the hostile VFs; each fault returns whether it was survived."""

    def __init__(self, hp: HostProcess, rng: random.Random) -> None:
        self.hp, self.rng = hp, rng
        self.sock = str(hp.socket)
        self.guard = hp.config.reset.guard_count
        self.bytes_leaked = 0
        events = hp.admin.events()
        self.seq = events[-1]["seq"] if events else 0
        self.faults: dict[str, Callable[[int], bool]] = {k: getattr(self, k) for k in KINDS}

    def token(self, vf: int) -> str:
        return self.hp.token(vf)

    def settle(self, vf: int, timeout: float = SETTLE_S) -> bool:
        """Until the VF is AVAIL again (clearing its guard if a storm tripped it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.hp.admin.vf(vf)
            state = status["state"]
            if state == "AVAIL" and status["guest_pid"] is None:
                return True
            if state == "QUARANTINED":
                self.hp.admin.vf(vf, "clear-guard")
                continue
            if state == "UNAVAIL":
                self.hp.admin.vf(vf, "enable")
                continue
            for ev in self.hp.admin.events(after=self.seq, vf=vf, wait=1.0):
                self.seq = max(self.seq, ev["seq"])  # woken by the VF's next event
        return False

    def describe(self, vf: int) -> str:
        """The VF as the admin sees it now, and its last events: why a fault failed."""
        st = self.hp.admin.vf(vf)
        last = [
            f"{e['kind']}: {e['message']}"
            for e in self.hp.admin.events(after=max(0, self.seq - 500), vf=vf)[-4:]
        ]
        return f"state {st['state']}, guest_pid {st['guest_pid']}; last events: {last}"

    def attach_raw(self, vf: int, tries: int = 3) -> RawGuest:
        """A raw guest attached to the VF (the run loop has settled it). The previous
        fault's frames may have asked for a reset (REQ_GPU_RESET_ACCESS) that the host
        starts after its connection is gone, so a VF seen AVAIL may still refuse the
        attach: settle again, then retry."""
        token = parse_token(self.token(vf))
        for _ in range(tries - 1):
            with contextlib.suppress(ConnectionError):
                return RawGuest.attached(self.sock, vf, token)
            self.settle(vf)
        return RawGuest.attached(self.sock, vf, token)

    # ---- the faults --------------------------------------------------------------------

    def wait_event(self, vf: int, kinds: tuple[str, ...], timeout: float = SETTLE_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.hp.admin.events(after=self.seq, vf=vf, wait=1.0):
                self.seq = max(self.seq, ev["seq"])
                if ev["kind"] in kinds:
                    return True
        return False

    def catch_up(self) -> None:
        """Past every event so far: what wait_event sees next is the next fault's doing."""
        while events := self.hp.admin.events(after=self.seq):
            self.seq = max(self.seq, events[-1]["seq"])

    def sigkill_engine(self, vf: int) -> bool:
        # kill() returns before the engine is dead, so until its pidfd says so the VF
        # still looks AVAIL; and an FLR an earlier fault left in the log is not this one.
        self.catch_up()
        pid = self.hp.admin.vf(vf)["engine_pid"]
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False  # the engine of a settled VF is gone: the host missed a death
        try:
            os.kill(pid, signal.SIGKILL)
            if not select.select([pidfd], [], [], SETTLE_S)[0]:
                return False
        finally:
            os.close(pidfd)
        # The host notices the death and resets the VF: a fresh engine, or quarantine
        # when the earlier faults' FLRs have filled the guard's window.
        return self.wait_event(vf, ("flr.done", "guard.trip")) and self.settle(vf)

    def sigkill_guest(self, vf: int) -> bool:
        with Workers() as w:
            w.start(pattern_guest, self.sock, vf, self.token(vf), PATTERN_BYTES)
            w.wait_ready()
            w.kill()  # SIGKILL, mid-session
        if not self.settle(vf):
            return False
        leaked = leaked_bytes(self.sock, vf, self.token(vf))
        self.bytes_leaked += leaked
        return leaked == 0

    def hung_kernel(self, vf: int) -> bool:
        import gpuvirt

        with gpuvirt.attach(vf=vf, socket=self.sock, token=self.token(vf)) as gpu:
            try:
                gpu.launch(hang).result(timeout=60)
                return False  # a kernel that never ends ended?
            except gpuvirt.VFResetError:
                pass
        return self.settle(vf)

    def guest_ftruncate(self, vf: int) -> bool:
        import gpuvirt

        with gpuvirt.attach(vf=vf, socket=self.sock, token=self.token(vf)) as gpu:
            fds = own_fb_fds(vf)
            refused = 0
            for fd in fds:
                try:
                    os.ftruncate(fd, self.rng.choice([0, 4096, 1 << 40]))
                except OSError as e:
                    refused += e.errno == errno.EPERM
            x = gpu.alloc(16, np.int64)
            x.write(np.arange(16))
            return bool(fds) and refused == len(fds) and x.read().tolist() == list(range(16))

    def garbage_attach(self, vf: int) -> bool:
        valid = Attach(vf, parse_token(self.token(vf))).encode()
        data = bytearray(valid)
        for _ in range(self.rng.randint(1, 8)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        if self.rng.random() < 0.3:
            data = bytearray(self.rng.randbytes(self.rng.randint(1, 200)))
        with RawGuest(self.sock) as g, contextlib.suppress(OSError):
            g.send_raw(bytes(data))
            while g.recv() is not None:
                if bytes(data) == valid:
                    break  # the mutation undid itself: a real attach; leave again
        return self.settle(vf)

    def garbage_frames(self, vf: int) -> bool:
        with self.attach_raw(vf) as g:
            words = [self.rng.getrandbits(32) for _ in range(4 * self.rng.randint(1, 400))]
            for i in range(0, len(words), 4):  # mostly ids the host knows, to get past them
                if self.rng.random() < 0.7:
                    words[i] = self.rng.choice([2, 3, 4, 6, 200, 201, 0, 7, 0xFFFFFFFF])
            frames = [Frame(*words[i : i + 4]) for i in range(0, len(words), 4)]
            with contextlib.suppress(OSError):
                g.send(*frames)
        return self.settle(vf)

    def mid_frame_disconnect(self, vf: int) -> bool:
        with self.attach_raw(vf) as g:
            g.send_raw(self.rng.randbytes(self.rng.randint(1, 15)))
        return self.settle(vf)

    def log_flood(self, vf: int) -> bool:
        with self.attach_raw(vf) as g:
            g.send(*(Frame(GuestMsg.LOG_VF_ERROR, i) for i in range(3000)))
            g.send(Frame(0xDEAD))
            while (f := g.recv()) is not None and f.dw1 != 0xDEAD:
                pass
        return self.settle(vf)

    def connection_flood(self, vf: int) -> bool:
        conns = []
        try:
            for _ in range(self.hp.config.host.max_pending_attach + 20):
                conns.append(RawGuest(self.sock))
        finally:
            for g in conns:
                g.close()
        return self.settle(vf)

    def flr_storm(self, vf: int) -> bool:
        # Resets asked for while one runs join it, so ask until the guard trips.
        for _ in range(4 * (self.guard + 1)):
            with contextlib.suppress(GpuvirtError):
                self.hp.admin.vf(vf, "reset")
            if self.hp.admin.vf(vf)["state"] == "QUARANTINED":
                break
        tripped = self.hp.admin.vf(vf)["state"] == "QUARANTINED"
        return tripped and self.settle(vf)

    def enable_disable(self, vf: int) -> bool:
        self.hp.admin.vf(vf, "disable")
        disabled = self.hp.admin.vf(vf)["state"] == "UNAVAIL"
        self.hp.admin.vf(vf, "enable")
        return disabled and self.settle(vf)

    def admin_reset(self, vf: int) -> bool:
        self.hp.admin.vf(vf, "reset")
        return self.settle(vf)


def own_fb_fds(vf: int) -> list[int]:
    """This process's descriptors of VF `vf`'s FB, as a tenant finds them in /proc."""
    out = []
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if entry.readlink().as_posix().startswith(f"/memfd:gpuvirt-vf{vf}-fb"):
                out.append(int(entry.name))
    return out


def deal(kinds: Sequence[str], rng: random.Random) -> Iterator[str]:
    """The kinds over and over, each pass shuffled: random order, even counts."""
    while True:
        yield from rng.sample(kinds, len(kinds))


def run(quick: bool = False, backend: str = "emu", minutes: float | None = None) -> Result:
    minutes = minutes if minutes is not None else (0.5 if quick else 2.0)
    rng = random.Random(int.from_bytes(os.urandom(4)))
    injected: Counter[str] = Counter()
    survived: Counter[str] = Counter()
    notes: list[str] = []
    host = {"max_pending_attach": 32}
    sched = {"job_timeout_s": 1.0}
    with scratch_host(
        host=host, device={"backend": backend, "fb_total": "1GiB"}, sriov={"vf_num": 8},
        scheduler=sched,
    ) as hp:  # fmt: skip
        rss_start = hp.status()["host_rss_bytes"]
        inj = Injector(hp, rng)
        with Workers() as w:
            for vf in HONEST:
                w.start(verified_guest, str(hp.socket), vf, hp.token(vf), rng.getrandbits(32))
            w.wait_ready()
            start = time.monotonic()
            deadline = start + minutes * 60
            rss = [rss_start]  # once a minute: is it flat once warm?
            kinds = deal(KINDS, rng)
            # the minutes asked, and one whole pass at least, however slow the machine
            while hp.alive() and (time.monotonic() < deadline or injected.total() < len(KINDS)):
                if time.monotonic() - start >= 60 * len(rss):
                    rss.append(hp.status()["host_rss_bytes"])
                kind = next(kinds)
                vf = rng.choice(HOSTILE)
                injected[kind] += 1
                try:
                    # Each fault starts from a VF in AVAIL: the last one's effect is over.
                    ok = inj.settle(vf) and inj.faults[kind](vf)
                except Exception as e:  # a fault that errs is not survived
                    ok = False
                    notes.append(f"{kind} on VF{vf}: {type(e).__name__}: {e}")
                if not ok and hp.alive():
                    notes.append(f"{kind} on VF{vf} not survived: {inj.describe(vf)}")
                survived[kind] += ok and hp.alive()
            reports = w.stop() if hp.alive() else []
        alive = hp.alive()
        stuck = sum(not inj.settle(vf, SETTLE_S) for vf in HOSTILE) if alive else len(HOSTILE)
        status = hp.status() if alive else {"vfs": [], "host_rss_bytes": 0}
        honest_flrs = {v["index"]: v["flr_count"] for v in status["vfs"] if v["index"] in HONEST}
    done = [r for r in reports if r is not None]
    checked = sum(r["checked"] for r in done)
    wrong = sum(r["wrong"] for r in done)
    errors = [e for r in done for e in r["errors"]]
    lost_vfs = set(HONEST) - {r["vf"] for r in done}
    lost_vfs |= {r["vf"] for r in done if r["errors"] or r["resets"]}
    lost_vfs |= {vf for vf, n in honest_flrs.items() if n > 0}
    lost = len(lost_vfs)
    notes += errors[:5]
    if not alive:
        notes.append("the host died")
    figures: dict[str, Any] = {
        "minutes": minutes,
        "faults_injected": sum(injected.values()),
        "faults_survived": sum(survived.values()),
        "faults_by_kind": {
            k: {"injected": injected[k], "survived": survived[k]} for k in sorted(injected)
        },
        "results_checked": checked,
        "results_wrong": wrong,
        "bytes_leaked": inj.bytes_leaked,
        "vfs_stuck": stuck,
        "honest_vfs_lost": lost,
        "honest_errors": len(errors),
        "host_alive": alive,
        "host_rss_start_mib": round(rss_start / MiB, 1),
        "host_rss_end_mib": round(status["host_rss_bytes"] / MiB, 1),
        "host_rss_by_minute_mib": [round(b / MiB, 1) for b in rss],
    }
    rows = [
        ("minutes", minutes, "min"),
        ("faults injected / survived", f"{figures['faults_injected']} / "
         f"{figures['faults_survived']}", ""),
        *((f"  {k}", f"{v['injected']} / {v['survived']}", "")
          for k, v in figures["faults_by_kind"].items()),
        ("honest results checked", checked, ""),
        ("honest results wrong", wrong, ""),
        ("honest VFs lost", lost, ""),
        ("bytes a next tenant could read", inj.bytes_leaked, "B"),
        ("VFs stuck", stuck, ""),
        ("host RSS start / end", f"{figures['host_rss_start_mib']} / "
         f"{figures['host_rss_end_mib']}", "MiB"),
    ]  # fmt: skip
    targets = [
        Target(
            "faults_unsurvived", figures["faults_injected"] - figures["faults_survived"], 0, "<="
        ),
        Target("results_wrong", wrong, 0, "<="),
        Target("results_checked", checked, 1, ">="),
        Target("bytes_leaked", inj.bytes_leaked, 0, "<="),
        Target("vfs_stuck", stuck, 0, "<="),
        Target("honest_vfs_lost", lost, 0, "<="),
    ]
    return Result("chaos", backend, figures, targets, rows, notes)
