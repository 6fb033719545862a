"""The NetGPU framed-mode header and payload checks."""

from __future__ import annotations

import array
import struct
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvirt.protocol import ProtocolError
from gpuvirt.protocol.frames import (
    FLAG_CRC,
    HEADER_SIZE,
    KNOWN_FLAGS,
    NGPU_MAGIC,
    NGPU_VERSION,
    Header,
    check_payload,
    header_for,
    unpack_header,
)

U32 = 2**32 - 1
U64 = 2**64 - 1


def decode_or_none(decode: Callable[[bytes], object], data: object) -> object | None:
    """Decode, turning ProtocolError into None; any other exception fails the test."""
    try:
        return decode(data)  # type: ignore[arg-type]
    except ProtocolError:
        return None


def raw_header(
    magic: bytes = b"NGPU",
    version: int = 1,
    flags: int = 0,
    stream: int = 2,
    seq: int = 7,
    length: int = 100,
    crc: int = 0,
    reserved: int = 0,
) -> bytes:
    return struct.pack("<4sBBHQQII", magic, version, flags, stream, seq, length, crc, reserved)


headers = st.one_of(
    st.builds(
        Header,
        stream=st.integers(0, 0xFFFF),
        seq=st.integers(0, U64),
        length=st.integers(0, U64),
    ),
    st.builds(
        Header,
        stream=st.integers(0, 0xFFFF),
        seq=st.integers(0, U64),
        length=st.integers(0, U64),
        flags=st.just(FLAG_CRC),
        crc=st.integers(0, U32),
    ),
)


def test_constants() -> None:
    assert NGPU_MAGIC == b"NGPU" and NGPU_VERSION == 1 and HEADER_SIZE == 32
    assert FLAG_CRC == KNOWN_FLAGS == 0x01


def test_golden_bytes() -> None:
    data = Header(stream=0x0102, seq=0x03, length=0x1000, flags=FLAG_CRC, crc=0xAABBCCDD).encode()
    assert data == (
        b"NGPU"
        + b"\x01"  # version
        + b"\x01"  # flags
        + b"\x02\x01"  # stream
        + b"\x03\0\0\0\0\0\0\0"  # seq
        + b"\x00\x10\0\0\0\0\0\0"  # length
        + b"\xdd\xcc\xbb\xaa"  # crc32
        + bytes(4)  # reserved
    )
    assert len(data) == HEADER_SIZE


