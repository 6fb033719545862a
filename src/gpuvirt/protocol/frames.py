"""NetGPU framed mode: the 32-byte header in front of every message (pure, no I/O).

A sender writes ``Header`` then ``length`` payload bytes, repeatedly, on one
TCP stream. The receiver parses the header on the CPU and receives the payload
straight into a pool chunk in device memory, so the header must say everything
needed to place the payload (stream, sequence, length) without the CPU ever
looking at it. The crc32 is optional (off by default): TCP already protects
the bytes, and computing it means reading the payload.

Layout '<4sBBHQQII' (little-endian): magic ``b"NGPU"``, version u8, flags u8,
stream u16, seq u64, length u64, crc32 u32, reserved u32 (= 0).

``Header.decode(data, max_length=...)`` is where a receiver enforces its
limit, before it commits buffer space to a length an untrusted peer chose.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from .errors import ProtocolError, as_view, check_uint

__all__ = [
    "FLAG_CRC",
    "HEADER_SIZE",
    "HEADER_STRUCT",
    "KNOWN_FLAGS",
    "NGPU_MAGIC",
    "NGPU_VERSION",
    "Header",
    "check_payload",
    "header_for",
    "unpack_header",
]

NGPU_MAGIC = b"NGPU"
NGPU_VERSION = 1
HEADER_SIZE = 32
FLAG_CRC = 0x01  # the crc field holds zlib.crc32 of the payload
KNOWN_FLAGS = FLAG_CRC

HEADER_STRUCT = struct.Struct("<4sBBHQQII")
assert HEADER_STRUCT.size == HEADER_SIZE


@dataclass(frozen=True)
class Header:
    """One framed-mode message header; ``length`` payload bytes follow it on the wire."""

    stream: int
    seq: int
    length: int
    flags: int = 0
    crc: int = 0

    def encode(self) -> bytes:
        flags = check_uint("NGPU flags", self.flags, 8)
        crc = check_uint("NGPU crc", self.crc, 32)
        _check_flags(flags, crc)
        return HEADER_STRUCT.pack(
            NGPU_MAGIC,
            NGPU_VERSION,
            flags,
            check_uint("NGPU stream", self.stream, 16),
            check_uint("NGPU seq", self.seq, 64),
            check_uint("NGPU length", self.length, 64),
            crc,
            0,
        )

    @classmethod
    def decode(cls, data: bytes, max_length: int | None = None) -> Header:
        stream, seq, length, flags, crc = unpack_header(data, max_length)
        return cls(stream=stream, seq=seq, length=length, flags=flags, crc=crc)


def unpack_header(data: object, max_length: int | None = None) -> tuple[int, int, int, int, int]:
    """(stream, seq, length, flags, crc) of a valid header, else ProtocolError naming the field.

    Header.decode without the object, for a receiver that parses one header per
    message at line rate: a good header costs one unpack and one comparison chain.
    """
    if data.__class__ is bytearray and len(data) == HEADER_SIZE:  # type: ignore[arg-type]
        magic, version, flags, stream, seq, length, crc, reserved = HEADER_STRUCT.unpack(data)  # type: ignore[arg-type]
        if (
            magic == NGPU_MAGIC
            and version == NGPU_VERSION
            and not flags & ~KNOWN_FLAGS
            and (not crc or flags & FLAG_CRC)
            and not reserved
            and (max_length is None or length <= max_length)
        ):
            return stream, seq, length, flags, crc
    view = as_view(data, "NGPU header")
    if view.nbytes != HEADER_SIZE:
        raise ProtocolError.bad(
            "NGPU header length", view.nbytes, f"must be exactly {HEADER_SIZE} bytes"
        )
    magic, version, flags, stream, seq, length, crc, reserved = HEADER_STRUCT.unpack(view)
    if magic != NGPU_MAGIC:
        raise ProtocolError.bad(
            "NGPU magic", magic, f"expected {NGPU_MAGIC!r} (not a framed-mode stream?)"
        )
    if version != NGPU_VERSION:
        raise ProtocolError.bad("NGPU version", version, f"expected {NGPU_VERSION}")
    _check_flags(flags, crc)
    if reserved != 0:
        raise ProtocolError.bad("NGPU reserved", reserved, "must be 0")
    if max_length is not None and length > max_length:
        raise ProtocolError.bad(
            "NGPU length", length, f"payload length {length} exceeds the limit {max_length}"
        )
    return stream, seq, length, flags, crc


def _check_flags(flags: int, crc: int) -> None:
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError.bad(
            "NGPU flags",
            flags,
            f"unknown bits 0x{flags & ~KNOWN_FLAGS:02x}",
            shown=f"0x{flags:02x}",
        )
    # A crc the receiver would not check is either a sender bug or a flag bit
    # lost in transit; refusing it keeps one meaning per header.
    if crc and not flags & FLAG_CRC:
        raise ProtocolError.bad(
            "NGPU crc", crc, "must be 0 when FLAG_CRC is not set", shown=f"0x{crc:08x}"
        )


def header_for(
    stream: int, seq: int, payload: bytes | bytearray | memoryview, crc: bool = False
) -> Header:
    """The header to send in front of *payload*; with ``crc=True`` it carries zlib.crc32."""
    view = as_view(payload, "NGPU payload")
    if crc:
        return Header(stream, seq, view.nbytes, FLAG_CRC, zlib.crc32(view))
    return Header(stream, seq, view.nbytes)


def check_payload(header: Header, payload: bytes | bytearray | memoryview) -> None:
    """Verify *payload* against ``header.crc``; does nothing when FLAG_CRC is not set.

    For a payload received in pieces, compute ``zlib.crc32(piece, running)``
    across them and compare with ``header.crc`` instead.
    """
    if not header.flags & FLAG_CRC:
        return
    view = as_view(payload, "NGPU payload")
    if view.nbytes != header.length:
        raise ProtocolError.bad(
            "NGPU payload length", view.nbytes, f"header says {header.length} bytes"
        )
    found = zlib.crc32(view)
    if found != header.crc:
        raise ProtocolError.bad(
            "NGPU payload crc32",
            found,
            f"header says 0x{header.crc:08x} (payload corrupted in transit)",
            shown=f"0x{found:08x}",
        )
