"""Spare engines, started ahead of need, that the next engine start of a VF adopts.

Starting an engine means an interpreter, imports and (on cuda) a CUDA context
with its warm-up: hundreds of milliseconds to seconds, which an FLR or a fini
would otherwise spend under the host's lifecycle lock. Both backends keep
engines started with no VF (`SPARE`); `take` hands one the VF's FB
(CTL_ADOPT), and the caller starts the next behind it with `refill`.

Unconfined, one spare serves any VF (key `ANY`). Confined, an engine has the
uid and limits of the VF it was started for (device/sandbox/), so a spare
serves that VF only: one per VF, keyed by its index.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from gpuvirt.device.base import EngineSpec

SPARE = EngineSpec(vf=-1, fb_size=0)  # a spare's spec until it adopts a VF
ANY = SPARE.vf  # the key of a spare any VF may adopt


class Adoptable(Protocol):
    def alive(self) -> bool: ...

    def spare_ready(self) -> bool: ...

    def adopt(self, spec: EngineSpec, fb_fd: int) -> None: ...

    def kill(self) -> None: ...


E = TypeVar("E", bound=Adoptable)


class Spares(Generic[E]):
    def __init__(self, start: Callable[[EngineSpec], E]) -> None:
        """start(identity): spawn an engine for SPARE, i.e. with no FB (it waits for
        CTL_ADOPT), with the identity and limits of the VF `identity` names."""
        self._start = start
        self._engines: dict[int, E] = {}
        # emu refills from the thread that ran the taker's INIT (EmuEngine.after_init)
        self._lock = threading.Lock()
        self._closed = False

    def take(self, key: int, spec: EngineSpec, fb_fd: int, fault: bool) -> E | None:
        """The spare under `key`, now the engine of spec's VF; None when there is none
        to give (none started, it died, or a test fault wants a fresh process)."""
        with self._lock:
            engine = self._engines.pop(key, None)
        if engine is not None and not fault and engine.alive():
            engine.adopt(spec, fb_fd)
            return engine
        if engine is not None:
            engine.kill()
        return None

    def refill(self, key: int, identity: EngineSpec) -> None:
        """Start the next spare under `key`, unless a live one is there already."""
        with self._lock:
            old = self._engines.get(key)
            if self._closed or (old is not None and old.alive()):
                return
            if old is not None:
                old.kill()
            self._engines[key] = self._start(identity)

    def counts(self) -> dict[str, int]:
        """Spares alive now (`kept`) and, of them, those done starting and waiting for a VF
        (`ready`): an FLR or enable that takes a ready one waits for no start at all."""
        with self._lock:
            live = [e for e in self._engines.values() if e.alive()]
        return {"kept": len(live), "ready": sum(e.spare_ready() for e in live)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for engine in self._engines.values():
                engine.kill()
            self._engines.clear()
