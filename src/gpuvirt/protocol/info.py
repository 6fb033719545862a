"""The shared info blocks in the reserved head of every VF's FB (pure, no I/O).

Modelled on amdgpu/GIM's PF2VF and VF2PF blocks. The first
:data:`RESERVED_SIZE` bytes of each FB are reserved; the host writes
:class:`PF2VF` at :data:`PF2VF_OFFSET` and the guest writes :class:`VF2PF` at
:data:`VF2PF_OFFSET`, each :data:`BLOCK_SIZE` bytes, little-endian, zero
padded. Both carry a checksum keyed per VF (the key travels in
READY_TO_ACCESS_GPU's DW2), so a block written for another VF, a torn write
or stray bytes fail verification instead of being believed.

Callers slice the FB themselves (``fb[PF2VF_OFFSET:PF2VF_OFFSET + BLOCK_SIZE]``)
and pass the slice in; decoding copies it once before looking at it, because
the other side may be rewriting that memory while we read it: the checksum and
the fields must come from the same snapshot.

Decoders raise :class:`ProtocolError` and nothing else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import ProtocolError, as_view, check_uint

__all__ = [
    "BLOCK_SIZE",
    "CHECKSUM_OFFSET",
    "FEATURE_FB_MAPPED",
    "FEATURE_NETGPU",
    "FEATURE_STAGING",
    "PF2VF",
    "PF2VF_OFFSET",
    "PF2VF_VERSION",
    "RESERVED_SIZE",
    "VF2PF",
    "VF2PF_OFFSET",
    "VF2PF_VERSION",
    "checksum",
]

PF2VF_OFFSET = 64 * 1024
VF2PF_OFFSET = 65 * 1024
BLOCK_SIZE = 1024
RESERVED_SIZE = 128 * 1024
PF2VF_VERSION = 2
VF2PF_VERSION = 3
CHECKSUM_OFFSET = 8  # both blocks: size u32, version u32, then the checksum u32

FEATURE_FB_MAPPED = 1  # the guest accesses its FB through the shared mapping
FEATURE_STAGING = 2  # the guest goes through a staging area (no mapped FB)
FEATURE_NETGPU = 4  # NetGPU receive into this VF's FB is available

DRIVER_VERSION_FIELD = 64  # bytes, NUL padded; so at most 63 bytes of text

_PF2VF = struct.Struct("<IIIIQII16sI")
_VF2PF = struct.Struct("<III64sIQQQ")
_ZEROS = bytes(BLOCK_SIZE)
_U32 = 0xFFFFFFFF


def checksum(block: bytes, key: int, checksum_offset: int) -> int:
    """amdgpu's ``amd_sriov_msg_checksum``: key + the byte sum of *block*, mod 2**32.

    The 4 bytes at *checksum_offset* are subtracted again, so the stored
    checksum counts as zero and the same function both fills and verifies it.
    Bytes are unsigned (amdgpu reads them through ``unsigned char *``).
    """
    view = as_view(block, "checksum block")
    check_uint("checksum key", key, 32)
    if not isinstance(checksum_offset, int) or not 0 <= checksum_offset <= view.nbytes - 4:
        raise ProtocolError.bad(
            "checksum offset",
            checksum_offset,
            f"the 4-byte field must lie inside the {view.nbytes}-byte block",
        )
    field = view[checksum_offset : checksum_offset + 4]
    return (key + sum(view) - sum(field)) & _U32


@dataclass(frozen=True)
class PF2VF:
    """Host → guest: what the guest's VF is. Written by the host before GPU_INIT_DATA_READY.

    Layout: size u32 (=1024) @0, version u32 (=2) @4, checksum u32 @8,
    feature_flags u32 @12, fb_size u64 @16, time_slice_us u32 @24,
    vf2pf_interval_ms u32 @28, uuid 16s @32, vf_index u32 @48, zeros to 1024.
    Unknown feature bits are kept, not refused: a guest tests the bits it knows.
    """

    feature_flags: int
    fb_size: int
    time_slice_us: int
    vf2pf_interval_ms: int
    uuid: bytes
    vf_index: int

    def encode(self, key: int) -> bytes:
        uuid = self.uuid
        if not isinstance(uuid, bytes | bytearray) or len(uuid) != 16:
            raise ProtocolError.bad("PF2VF uuid", uuid, "must be exactly 16 bytes")
        head = _PF2VF.pack(
            BLOCK_SIZE,
            PF2VF_VERSION,
            0,
            check_uint("PF2VF feature_flags", self.feature_flags, 32),
            check_uint("PF2VF fb_size", self.fb_size, 64),
            check_uint("PF2VF time_slice_us", self.time_slice_us, 32),
            check_uint("PF2VF vf2pf_interval_ms", self.vf2pf_interval_ms, 32),
            bytes(uuid),
            check_uint("PF2VF vf_index", self.vf_index, 32),
        )
        return _seal(head, key, "PF2VF")

    @classmethod
    def decode(cls, block: bytes, key: int) -> PF2VF:
        raw = _open(block, key, "PF2VF", PF2VF_VERSION, _PF2VF.size)
        _size, _version, _sum, flags, fb_size, slice_us, interval, uuid, vf_index = (
            _PF2VF.unpack_from(raw)
        )
        return cls(
            feature_flags=flags,
            fb_size=fb_size,
            time_slice_us=slice_us,
            vf2pf_interval_ms=interval,
            uuid=uuid,
            vf_index=vf_index,
        )


@dataclass(frozen=True)
class VF2PF:
    """Guest → host: what the guest reports about itself, rewritten periodically.

    Layout: size u32 (=1024) @0, version u32 (=3) @4, checksum u32 @8,
    driver_version 64s @12 (utf-8, at most 63 bytes, NUL padded), pid u32 @76,
    fb_used u64 @80, launches_completed u64 @88, netgpu_rx_bytes u64 @96, zeros to 1024.
    """

    driver_version: str
    pid: int
    fb_used: int
    launches_completed: int
    netgpu_rx_bytes: int = 0

    def encode(self, key: int) -> bytes:
        head = _VF2PF.pack(
            BLOCK_SIZE,
            VF2PF_VERSION,
            0,
            _encode_driver_version(self.driver_version),
            check_uint("VF2PF pid", self.pid, 32),
            check_uint("VF2PF fb_used", self.fb_used, 64),
            check_uint("VF2PF launches_completed", self.launches_completed, 64),
            check_uint("VF2PF netgpu_rx_bytes", self.netgpu_rx_bytes, 64),
        )
        return _seal(head, key, "VF2PF")

    @classmethod
    def decode(cls, block: bytes, key: int) -> VF2PF:
        raw = _open(block, key, "VF2PF", VF2PF_VERSION, _VF2PF.size)
        _size, _version, _sum, version_field, pid, fb_used, launches, rx = _VF2PF.unpack_from(raw)
        return cls(
            driver_version=_decode_driver_version(version_field),
            pid=pid,
            fb_used=fb_used,
            launches_completed=launches,
            netgpu_rx_bytes=rx,
        )


def _seal(head: bytes, key: int, name: str) -> bytes:
    check_uint(f"{name} key", key, 32)
    block = bytearray(BLOCK_SIZE)
    block[: len(head)] = head
    # The field is still zero here, which is exactly how checksum() counts it.
    struct.pack_into("<I", block, CHECKSUM_OFFSET, checksum(block, key, CHECKSUM_OFFSET))
    return bytes(block)


def _open(block: bytes, key: int, name: str, version: int, used: int) -> bytes:
    """Snapshot *block* and verify everything but the typed fields; return the snapshot."""
    view = as_view(block, name)
    if view.nbytes != BLOCK_SIZE:
        raise ProtocolError.bad(
            f"{name} block length", view.nbytes, f"must be exactly {BLOCK_SIZE} bytes"
        )
    check_uint(f"{name} key", key, 32)
    raw = bytes(view)
    size, found_version, stored = struct.unpack_from("<III", raw)
    if size != BLOCK_SIZE:
        raise ProtocolError.bad(f"{name} size", size, f"expected {BLOCK_SIZE}")
    if found_version != version:
        raise ProtocolError.bad(f"{name} version", found_version, f"expected {version}")
    expected = checksum(raw, key, CHECKSUM_OFFSET)
    if stored != expected:
        raise ProtocolError.bad(
            f"{name} checksum",
            stored,
            f"expected 0x{expected:08x} for this VF's key "
            "(corrupt or torn block, or written with another key)",
            shown=f"0x{stored:08x}",
        )
    if raw[used:] != _ZEROS[used:]:
        first = used + next(i for i, b in enumerate(raw[used:]) if b)
        raise ProtocolError.bad(
            f"{name} padding byte @{first}", raw[first], f"bytes {used}..{BLOCK_SIZE - 1} must be 0"
        )
    return raw


def _encode_driver_version(text: object) -> bytes:
    field = "VF2PF driver_version"
    if not isinstance(text, str):
        raise ProtocolError.bad(field, text, "expected a str")
    if "\0" in text:
        raise ProtocolError.bad(field, text, "must not contain NUL (it terminates the field)")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError.bad(field, text, f"not encodable as utf-8: {exc.reason}") from None
    if len(data) > DRIVER_VERSION_FIELD - 1:
        raise ProtocolError.bad(
            field, text, f"{len(data)} utf-8 bytes; at most {DRIVER_VERSION_FIELD - 1} fit"
        )
    return data  # struct's 64s pads with NULs


def _decode_driver_version(data: bytes) -> str:
    field = "VF2PF driver_version"
    end = data.find(b"\0")
    if end < 0:
        raise ProtocolError.bad(field, data, "no terminating NUL (at most 63 bytes of text)")
    # One value, one encoding: junk after the NUL would ride along unverified.
    if data[end:].strip(b"\0"):
        raise ProtocolError.bad(field, data, "bytes after the terminating NUL must be 0")
    try:
        return data[:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError.bad(field, data[:end], f"not valid utf-8: {exc.reason}") from None
