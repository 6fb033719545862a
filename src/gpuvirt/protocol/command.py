"""The command channel between a guest and its VF's engine (pure, no I/O).

The channel is a SOCK_SEQPACKET socket pair, so every message is one datagram:
a 16-byte header and a payload. The host creates the pair and hands one end to
the guest and one to the engine; after that the host never sees this traffic.

Payloads are cloudpickle/pickle bytes: they travel only between a tenant and
its own engine, which is the tenant's code anyway. The host never decodes them.

    header '<BBHIQ': kind u8, flags u8, reserved u16, kid u32, seq u64

kind        guest → engine                       engine → guest
DEFINE      kid = kernel id, payload = cloudpickle(fn)
LAUNCH      kid, seq, payload = pickle((args, kwargs)), empty for no arguments;
            buffers as BufDesc
COPY_IN     seq, payload = Copy × n (staging → FB; backends without a mapped FB)
COPY_OUT    seq, payload = Copy × n (FB → staging); one DONE once all n are done
DONE                                              seq, flags = Status, payload = result
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from gpuvirt.protocol.errors import ProtocolError

HEADER = struct.Struct("<BBHIQ")
HEADER_SIZE = HEADER.size
# One datagram must fit the socket's send buffer; bigger kernels are refused
# with a message instead of failing deep inside sendmsg.
MAX_MESSAGE = 192 * 1024
COPY = struct.Struct("<QQQ")


class Kind(IntEnum):
    DEFINE = 1
    LAUNCH = 2
    COPY_IN = 3
    COPY_OUT = 4
    DONE = 5


_KINDS = {k.value: k for k in Kind}


class Status(IntEnum):
    OK = 0
    KERNEL_ERROR = 1  # payload: the traceback, utf-8
    BAD_REQUEST = 2  # payload: why, utf-8


@dataclass(frozen=True)
class BufDesc:
    """A buffer as it crosses the guest/engine boundary: where it is, never its data."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        import numpy as np  # the descriptor itself stays importable without numpy

        n = int(np.dtype(self.dtype).itemsize)
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class Copy:
    """A copy between the FB and the guest's staging area (offsets in each)."""

    fb_offset: int
    staging_offset: int
    nbytes: int

    def encode(self) -> bytes:
        return Copy.pack(self.fb_offset, self.staging_offset, self.nbytes)

    @classmethod
    def decode(cls, data: bytes) -> Copy:
        if len(data) != COPY.size:
            raise ProtocolError(f"copy descriptor: {len(data)} bytes, expected {COPY.size}")
        return cls(*COPY.unpack(data))

    @staticmethod
    def pack(fb_offset: int, staging_offset: int, nbytes: int) -> bytes:
        """`Copy(...).encode()` without the object: for a sender that packs one per read."""
        return COPY.pack(fb_offset, staging_offset, nbytes)

    @staticmethod
    def encode_many(copies: list[Copy]) -> bytes:
        """Several descriptors back to back: one message, one DONE for all of them."""
        return b"".join(c.encode() for c in copies)

    @classmethod
    def decode_many(cls, data: bytes) -> list[Copy]:
        if not data or len(data) % COPY.size:
            raise ProtocolError(
                f"copy descriptors: {len(data)} bytes, expected a positive multiple of {COPY.size}"
            )
        return [cls(*t) for t in COPY.iter_unpack(data)]


class Message(NamedTuple):
    # A NamedTuple, not a frozen dataclass: every launch builds two and decodes one,
    # and a frozen dataclass's __init__ (object.__setattr__ per field) costs ~1 µs more.
    kind: Kind
    seq: int = 0
    kid: int = 0
    flags: int = 0
    payload: bytes = b""

    def encode(self) -> bytes:
        return pack(self.kind, self.seq, self.kid, self.flags, self.payload)

    @classmethod
    def decode(cls, data: bytes) -> Message:
        if len(data) < HEADER_SIZE:
            raise ProtocolError(f"command message: {len(data)} bytes, shorter than the header")
        code, flags, reserved, kid, seq = HEADER.unpack_from(data)
        kind = _KINDS.get(code)  # Kind(code) raises through a slower path per message
        if kind is None:
            raise ProtocolError(f"command message: unknown kind {code}")
        if reserved:
            raise ProtocolError(f"command message: reserved field is {reserved}, must be 0")
        # tuple.__new__: the NamedTuple's own __new__ is a Python call that only does this
        return tuple.__new__(cls, (kind, seq, kid, flags, bytes(data[HEADER_SIZE:])))


def pack(kind: Kind, seq: int = 0, kid: int = 0, flags: int = 0, payload: bytes = b"") -> bytes:
    """A message's bytes, `Message(...).encode()` without the tuple: the launch round trip
    sends two per launch, so its ends pack directly."""
    if len(payload) > MAX_MESSAGE - HEADER_SIZE:
        raise ProtocolError(
            f"command message of {len(payload) + HEADER_SIZE} bytes exceeds the channel's "
            f"{MAX_MESSAGE}-byte limit; pass large data in buffers, not in the kernel's "
            "closure or arguments"
        )
    return HEADER.pack(kind, flags, 0, kid, seq) + payload