@given(headers)
def test_round_trip(header: Header) -> None:
    data = header.encode()
    assert len(data) == HEADER_SIZE
    assert Header.decode(data) == header
    assert Header.decode(memoryview(bytearray(data))) == header


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (raw_header(magic=b"NGPV"), "magic"),
        (raw_header(magic=b"GET "), "magic"),
        (raw_header(version=0), "version"),
        (raw_header(version=2), "version"),
        (raw_header(flags=0x02), "flags"),
        (raw_header(flags=0x80), "flags"),
        (raw_header(flags=0xFF), "flags"),
        (raw_header(reserved=1), "reserved"),
        (raw_header(crc=1), "FLAG_CRC"),
        (raw_header(crc=U32), "FLAG_CRC"),
    ],
)
def test_decode_refuses(data: bytes, field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        Header.decode(data)


def test_crc_zero_is_legal_with_the_flag() -> None:
    assert Header.decode(raw_header(flags=FLAG_CRC, crc=0)).crc == 0


def test_max_length() -> None:
    data = raw_header(length=4096)
    assert Header.decode(data, max_length=4096).length == 4096
    assert Header.decode(data).length == 4096
    with pytest.raises(ProtocolError, match="payload length 4096 exceeds the limit 4095"):
        Header.decode(data, max_length=4095)
    with pytest.raises(ProtocolError, match="exceeds"):
        Header.decode(raw_header(length=U64), max_length=1 << 30)


@pytest.mark.parametrize(
    "header",
    [
        Header(stream=0x10000, seq=0, length=0),
        Header(stream=-1, seq=0, length=0),
        Header(stream=0, seq=2**64, length=0),
        Header(stream=0, seq=0, length=-1),
        Header(stream=0, seq=0, length=2**64),
        Header(stream=0, seq=0, length=0, flags=0x02),
        Header(stream=0, seq=0, length=0, flags=0x100),
        Header(stream=0, seq=0, length=0, crc=5),
        Header(stream=0, seq=0, length=0, flags=FLAG_CRC, crc=2**32),
        Header(stream=0, seq=0, length=1.5),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses(header: Header) -> None:
    with pytest.raises(ProtocolError, match="NGPU"):
        header.encode()


@pytest.mark.parametrize(
    "header",
    [Header(stream=2, seq=7, length=100), Header(stream=2, seq=7, length=100, flags=1, crc=0xABC)],
    ids=["plain", "crc"],
)
def test_every_single_byte_corruption(header: Header) -> None:
    original = header.encode()
    accepted_at: set[int] = set()
    for pos in range(HEADER_SIZE):
        for value in range(256):
            if value == original[pos]:
                continue
            data = bytearray(original)
            data[pos] = value
            decoded = decode_or_none(Header.decode, bytes(data))
            if decoded is not None:
                assert decoded.encode() == data, (pos, value)
                accepted_at.add(pos)
    # Stream, seq and length bytes (and the crc when the flag is set) may carry
    # any value, and a plain header may gain FLAG_CRC (a crc of 0 is legal);
    # magic, version, reserved and an unflagged crc never change silently.
    crc_bytes = set(range(24, 28)) if header.flags & FLAG_CRC else set()
    assert accepted_at == set(range(6, 24)) | crc_bytes | ({5} if not header.flags else set())


@given(st.binary(max_size=3 * HEADER_SIZE))
def test_random_bytes(data: bytes) -> None:
    decoded = decode_or_none(Header.decode, data)
    if decoded is not None:
        assert decoded.encode() == data


@given(st.binary(min_size=HEADER_SIZE - 5, max_size=HEADER_SIZE - 5))
def test_random_bytes_after_magic_and_version(rest: bytes) -> None:
    data = b"NGPU\x01" + rest
    decoded = decode_or_none(Header.decode, data)
    if decoded is not None:
        assert decoded.encode() == data


def outcome(data: object, max_length: int | None) -> object:
    try:
        return unpack_header(data, max_length)
    except ProtocolError as e:
        return e.field


@given(
    magic=st.sampled_from([b"NGPU", b"NGPV", b"\0\0\0\0"]),
    version=st.sampled_from([0, 1, 2, 255]),
    flags=st.integers(0, 255),
    stream=st.integers(0, 0xFFFF),
    seq=st.integers(0, U64),
    length=st.integers(0, U64),
    crc=st.sampled_from([0, 1, U32]),
    reserved=st.sampled_from([0, 1, U32]),
    max_length=st.one_of(st.none(), st.integers(0, U64)),
)
def test_a_bytearray_header_takes_the_short_path_to_the_same_answer(
    magic: bytes, version: int, flags: int, stream: int, seq: int, length: int, crc: int,
    reserved: int, max_length: int | None,
) -> None:  # fmt: skip
    """A receiver's header buffer (a bytearray) is accepted on one comparison chain; it
    must accept and refuse exactly what the full checks do, naming the same field."""
    data = raw_header(magic, version, flags, stream, seq, length, crc, reserved)
    fast = outcome(bytearray(data), max_length)
    assert fast == outcome(memoryview(data), max_length)
    if not isinstance(fast, str):
        assert fast == (stream, seq, length, flags, crc)
        assert Header.decode(data, max_length) == Header(stream, seq, length, flags, crc)


@pytest.mark.parametrize("size", [0, 1, HEADER_SIZE - 1, HEADER_SIZE + 1, 16 << 20])
def test_wrong_lengths(size: int) -> None:
    data = (raw_header() * (size // HEADER_SIZE + 1))[:size]
    with pytest.raises(ProtocolError, match="length"):
        Header.decode(data)


def test_truncated_prefixes() -> None:
    data = raw_header()
    for end in range(HEADER_SIZE):
        with pytest.raises(ProtocolError):
            Header.decode(data[:end])


@pytest.mark.parametrize("data", [None, "NGPU" * 8, 32, [0] * 32])
def test_non_buffers(data: object) -> None:
    with pytest.raises(ProtocolError):
        Header.decode(data)  # type: ignore[arg-type]


# ---------------------------------------------------------------- payloads


@given(stream=st.integers(0, 0xFFFF), seq=st.integers(0, U64), payload=st.binary(max_size=256))
def test_header_for(stream: int, seq: int, payload: bytes) -> None:
    plain = header_for(stream, seq, payload)
    assert plain == Header(stream, seq, len(payload))
    checked = header_for(stream, seq, payload, crc=True)
    assert checked == Header(stream, seq, len(payload), FLAG_CRC, zlib.crc32(payload))
    wire = Header.decode(checked.encode())
    check_payload(wire, payload)
    check_payload(wire, memoryview(bytearray(payload)))


def test_header_for_counts_bytes_not_items() -> None:
    words = array.array("I", range(10))
    header = header_for(0, 0, memoryview(words), crc=True)
    assert header.length == 40
    assert header.crc == zlib.crc32(words.tobytes())
    check_payload(header, memoryview(words))


@given(payload=st.binary(min_size=1, max_size=256), data=st.data())
def test_check_payload_catches_any_single_byte_change(payload: bytes, data: st.DataObject) -> None:
    header = header_for(1, 1, payload, crc=True)
    pos = data.draw(st.integers(0, len(payload) - 1))
    corrupt = bytearray(payload)
    corrupt[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ProtocolError, match="crc32"):
        check_payload(header, corrupt)


def test_check_payload_wrong_length() -> None:
    header = header_for(1, 1, b"abcd", crc=True)
    with pytest.raises(ProtocolError, match="header says 4"):
        check_payload(header, b"abcde")


def test_check_payload_is_a_no_op_without_the_flag() -> None:
    header = header_for(1, 1, b"abcd")
    check_payload(header, b"something else entirely")
    check_payload(header, b"")


def test_check_payload_refuses_non_buffers() -> None:
    with pytest.raises(ProtocolError):
        check_payload(header_for(1, 1, b"ab", crc=True), "ab")  # type: ignore[arg-type]
