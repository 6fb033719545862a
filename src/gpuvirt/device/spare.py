"""A spare engine, started ahead of need, that the next VF's engine start adopts.

Starting an engine means an interpreter, imports and (on cuda) a CUDA context
with its warm-up: hundreds of milliseconds to seconds, which an FLR or a fini
would otherwise spend under the host's lifecycle lock. Both backends keep one
engine started with no VF (`SPARE`); `take` hands it the VF's FB (CTL_ADOPT),
and the caller starts the next spare behind it with `refill`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from gpuvirt.device.base import EngineSpec

SPARE = EngineSpec(vf=-1, fb_size=0)  # a spare's spec until it adopts a VF


class Adoptable(Protocol):
    def alive(self) -> bool: ...

    def adopt(self, spec: EngineSpec, fb_fd: int) -> None: ...

    def kill(self) -> None: ...


E = TypeVar("E", bound=Adoptable)


class Spare(Generic[E]):
    def __init__(self, start: Callable[[], E]) -> None:
        """start: spawn an engine for SPARE, i.e. with no FB (it waits for CTL_ADOPT)."""
        self._start = start
        self._engine: E | None = None

    def take(self, spec: EngineSpec, fb_fd: int, fault: bool) -> E | None:
        """The spare, now the engine of spec's VF; None when there is none to give (none
        started, it died, or a test fault wants this start to be a fresh process)."""
        engine, self._engine = self._engine, None
        if engine is not None and not fault and engine.alive():
            engine.adopt(spec, fb_fd)
            return engine
        if engine is not None:
            engine.kill()
        return None

    def refill(self) -> None:
        """Start the next spare (the previous one was taken or is being replaced)."""
        if self._engine is not None:
            self._engine.kill()
        self._engine = self._start()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.kill()
            self._engine = None
