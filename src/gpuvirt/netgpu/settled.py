"""SettledRx: the Rx of a pool in device memory this process cannot map (cuda-staging).

Its reads land in staging and their copies to the device run behind them on the
engine's stream (providers/cuda_staging.py, guest/staging.py's StagedUpload,
which batches them). This module decides when a fragment may be handed out:
only once the copies of the reads that made it have landed, while reading on
meanwhile (docs/netgpu.md, "The staged path").
"""

from __future__ import annotations

import contextlib
import select
from collections import deque
from typing import TYPE_CHECKING, Any

from gpuvirt.errors import GpuvirtError
from gpuvirt.netgpu.errors import RxError
from gpuvirt.netgpu.frag import Frag
from gpuvirt.netgpu.rx import Rx
from gpuvirt.netgpu.stream import Stream

if TYPE_CHECKING:
    from gpuvirt.netgpu.pool import Pool

__all__ = ["SettledRx"]


class SettledRx(Rx):
    """An Rx for a pool in device memory this process cannot map (cuda-staging).

    Reads land in staging and their copies to the device run behind them on the
    engine's stream. A fragment is handed out only once the reads that made it are in
    device memory, so a kernel launched on it (or a token released and its chunk
    reused) never races a copy. Meanwhile the Rx reads on: a fragment whose copy is
    still in flight waits in `_settling` while the next read fills the next staging
    chunk, and it waits for its copy only when nothing can be read without blocking
    (the sender may be waiting for this very fragment to be used), or at the end.
    """

    def __init__(self, pool: Pool, **kw: Any) -> None:
        super().__init__(pool, **kw)
        self._settling: deque[tuple[int, Frag]] = deque()  # (reads it needs landed, fragment)
        self._end: BaseException | None = None  # how the streams ended, once settling is out
        self._solo_poll: tuple[Stream, select.poll] | None = None

    def __next__(self) -> Frag:
        settling = self._settling
        copies = self.pool.provider.copies  # StagedUpload: asked per fragment, directly
        while True:
            if settling:
                need, frag = settling[0]
                if copies.landed(need) or self._end is not None or not self._can_read():
                    copies.wait(need)  # at once when landed
                    settling.popleft()
                    return frag
            elif self._end is not None:
                end, self._end = self._end, None  # raised once; a closed Rx then stops
                raise end
            try:
                frag = Rx.__next__(self)
            except (StopIteration, RxError) as e:
                if not settling:
                    raise
                self._end = e  # the fragments before it are handed out first
                continue
            settling.append((copies.committed, frag))

    def _can_read(self) -> bool:
        """Whether the next step finds something to deliver or data to read at once (a
        poll, which honours the read's SO_RCVLOWAT); False is always safe: it only
        waits for the oldest copy before reading on."""
        if self._ready:
            return True
        if not self.pool.free_chunks:
            return False  # the next read may need a chunk that only our fragments hold
        solo = self._solo
        if solo is not None:
            if self._solo_poll is None or self._solo_poll[0] is not solo:
                p = select.poll()
                p.register(solo.fd, select.POLLIN)
                self._solo_poll = (solo, p)
            return bool(self._solo_poll[1].poll(0))
        return bool(self._epoll.poll(0))

    def close(self) -> None:
        super().close()
        # Fragments still settling hold tokens: they go back like the undelivered ones.
        # (At a stream's natural end they are delivered first: see __next__.)
        with self._io:
            settling, self._settling = self._settling, deque()
        if settling:
            with contextlib.suppress(GpuvirtError):  # a closed or lost pool took them along
                self.pool.release([f.token for _, f in settling])
