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
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from gpuvirt import config as C
from gpuvirt.config import HostConfig, VFSettings, load_or_create_token
from gpuvirt.defaults import ENGINE_START_TRIES, LOOP_PRIORITY, SWITCH_INTERVAL_S
from gpuvirt.device import make_device
from gpuvirt.device.base import EngineSpec, WSCommand
from gpuvirt.device.sandbox import Sandbox
from gpuvirt.device.status import Word
from gpuvirt.errors import DeviceError, StateConflictError
from gpuvirt.host.admission import Limits
from gpuvirt.host.confinement import sandbox_settings, secure_socket
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.infoblocks import InfoBlocks
from gpuvirt.host.mailbox import MailboxServer
from gpuvirt.host.priority import raise_priority
from gpuvirt.host.reconfig import set_vf
from gpuvirt.host.reset import Resetter
from gpuvirt.host.sched import FullAccess, Policy, Scheduler
from gpuvirt.host.status import StatusReport, flag_disagreements
from gpuvirt.host.vfmgr import (
    ON_GUEST_GONE,
    VF,
    Action,
    AdminOp,
    Gone,
    VFEvent,
    VFManager,
    admin_refusal,
    enabled,
)
from gpuvirt.paths import socket_served

E = VFEvent


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
        self.sandbox = Sandbox.create(sandbox_settings(config))
        self.device = make_device(config.device.backend, self.sandbox, config.device.kernel_scratch)
        # Taken once: on cuda total_fb() is the free memory, which the VFs then use up.
        self.fb_total = config.effective_fb_total(self.device.total_fb(config.sriov.vf_num))
        plans = config.vf_layout(self.fb_total)
        self.vfm = VFManager(
            [VF(p.index, p, load_or_create_token(p.token_file)) for p in plans],
            self.events,
            {Action.RELEASE_FULLACCESS: lambda vf: self.fullaccess.release(vf.index)},
        )
        sc = config.scheduler
        self.sched = Scheduler(
            Policy(sc.policy), sc.time_slice_ms, sc.cmd_timeout_ms, sc.job_timeout_s,
            self._fault_from_sched, self.device.host_cpus, sc.coop_idle_timeout_ms,
        )  # fmt: skip
        self.fullaccess = FullAccess(
            self.sched.set_exclusive, sc.fullaccess_timeout_ms / 1000, self._fullaccess_expired
        )
        self.lifecycle = asyncio.Lock()
        self.resetter = Resetter(self.vfm, self.events, self, config.reset, self.lifecycle)
        self.liveness = (C.LIVENESS_INTERVAL_S, C.LIVENESS_TIMEOUT_S)
        self.report = StatusReport(
            config, self.vfm, self.sched, self.device, self.resetter.guard,
            lambda index: index in self.info, self.sandbox.report,
        )  # fmt: skip
        self.info = InfoBlocks(
            self.events, self.device.feature_flags, config.scheduler.time_slice_ms
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self.mailbox = MailboxServer(
            self, self.socket_path, Limits.of(config.host),
            lambda path: secure_socket(path, config.host),
        )  # fmt: skip
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
        # Said plainly at every start: which confinement is in force and what is not.
        self.events.emit(
            Category.HOST, "sandbox", self.sandbox.report.line(), None,
            **self.sandbox.report.as_dict(),
        )  # fmt: skip
        # Every VF's engine starts now, side by side; enable() adopts them one by one.
        self.device.prestart(
            [EngineSpec(vf.index, vf.fb) for vf in self.vfm.vfs if self.vfm.accepts(vf, E.ENABLED)]
        )
        await asyncio.gather(*(self.enable(vf) for vf in self.vfm.vfs))
        self.mailbox.listen()
        token_file = self.config.host.admin_token_file
        token = load_or_create_token(token_file) if token_file is not None else None
        self.admin = AdminServer(self, self.admin_address, token)
        await self.admin.start()
        self.report.admin_where = self.admin.where
        self.spawn(self.report.sample_shares())
        # From now on the host's own work (its loop, its threads, the sandboxes it
        # spawns) runs beside an emulated device, not on it: no VF's device time. Not
        # before now: starting the VFs' engines may use every CPU, nothing runs yet.
        self.device.keep_host_off()
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
        self.info.close()
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
        snap = flag_disagreements(self.sched.snapshot())
        if latencies:
            snap["latencies_ns"] = list(self.sched.stats.latencies_ns)
            snap["commands_ns"] = {k: list(v) for k, v in self.sched.stats.commands_ns.items()}
        return snap

    def metrics(self) -> tuple[bytes, str]:
        from gpuvirt.host.metrics import render  # prometheus_client: only when scraped

        return render(self.report, self.events)

    async def set_vf(self, vf: VF, settings: VFSettings, caller: str) -> None:
        """`vf set` (host/reconfig.py): ConfigError a value that does not fit,
        StateConflictError a state that forbids it now."""
        await set_vf(self, vf, settings, caller)

    # ---- engines and the schedule ----------------------------------------------------

    async def start_engine(self, vf: VF) -> None:
        """A fresh engine for the VF, INIT_GPU done, on the schedule; DeviceError if none
        starts (an OSError is retried a bounded number of times first)."""
        for attempt in range(ENGINE_START_TRIES):
            try:
                engine = self.device.new_engine(EngineSpec(vf.index, vf.fb))
                break
            except OSError as e:
                self.events.emit(
                    Category.RESET, "engine.start_error",
                    f"engine for VF{vf.index} did not spawn (try {attempt + 1}): {e}",
                    vf.index, error=str(e), attempt=attempt + 1,
                )  # fmt: skip
                if attempt + 1 == ENGINE_START_TRIES:
                    raise DeviceError(f"VF{vf.index}: no engine could be started: {e}") from e
                await asyncio.sleep(0.05 * 2**attempt)  # back off: fds or pids may free up
        try:
            engine.status[Word.POLL_NS] = self.config.engine.poll_us * 1000
            await asyncio.to_thread(engine.command, WSCommand.INIT_GPU, C.ENGINE_START_TIMEOUT_S)
        except (DeviceError, OSError) as e:
            await asyncio.to_thread(engine.kill)
            raise DeviceError(f"VF{vf.index}: engine did not initialize: {e}") from e
        with contextlib.suppress(OSError):  # without CAP_SYS_NICE it stays at its start nice
            os.setpriority(os.PRIO_PROCESS, engine.pid, 0)
        vf.engine = engine
        await asyncio.wrap_future(self.sched.add(vf.index, engine, vf.plan.weight))

    async def bring_up(self, vf: VF, reason: str) -> bool:
        """A fresh engine, then AVAIL; FAILED when the engine does not start."""
        up = E.ENABLED if self.vfm.accepts(vf, E.ENABLED) else E.ENGINE_UP
        try:
            await self.start_engine(vf)
        except DeviceError as e:
            self.vfm.send(vf, E.ENGINE_FAILED, f"engine did not start: {e}")
            return False
        self.vfm.send(vf, up, reason)
        return True

    def renew_fb(self, vf: VF, size: int | None = None) -> None:
        """Scrub the FB and hand the next tenant a fresh one (see Device.renew_fb). On an
        OSError the VF has no FB any more, and the next renewal creates one."""
        if self.info.unmap(vf):
            fd = self.device.renew_fb(vf.index, size)
        else:
            fd = self.device.create_fb(vf.index, vf.fb if size is None else size)
        self.info.map(vf, fd)

    async def kill_engine(self, vf: VF) -> None:
        if vf.engine is not None:
            engine, vf.engine = vf.engine, None
            await asyncio.to_thread(engine.kill)

    async def off_schedule(self, vf: VF) -> None:
        await asyncio.wrap_future(self.sched.remove(vf.index))

    async def reweigh(self, vf: VF, weight: float) -> None:
        """The scheduler uses the VF's new weight from its next slice."""
        await asyncio.wrap_future(self.sched.set_weight(vf.index, weight))

    def _fault_from_sched(self, vf: int | None, reason: str, detail: str) -> None:
        """Called on the scheduler thread: a VF hung, its engine died, or (vf None) the
        scheduler failed with no VF to blame: then the whole device is reset."""
        assert self.loop is not None
        if vf is None:
            coro = self.resetter.escalate(f"scheduler: {reason}: {detail}")
            self.loop.call_soon_threadsafe(lambda: self.spawn(coro))
            return
        self.loop.call_soon_threadsafe(
            lambda: self.spawn(self.resetter.flr(self.vfm[vf], reason, detail))
        )

    # ---- VF lifecycle ----------------------------------------------------------------

    async def enable(self, vf: VF) -> None:
        async with self.lifecycle:
            if not self.vfm.accepts(vf, E.ENABLED):
                return
            try:
                self.info.map(vf, self.device.create_fb(vf.index, vf.fb))
            except OSError as e:
                self.vfm.send(vf, E.ENGINE_FAILED, f"no FB: {e}")
                return
            await self.bring_up(vf, "enabled")

    async def disable(self, vf: VF) -> None:
        async with self.lifecycle:
            if not enabled(vf):
                return
            if self.vfm.accepts(vf, E.DISABLE):  # from FULLACCESS: frees the init lock too
                self.vfm.send(vf, E.DISABLE, "disable")
            # Off the schedule before the guest goes: its session closes the doorbell
            # (its duplicate of the engine's end), which the scheduler must have let
            # go of by then.
            await self.off_schedule(vf)
            if vf.conn is not None:
                vf.conn.close()  # its session's end is a fini, which finds the VF gone
            await self.kill_engine(vf)
            if self.info.unmap(vf):  # none when a failed renewal left the VF without an FB
                self.device.scrub(vf.index)
                self.device.destroy_fb(vf.index)
            self.vfm.send(vf, E.DISABLED, "disabled")

    async def grant_fullaccess(self, vf: VF) -> bool:
        """FULLACCESS: the device to this VF alone. False if the VF changed while queued."""
        conn = vf.conn

        def admit() -> bool:
            if not self.vfm.accepts(vf, E.GUEST_INIT) or vf.conn is not conn or conn is None:
                return False
            self.vfm.send(vf, E.GUEST_INIT, "guest init")
            return True

        return await self.fullaccess.grant(vf.index, admit)

    def _fullaccess_expired(self, index: int) -> None:
        vf = self.vfm[index]
        if self.vfm.accepts(vf, E.GUEST_READY):  # still waiting for REL_GPU_INIT_ACCESS
            self.spawn(self.resetter.flr(vf, "fullaccess_timeout"))

    async def activate(self, vf: VF, doorbell: int) -> None:
        self.vfm.send(vf, E.GUEST_READY, "guest released init")
        try:
            await asyncio.wrap_future(self.sched.set_guest(vf.index, doorbell))
        finally:
            await self.fullaccess.end(vf.index)
        vf.vf2pf_bad, vf.untrusted, vf.vf2pf = 0, False, {}
        self.spawn(self.info.read_vf2pf(vf, vf.conn))

    async def suspend(self, vf: VF, reason: str) -> None:
        self.vfm.send(vf, E.GUEST_FINI, reason)
        await asyncio.wrap_future(self.sched.set_guest(vf.index, None))

    async def guest_gone(self, vf: VF) -> None:
        """The guest finished or vanished: scrub the FB and give the VF back."""
        gone = ON_GUEST_GONE.get(vf.state)
        if gone is Gone.RESET:
            await self.resetter.flr(vf, "guest gone during init")
            return
        if gone is Gone.SUSPEND:
            await self.suspend(vf, "guest gone")
        elif gone is None:
            return
        async with self.lifecycle:
            if ON_GUEST_GONE.get(vf.state) is not Gone.FINI:  # reset meanwhile
                return
            try:
                await self.off_schedule(vf)
                await self.kill_engine(vf)
                self.renew_fb(vf)
                await self.start_engine(vf)
            except Exception as e:  # whatever failed, the VF must not stay SUSPEND
                await self.resetter.device_reset(f"VF{vf.index} fini failed: {e!r}")
                return
            self.vfm.send(vf, E.ENGINE_UP, "fini: FB scrubbed")

    async def clear_fb(self, vf: VF) -> None:
        async with self.lifecycle:
            if (why := admin_refusal(AdminOp.CLEAR_FB, vf)) is not None:
                raise StateConflictError(f"VF{vf.index}: {why}")
            self.device.scrub(vf.index)
            self.events.emit(Category.ADMIN, "clear_fb", f"FB of VF{vf.index} scrubbed", vf.index)

    async def clear_guard(self, vf: VF) -> None:
        async with self.lifecycle:
            await self.resetter.clear_guard(vf)

    # ---- shared info blocks (see host/infoblocks.py) -------------------------------

    def write_pf2vf(self, vf: VF) -> None:
        self.info.write_pf2vf(vf)

    # ---- status (see host/status.py) -------------------------------------------------

    def vf_status(self, vf: VF) -> dict[str, Any]:
        return self.report.vf_status(vf)

    def status(self) -> dict[str, Any]:
        return self.report.status()

    def device_times(self) -> dict[str, Any]:
        return self.report.device_times()


def refuse_if_served(path: Path) -> None:
    """Never take over the socket of a host that is still running."""
    if not socket_served(path):
        return
    raise StateConflictError(
        f"another gpuvirt host is serving at {path}; stop it first or use another socket"
    )


async def run_host(config: HostConfig, ready: Path | None = None) -> None:
    host = Host(config)
    await host.start()
    # stderr: stdout carries the one ready line that starters wait for
    print(f"gpuvirt host: {host.sandbox.report.line()}", file=sys.stderr, flush=True)
    print(f"gpuvirt host: mailbox {host.socket_path}  admin {host.admin.where}", flush=True)
    if ready is not None:
        ready.write_text(str(os.getpid()))
    try:
        await host.serve_forever()
    finally:
        await host.stop()
