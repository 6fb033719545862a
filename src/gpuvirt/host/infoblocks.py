"""The host's side of the shared info blocks in every FB's reserved head (amdgpu's
PF2VF / VF2PF): the host's mapping of each head, PF2VF written at init, VF2PF read
every agreed period while a guest holds the VF.

The head is guest-writable memory, so the host reads a copy of it and decodes that
(protocol/info.py checks size, version and checksum); the memfd behind it is sealed
(device/memfd.py), so a guest cannot shrink it under the mapping.
"""

from __future__ import annotations

import asyncio
import mmap
import time
import uuid
from collections.abc import Callable

from gpuvirt import defaults as D
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.vfmgr import VF, VF2PF_READ
from gpuvirt.protocol.errors import ProtocolError
from gpuvirt.protocol.info import (
    BLOCK_SIZE,
    PF2VF,
    PF2VF_OFFSET,
    RESERVED_SIZE,
    VF2PF,
    VF2PF_OFFSET,
)
from gpuvirt.text import printable


class InfoBlocks:
    def __init__(self, events: EventLog, feature_flags: Callable[[], int], slice_ms: float) -> None:
        self.events = events
        self.feature_flags = feature_flags
        self.slice_ms = slice_ms
        self._maps: dict[int, mmap.mmap] = {}
        self.uuids: dict[int, bytes] = {}

    def __contains__(self, index: int) -> bool:
        """Whether the VF has an FB now (none after a failed renewal, or disabled)."""
        return index in self._maps

    def map(self, vf: VF, fd: int) -> None:
        self._maps[vf.index] = mmap.mmap(fd, RESERVED_SIZE, mmap.MAP_SHARED)

    def unmap(self, vf: VF) -> bool:
        """Drop the host's mapping of the VF's head; False if it had none."""
        m = self._maps.pop(vf.index, None)
        if m is None:
            return False
        m.close()
        return True

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def write_pf2vf(self, vf: VF) -> None:
        block = PF2VF(
            feature_flags=self.feature_flags(),
            fb_size=vf.fb,
            time_slice_us=int(self.slice_ms * 1000),
            vf2pf_interval_ms=D.VF2PF_INTERVAL_MS,
            uuid=self.uuids.setdefault(vf.index, uuid.uuid4().bytes),
            vf_index=vf.index,
        ).encode(vf.checksum_key)
        self._maps[vf.index][PF2VF_OFFSET : PF2VF_OFFSET + BLOCK_SIZE] = block

    async def read_vf2pf(self, vf: VF, conn: object) -> None:
        """While this guest's session holds the VF: its VF2PF, every agreed period. A
        block bad `VF2PF_MAX_BAD` times in a row is no longer read (an event says so)."""
        while vf.conn is conn and vf.state in VF2PF_READ and not vf.untrusted:
            await asyncio.sleep(D.VF2PF_INTERVAL_MS / 1000)  # the block's agreed period
            if vf.conn is not conn or vf.state not in VF2PF_READ:
                return
            raw = bytes(self._maps[vf.index][VF2PF_OFFSET : VF2PF_OFFSET + BLOCK_SIZE])
            try:
                info = VF2PF.decode(raw, vf.checksum_key)
            except ProtocolError as e:
                vf.vf2pf_bad += 1
                if vf.vf2pf_bad >= D.VF2PF_MAX_BAD:
                    vf.untrusted = True
                    self.events.emit(
                        Category.MAILBOX, "vf2pf.untrusted",
                        f"VF2PF bad {vf.vf2pf_bad} times in a row ({e}); no longer read",
                        vf.index,
                    )  # fmt: skip
                continue
            vf.vf2pf_bad = 0
            # the guest writes any string it likes here: escaped before anyone shows it
            version = printable(info.driver_version)
            if not vf.vf2pf:
                self.events.emit(
                    Category.MAILBOX, "vf2pf.first",
                    f"guest reports {version!r}, pid {info.pid}", vf.index,
                    driver_version=version, pid=info.pid,
                )  # fmt: skip
            vf.vf2pf = {
                "driver_version": version, "pid": info.pid,
                "fb_used": info.fb_used, "launches_completed": info.launches_completed,
                "netgpu_rx_bytes": info.netgpu_rx_bytes,
                "read_at": time.time(),
            }  # fmt: skip
