"""The engine status area: plain u64 words in a small shared memfd.

The host reads an engine's progress here without messaging it, and an engine
can be stopped (SIGSTOP) at any instruction, so no lock is ever shared: every
word has exactly one writer, and an aligned 8-byte store is atomic on every
platform we run on. Words 0..63 are written by the engine, 64..127 by the host.
"""

from __future__ import annotations

import mmap
from enum import IntEnum

from gpuvirt.device.memfd import sealed_memfd

STATUS_SIZE = 4096
MAGIC = 0x47505556_53544154  # "GPUVSTAT"


class Word(IntEnum):
    # engine-written
    MAGIC = 0
    PID = 1
    READY = 2  # 1 once the engine has mapped its FB and can take work
    RECEIVED = 3  # launches received from the guest
    COMPLETED = 4  # launches finished (ok or error)
    CURRENT_SEQ = 5  # seq of the kernel running now, 0 when none
    CURRENT_START_NS = 6  # CLOCK_MONOTONIC when it started
    FAILED = 7  # kernels that raised
    ACK_SERIAL = 8  # last host command acknowledged (cooperative backends)
    GUEST_EPOCH = 9  # bumps each time a new guest channel is installed
    # cumulative ns the engine's launches and copies kept the device busy, measured by the
    # device itself (cuda: CUDA events on the engine's stream, docs/cuda.md "Device time");
    # emu engines do not write it: there the device's time is the host's wall clock
    BUSY_NS = 10
    # a spare (device/spare.py): 1 once started (interpreter, imports, cuda's context) and
    # waiting to be handed a VF. Read only before that, while no tenant code can write it.
    SPARE_READY = 11
    # 1 from just before the engine reads a guest message until it is done with it (it
    # counts in RECEIVED meanwhile, unless it counts nothing): a stop lands at a system
    # call's return, so an engine stopped right after its read holds a launch that
    # neither the channel (emptied) nor RECEIVED shows; this word does (host/sched/entry.py)
    TAKING = 12
    # host-written
    NOTIFY_IDLE = 64  # 1: signal the idle eventfd when the queue drains
    CMD_SERIAL = 65  # cooperative world switch: serial of the latest command
    CMD_CODE = 66  # and its code (a WSCommand)
    POLL_NS = 67  # how long the engine polls its guest channel before it sleeps (0: never)


class StatusArea:
    """A view of one engine's status words; either side constructs it over the same fd."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, STATUS_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # A memoryview of u64s: an item reads and writes as a plain int, several times
        # cheaper than a numpy scalar, and the engine touches these words per launch.
        self.words = memoryview(self._map).cast("Q")

    @staticmethod
    def create(name: str) -> int:
        return sealed_memfd(name, STATUS_SIZE)  # the engine holds it too

    def __getitem__(self, word: Word) -> int:
        return self.words[word]

    def __setitem__(self, word: Word, value: int) -> None:
        self.words[word] = value

    def bump(self, word: Word, by: int = 1) -> None:
        # Safe only because each word has a single writer.
        self.words[word] += by

    def close(self) -> None:
        self.words.release()
        self._map.close()
