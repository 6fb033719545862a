"""The host daemon (PF driver): owns the device, the VF table, the scheduler,
the mailbox and the admin endpoint.

Threads: the asyncio loop (mailbox, admin, resets, timers) and the scheduler
thread (world switches). The loop owns the VF table; the scheduler owns which
engine runs. Lifecycle operations that restart an engine or scrub an FB (FLR,
fini, enable/disable, clear-fb) take `lifecycle`, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import signal
import socket
import sys
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from gpuvirt import config as C
from gpuvirt.config import HostConfig, load_or_create_token
from gpuvirt.device import make_device
from gpuvirt.device.base import EngineSpec, WSCommand
from gpuvirt.errors import DeviceError
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.mailbox import Limits, MailboxServer
from gpuvirt.host.reset import Resetter
from gpuvirt.host.sched import Policy, Scheduler, raise_priority
from gpuvirt.host.vfmgr import VF, VFManager, VFState
from gpuvirt.protocol.errors import ProtocolError
from gpuvirt.protocol.info import (
    BLOCK_SIZE,
    PF2VF,
    PF2VF_OFFSET,
    RESERVED_SIZE,
    VF2PF,
    VF2PF_OFFSET,
)

S = VFState
SWITCH_INTERVAL_S = 0.0002
LOOP_PRIORITY = 5  # below the scheduler thread's (sched.RT_PRIORITY)
PAGE = os.sysconf("SC_PAGE_SIZE")
SHARE_WINDOW = 5  # samples (1 s apart) behind the achieved share


class Host:
    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.socket_path = config.host.socket_path()
        self.admin_address = config.host.admin_address()
        self.state_dir = config.host.state_path()
        self.events = EventLog(
            self.state_dir / "events.jsonl",
            max_bytes=config.host.event_log_max,
            files=config.host.event_log_files,
        )
        self.device = make_device(config.device.backend)
        plans = config.vf_layout(self.device.total_fb())
        self.vfm = VFManager(
            [VF(p.index, p, load_or_create_token(p.token_file)) for p in plans], self.events
        )
        sc = config.scheduler
        self.sched = Scheduler(
            Policy(sc.policy), sc.time_slice_ms, sc.cmd_timeout_ms, sc.job_timeout_s,
            self._fault_from_sched, self.device.exec_cpus,
        )  # fmt: skip
        self.lifecycle = asyncio.Lock()
        self.resetter = Resetter(self)
        self.liveness = (C.LIVENESS_INTERVAL_S, C.LIVENESS_TIMEOUT_S)
        self.uuids = {vf.index: uuid.uuid4().bytes for vf in self.vfm.vfs}
        self.started = time.time()
        self.samples: deque[dict[str, Any]] = deque(maxlen=SHARE_WINDOW + 1)
        self._info: dict[int, mmap.mmap] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._grants: dict[int, int] = {}
        # GIM grants full access to one VF at a time; the others queue here.
        self._fullaccess = asyncio.Lock()
        self._fullaccess_vf: int | None = None
        self.mailbox = MailboxServer(self, self.socket_path, Limits.of(config.host))
        self._stop = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- start and stop --------------------------------------------------------------

    async def start(self) -> None:
        from gpuvirt.host.admin import AdminServer

        self.loop = asyncio.get_running_loop()
        for path in (self.socket_path, self.admin_address):
            if isinstance(path, Path):
                refuse_if_served(path)
        # The scheduler thread needs the GIL promptly when it wakes for a switch: a
        # shorter switch interval, and the loop thread (which may hold the GIL) real-time
        # too, below the scheduler, so busy engines cannot keep it off the CPU meanwhile.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.loop_priority = raise_priority(LOOP_PRIORITY)
        self.sched.start()
        self.events.emit(
            Category.HOST, "start",
            f"host starting: {self.config.device.backend}, {len(self.vfm)} VFs, "
            f"policy {self.config.scheduler.policy}", None,
        )  # fmt: skip
        await asyncio.gather(*(self.enable(vf) for vf in self.vfm.vfs))
        self.mailbox.listen()
        token_file = self.config.host.admin_token_file
        token = load_or_create_token(token_file) if token_file is not None else None
        self.admin = AdminServer(self, self.admin_address, token)
        await self.admin.start()
        self.spawn(self._sample_shares())
        self.events.emit(
            Category.HOST, "ready",
            f"mailbox {self.socket_path}, admin {self.admin.where}, scheduler thread at "
            f"{self.sched.priority}, loop at {self.loop_priority}", None,
        )  # fmt: skip

    async def serve_forever(self) -> None:
        assert self.loop is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stop.set)
        await self._stop.wait()

    async def stop(self) -> None:
        self.mailbox.close()
        await self.admin.stop()
        for vf in self.vfm.vfs:
            if vf.conn is not None:
                vf.conn.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.sched.stop)
        for vf in self.vfm.vfs:
            if vf.engine is not None:
                vf.engine.kill()
                vf.engine = None
        for m in self._info.values():
            m.close()
        self.device.close()
        self.events.emit(Category.HOST, "stop", "host stopped", None)
        self.events.close()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.events.emit(Category.HOST, "bug", f"host task failed: {exc!r}", None)
            if self.loop is not None:
                self.loop.call_exception_handler({"message": "host task failed", "exception": exc})

    # ---- what the mailbox and the admin endpoint reach (their Protocols) --------------

    def find_vf(self, index: int) -> VF | None:
        return self.vfm[index] if 0 <= index < len(self.vfm) else None

    def guest_fds(self, vf: VF) -> list[int]:
        return self.device.guest_fds(vf.index)

    def vf_count(self) -> int:
        return len(self.vfm)

    async def reset_vf(self, vf: VF, reason: str) -> None:
        await self.resetter.flr(vf, reason)

    def sched_view(self, latencies: bool) -> dict[str, Any]:
        snap = self.sched.snapshot()
        if latencies:
            snap["latencies_ns"] = list(self.sched.stats.latencies_ns)
            snap["commands_ns"] = {k: list(v) for k, v in self.sched.stats.commands_ns.items()}
        return snap

    def metrics(self) -> tuple[bytes, str]:
        from gpuvirt.host.metrics import render  # prometheus_client: only when scraped

        return render(self)

    # ---- engines and the schedule ----------------------------------------------------

    async def start_engine(self, vf: VF) -> None:
        """A fresh engine for the VF, INIT_GPU done, on the schedule."""
        engine = self.device.new_engine(EngineSpec(vf.index, vf.fb))
        try:
            await asyncio.to_thread(engine.command, WSCommand.INIT_GPU, C.ENGINE_START_TIMEOUT_S)
        except DeviceError:
            await asyncio.to_thread(engine.kill)
            raise
        with contextlib.suppress(OSError):  # without CAP_SYS_NICE it stays at its start nice
            os.setpriority(os.PRIO_PROCESS, engine.pid, 0)
        vf.engine = engine
        await asyncio.wrap_future(self.sched.add(vf.index, engine, vf.plan.weight))

    async def bring_up(self, vf: VF, reason: str) -> bool:
        """A fresh engine, then AVAIL; FAILED when the engine does not start."""
        try:
            await self.start_engine(vf)
        except DeviceError as e:
            self.vfm.transition(vf, S.FAILED, f"engine did not start: {e}")
            return False
        self.vfm.transition(vf, S.AVAIL, reason)
        return True

    def renew_fb(self, vf: VF) -> None:
        """Scrub the FB and hand the next tenant a fresh one (see Device.renew_fb)."""
        self._info.pop(vf.index).close()
        fd = self.device.renew_fb(vf.index)
        self._info[vf.index] = mmap.mmap(fd, RESERVED_SIZE, mmap.MAP_SHARED)

    async def kill_engine(self, vf: VF) -> None:
        if vf.engine is not None:
            engine, vf.engine = vf.engine, None
            await asyncio.to_thread(engine.kill)

    async def off_schedule(self, vf: VF) -> None:
        await asyncio.wrap_future(self.sched.remove(vf.index))

    def _fault_from_sched(self, vf: int, reason: str, detail: str) -> None:
        """Called on the scheduler thread: a VF hung or its engine died."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(
            lambda: self.spawn(self.resetter.flr(self.vfm[vf], reason, detail))
        )

    # ---- VF lifecycle ----------------------------------------------------------------

    async def enable(self, vf: VF) -> None:
        async with self.lifecycle:
            if vf.state != S.UNAVAIL:
                return
            fd = self.device.create_fb(vf.index, vf.fb)
            self._info[vf.index] = mmap.mmap(fd, RESERVED_SIZE, mmap.MAP_SHARED)
            await self.bring_up(vf, "enabled")

    async def disable(self, vf: VF) -> None:
        async with self.lifecycle:
            if vf.state == S.UNAVAIL:
                return
            if vf.conn is not None:
                vf.conn.close()  # its session's end is a fini, which finds the VF gone
            if vf.state not in (S.RESETTING, S.QUARANTINED, S.FAILED):
                self.vfm.transition(vf, S.RESETTING, "disable")
            await self.off_schedule(vf)
            await self.kill_engine(vf)
            self.device.scrub(vf.index)
            self._info.pop(vf.index).close()
            self.device.destroy_fb(vf.index)
            self.vfm.transition(vf, S.UNAVAIL, "disabled")

    async def grant_fullaccess(self, vf: VF) -> bool:
        """FULLACCESS: the device to this VF alone. False if the VF changed while queued."""
        conn = vf.conn
        await self._fullaccess.acquire()
        if vf.state != S.AVAIL or vf.conn is not conn or conn is None:
            self._fullaccess.release()
            return False
        self._fullaccess_vf = vf.index
        self.vfm.transition(vf, S.FULLACCESS, "guest init")
        grant = self._grants[vf.index] = self._grants.get(vf.index, 0) + 1
        assert self.loop is not None
        self.loop.call_later(
            self.config.scheduler.fullaccess_timeout_ms / 1000,
            lambda: self._fullaccess_expired(vf, grant),
        )
        try:
            await asyncio.wrap_future(self.sched.set_exclusive(vf.index))
        except DeviceError:
            return False  # reset while waiting; the reset released full access
        return True

    def release_fullaccess(self, vf: VF) -> None:
        if self._fullaccess_vf == vf.index:
            self._fullaccess_vf = None
            self._fullaccess.release()

    def _fullaccess_expired(self, vf: VF, grant: int) -> None:
        if vf.state == S.FULLACCESS and self._grants.get(vf.index) == grant:
            self.spawn(self.resetter.flr(vf, "fullaccess_timeout"))

    async def activate(self, vf: VF, doorbell: int) -> None:
        self.vfm.transition(vf, S.ACTIVE, "guest released init")
        self._grants[vf.index] = self._grants.get(vf.index, 0) + 1
        await asyncio.wrap_future(self.sched.set_guest(vf.index, doorbell))
        await asyncio.wrap_future(self.sched.set_exclusive(None))
        self.release_fullaccess(vf)
        vf.vf2pf_bad, vf.untrusted, vf.vf2pf = 0, False, {}
        self.spawn(self._read_vf2pf(vf, vf.conn))

    async def suspend(self, vf: VF, reason: str) -> None:
        self.vfm.transition(vf, S.SUSPEND, reason)
        await asyncio.wrap_future(self.sched.set_guest(vf.index, None))

    async def guest_gone(self, vf: VF) -> None:
        """The guest finished or vanished: scrub the FB and give the VF back."""
        if vf.state == S.FULLACCESS:
            await self.resetter.flr(vf, "guest gone during init")
            return
        if vf.state == S.ACTIVE:
            await self.suspend(vf, "guest gone")
        if vf.state != S.SUSPEND:
            return
        async with self.lifecycle:
            if vf.state != S.SUSPEND:
                return
            await self.off_schedule(vf)
            await self.kill_engine(vf)
            self.renew_fb(vf)
            try:
                await self.start_engine(vf)
            except DeviceError as e:
                self.vfm.transition(vf, S.RESETTING, f"engine did not restart after fini: {e}")
                await self.resetter.device_reset(f"VF{vf.index}: {e}")
                return
            self.vfm.transition(vf, S.AVAIL, "fini: FB scrubbed")

    async def clear_fb(self, vf: VF) -> None:
        async with self.lifecycle:
            if vf.state in (S.FULLACCESS, S.ACTIVE, S.SUSPEND, S.RESETTING):
                raise DeviceError(
                    f"VF{vf.index} is {vf.state} with a guest; `gpuvirt vf reset {vf.index}` instead"
                )
            if vf.state == S.UNAVAIL:
                raise DeviceError(f"VF{vf.index} is disabled; it has no FB")
            self.device.scrub(vf.index)
            self.events.emit(Category.ADMIN, "clear_fb", f"FB of VF{vf.index} scrubbed", vf.index)

    async def clear_guard(self, vf: VF) -> None:
        async with self.lifecycle:
            self.resetter.clear_guard(vf)
            if vf.state == S.QUARANTINED:
                await self.bring_up(vf, "guard cleared")

    # ---- shared info blocks ----------------------------------------------------------

    def write_pf2vf(self, vf: VF) -> None:
        block = PF2VF(
            feature_flags=self.device.feature_flags(),
            fb_size=vf.fb,
            time_slice_us=int(self.config.scheduler.time_slice_ms * 1000),
            vf2pf_interval_ms=C.VF2PF_INTERVAL_MS,
            uuid=self.uuids[vf.index],
            vf_index=vf.index,
        ).encode(vf.checksum_key)
        self._info[vf.index][PF2VF_OFFSET : PF2VF_OFFSET + BLOCK_SIZE] = block

    async def _read_vf2pf(self, vf: VF, conn: Any) -> None:
        while vf.conn is conn and vf.state in (S.ACTIVE, S.SUSPEND) and not vf.untrusted:
            await asyncio.sleep(C.VF2PF_INTERVAL_MS / 1000)  # the block's agreed period
            if vf.conn is not conn or vf.state not in (S.ACTIVE, S.SUSPEND):
                return
            raw = bytes(self._info[vf.index][VF2PF_OFFSET : VF2PF_OFFSET + BLOCK_SIZE])
            try:
                info = VF2PF.decode(raw, vf.checksum_key)
            except ProtocolError as e:
                vf.vf2pf_bad += 1
                if vf.vf2pf_bad >= C.VF2PF_MAX_BAD:
                    vf.untrusted = True
                    self.events.emit(
                        Category.MAILBOX, "vf2pf.untrusted",
                        f"VF2PF bad {vf.vf2pf_bad} times in a row ({e}); no longer read",
                        vf.index,
                    )  # fmt: skip
                continue
            vf.vf2pf_bad = 0
            if not vf.vf2pf:
                self.events.emit(
                    Category.MAILBOX, "vf2pf.first",
                    f"guest reports {info.driver_version!r}, pid {info.pid}", vf.index,
                    driver_version=info.driver_version, pid=info.pid,
                )  # fmt: skip
            vf.vf2pf = {
                "driver_version": info.driver_version, "pid": info.pid,
                "fb_used": info.fb_used, "launches_completed": info.launches_completed,
                "netgpu_rx_bytes": info.netgpu_rx_bytes,
                "read_at": time.time(),
            }  # fmt: skip

    # ---- status ----------------------------------------------------------------------

    async def _sample_shares(self) -> None:
        while True:
            self.samples.append(self.sched.snapshot())
            await asyncio.sleep(1.0)  # sampling period of the achieved-share window

    def achieved_shares(self) -> dict[int, float]:
        if len(self.samples) < 2:
            return {}
        a, b = self.samples[0], self.sched.snapshot()
        span = b["elapsed_ns"] - a["elapsed_ns"]
        out = {}
        for vf, now in b["vfs"].items():
            before = a["vfs"].get(vf, {"device_ns": now["device_ns"]})["device_ns"]
            out[vf] = max(0.0, (now["device_ns"] - before) / span) if span else 0.0
        return out

    def device_times(self) -> dict[str, Any]:
        """Every VF's device time now (ns); reset events carry it so shares can be cut at them."""
        snap = self.sched.snapshot()
        return {
            "elapsed_ns": snap["elapsed_ns"],
            "lost_ns": snap["lost_ns"],
            "idle_ns": snap["idle_ns"],
            "vfs": {str(vf): s["device_ns"] for vf, s in snap["vfs"].items()},
        }

    def configured_shares(self) -> dict[int, float]:
        policy = self.sched.policy
        vfs = [vf for vf in self.vfm.vfs if vf.state != S.UNAVAIL]
        if policy == Policy.FAIRNESS:
            pool = vfs
        else:
            pool = [vf for vf in vfs if vf.state in (S.ACTIVE, S.FULLACCESS)]
        if not pool:
            return {}
        if policy == Policy.WEIGHTED:
            total = sum(vf.plan.weight for vf in pool)
            return {vf.index: vf.plan.weight / total for vf in pool}
        return {vf.index: 1 / len(pool) for vf in pool}

    def vf_status(self, vf: VF, snap: dict[str, Any] | None = None) -> dict[str, Any]:
        snap = snap or self.sched.snapshot()
        s = snap["vfs"].get(vf.index, {})
        achieved = self.achieved_shares()
        configured = self.configured_shares()
        return {
            "index": vf.index,
            "state": str(vf.state),
            "fb_total": vf.fb,
            "fb_used": vf.vf2pf.get("fb_used", 0),
            "fb_resident": self.device.fb_resident(vf.index) if vf.state != S.UNAVAIL else 0,
            "weight": vf.plan.weight,
            "configured_share": round(configured.get(vf.index, 0.0), 4),
            "achieved_share": round(achieved.get(vf.index, 0.0), 4),
            "device_ms": round(s.get("device_ns", 0) / 1e6, 3),
            "running": s.get("running", False),
            "pending": s.get("pending", 0),
            "guest_pid": vf.guest_pid,
            "engine_pid": vf.engine.pid if vf.engine else None,
            "launches_completed": vf.vf2pf.get("launches_completed", 0),
            "netgpu_rx_bytes": vf.vf2pf.get("netgpu_rx_bytes", 0),
            "driver_version": vf.vf2pf.get("driver_version"),
            "vf2pf_read_at": vf.vf2pf.get("read_at"),
            "flr_count": vf.flr_count,
            "last_flr": vf.last_flr,
            "guard": {
                "recent_flrs": len(vf.flr_times),
                "limit": self.resetter.guard.count,
                "window_s": self.resetter.guard.window_s,
                "tripped": vf.state == S.QUARANTINED,
                "trips": vf.guard_trips,
            },
            "vf2pf_untrusted": vf.untrusted,
            "since": vf.since,
        }

    def status(self) -> dict[str, Any]:
        snap = self.sched.snapshot()
        elapsed = snap["elapsed_ns"] or 1
        lat = sorted(self.sched.stats.latencies_ns)
        return {
            "backend": self.config.device.backend,
            "policy": snap["policy"],
            "time_slice_ms": self.config.scheduler.time_slice_ms,
            "socket": str(self.socket_path),
            "admin": self.admin.where,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "host_rss_bytes": rss_bytes(os.getpid()),
            "sched": {
                "current": snap["current"],
                "switches": snap["switches"],
                "lost_pct": round(100 * snap["lost_ns"] / elapsed, 3),
                "switch_p50_us": round(lat[len(lat) // 2] / 1e3, 1) if lat else None,
                "switch_p99_us": round(lat[int(len(lat) * 0.99)] / 1e3, 1) if lat else None,
            },
            "vfs": [self.vf_status(vf, snap) for vf in self.vfm.vfs],
        }


def refuse_if_served(path: Path) -> None:
    """Never take over the socket of a host that is still running."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return
    finally:
        probe.close()
    raise DeviceError(
        f"another gpuvirt host is serving at {path}; stop it first or use another socket"
    )


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (not its peak)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


async def run_host(config: HostConfig, ready: Path | None = None) -> None:
    host = Host(config)
    await host.start()
    print(f"gpuvirt host: mailbox {host.socket_path}  admin {host.admin.where}", flush=True)
    if ready is not None:
        ready.write_text(str(os.getpid()))
    try:
        await host.serve_forever()
    finally:
        await host.stop()
