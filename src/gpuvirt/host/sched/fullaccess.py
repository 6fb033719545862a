"""FULLACCESS: one VF at a time gets the device to itself, as GIM's full access does.

REQ_GPU_INIT_ACCESS asks for it; the guest gets its answer only once its VF
runs alone, and gives the device back with REL_GPU_INIT_ACCESS within
`fullaccess_timeout_ms`, or its VF is reset. Two halves, both here:

- `FullAccess`, on the host's loop: the init lock (one grant at a time, the
  others queue), the grant's timer, and the grant's end;
- `Exclusive`, on the scheduler thread: which VF alone may run, and the
  futures waiting until it does. Only that thread sees when it runs alone.

A VF that leaves FULLACCESS any other way (reset, disable, its guest gone)
hands the lock on through the VF state machine's RELEASE_FULLACCESS action.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from gpuvirt.errors import StateConflictError


class Exclusive:
    """The scheduler thread's side: the one VF it may run, and who waits until it does."""

    def __init__(self) -> None:
        self.vf: int | None = None  # the one VF the scheduler may run; None: any
        self._waiters: list[tuple[int, Future[None]]] = []

    def grant(self, vf: int | None, fut: Future[None]) -> None:
        """Run only `vf` from now on (None: any VF); `fut` is done once `vf` runs alone."""
        self.vf = vf
        if vf is None:
            fut.set_result(None)
        else:
            self._waiters.append((vf, fut))

    def running(self, vf: int) -> None:
        """`vf` runs now: its waiters are done if it is the one granted the device."""
        if self._waiters and vf == self.vf:
            self._settle(vf, None)

    def left(self, vf: int) -> None:
        """`vf` is off the schedule: its grant ends and its waiters learn why."""
        if self.vf == vf:
            self.vf = None
        if self._waiters:
            self._settle(
                vf, StateConflictError(f"VF{vf} left the schedule before it got the device")
            )

    def _settle(self, vf: int, exc: Exception | None) -> None:
        keep = []
        for v, fut in self._waiters:
            if v != vf:
                keep.append((v, fut))
            elif exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
        self._waiters = keep


class FullAccess:
    """The host loop's side: the init lock, the grant's timer and its end."""

    def __init__(
        self,
        exclusive: Callable[[int | None], Future[None]],
        timeout_s: float,
        expired: Callable[[int], None],
    ) -> None:
        """exclusive: the scheduler's set_exclusive; expired(vf): the grant outlived
        timeout_s (the host resets the VF if it still holds it)."""
        self._exclusive = exclusive
        self._timeout_s = timeout_s
        self._expired = expired
        self._lock = asyncio.Lock()
        self._holder: int | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def grant(self, vf: int, admit: Callable[[], bool]) -> bool:
        """Wait for the lock, then for `vf` to run alone. `admit()`, called once the lock
        is ours, says whether the VF still wants it (its guest may have gone while it
        queued) and moves it to FULLACCESS. False: not granted, or lost while waiting."""
        await self._lock.acquire()
        if not admit():
            self._lock.release()
            return False
        self._holder = vf
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expired, vf)
        try:
            await asyncio.wrap_future(self._exclusive(vf))
        except StateConflictError:
            return False  # reset while waiting; the reset released the lock
        return True

    async def end(self, vf: int) -> None:
        """The guest gave the device back: every VF may run again, then the next grant."""
        try:
            await asyncio.wrap_future(self._exclusive(None))
        finally:  # the next VF's init may start only once this one no longer runs alone
            self.release(vf)

    def release(self, vf: int) -> None:
        """`vf`'s grant is over, however it ended; idempotent."""
        if self._holder != vf:
            return
        self._holder = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._lock.release()
