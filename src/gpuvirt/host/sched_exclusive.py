"""FULLACCESS on the scheduler thread: the VF that runs alone, and who waits until it does.

REQ_GPU_INIT_ACCESS gives one VF the device to itself, as GIM's full access does;
the host's loop answers the guest only once that VF runs alone, which only the
scheduler thread can see. A VF that leaves the schedule first fails its waiters.
"""

from __future__ import annotations

from concurrent.futures import Future

from gpuvirt.errors import StateConflictError


class FullAccess:
    def __init__(self) -> None:
        self.vf: int | None = None  # the one VF the scheduler may run; None: any
        self._waiters: list[tuple[int, Future[None]]] = []

    def wait(self, vf: int, fut: Future[None]) -> None:
        """`fut` is done once `vf` runs alone."""
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
