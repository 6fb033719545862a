"""The PF2VF / VF2PF shared info blocks and their keyed checksum."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvirt.protocol import ProtocolError
from gpuvirt.protocol.info import (
    BLOCK_SIZE,
    CHECKSUM_OFFSET,
    FEATURE_FB_MAPPED,
    FEATURE_NETGPU,
    FEATURE_STAGING,
    PF2VF,
    PF2VF_OFFSET,
    PF2VF_VERSION,
    RESERVED_SIZE,
    VF2PF,
    VF2PF_OFFSET,
    VF2PF_VERSION,
    checksum,
)

U32 = 2**32 - 1
U64 = 2**64 - 1
KEY = 0x5EED1234

u32s = st.integers(0, U32)
u64s = st.integers(0, U64)
pf2vfs = st.builds(
    PF2VF,
    feature_flags=u32s,
    fb_size=u64s,
    time_slice_us=u32s,
    vf2pf_interval_ms=u32s,
    uuid=st.binary(min_size=16, max_size=16),
    vf_index=u32s,
)
# Text whose utf-8 form fits the 63 usable bytes of the 64-byte field.
driver_versions = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=63
).filter(lambda s: len(s.encode()) <= 63)
vf2pfs = st.builds(
    VF2PF, driver_version=driver_versions, pid=u32s, fb_used=u64s, launches_completed=u64s
)

SAMPLE_PF2VF = PF2VF(
    feature_flags=FEATURE_FB_MAPPED,
    fb_size=0x0200_0000,
    time_slice_us=10_000,
    vf2pf_interval_ms=2000,
    uuid=bytes(range(16)),
    vf_index=5,
)
SAMPLE_VF2PF = VF2PF(driver_version="gv-1.0", pid=0x1234, fb_used=0x100, launches_completed=7)


def decode_or_none(decode: Callable[[bytes, int], object], data: object, key: int) -> object | None:
    """Decode, turning ProtocolError into None; any other exception fails the test."""
    try:
        return decode(data, key)  # type: ignore[arg-type]
    except ProtocolError:
        return None


def reseal(block: bytes | bytearray, key: int) -> bytes:
    """Rewrite the checksum so a test reaches the checks behind it."""
    data = bytearray(block)
    struct.pack_into("<I", data, CHECKSUM_OFFSET, checksum(data, key, CHECKSUM_OFFSET))
    return bytes(data)


# ---------------------------------------------------------------- checksum


def test_checksum_small_hand_example() -> None:
    # key 10 + bytes 1, 2, 3; the four 0xff at offset 2 are the checksum field.
    assert checksum(b"\x01\x02\xff\xff\xff\xff\x03", 10, 2) == 16


def test_checksum_wraps_at_32_bits() -> None:
    assert checksum(b"\x02\0\0\0\0", U32, 1) == 1


def test_checksum_bytes_are_unsigned() -> None:
    # amdgpu sums through unsigned char *: 0x80 adds 128, not -128.
    assert checksum(b"\x80\xff\0\0\0\0", 0, 2) == 0x80 + 0xFF


def test_checksum_of_a_pf2vf_by_hand() -> None:
    # key 0x1000; size 1024 = 00 04 00 00 -> 4; version 2; flags 1;
    # fb_size 0x02000000 -> 2; time slice 10000 = 0x2710 -> 0x10 + 0x27 = 55;
    # interval 2000 = 0x07d0 -> 0xd0 + 0x07 = 215; uuid 0..15 -> 120; vf_index 5.
    expected = 0x1000 + 4 + 2 + 1 + 2 + 55 + 215 + 120 + 5
    assert expected == 4500
    block = SAMPLE_PF2VF.encode(0x1000)
    assert struct.unpack_from("<I", block, CHECKSUM_OFFSET)[0] == expected
    assert checksum(block, 0x1000, CHECKSUM_OFFSET) == expected


def test_checksum_of_a_vf2pf_by_hand() -> None:
    # key 0xffffffff (-1 mod 2**32); size 4; version 3; "gv-1.0" =
    # 103+118+45+49+46+48 = 409; pid 0x1234 -> 0x34 + 0x12 = 70; fb_used 1; launches 7.
    expected = (U32 + 4 + 3 + 409 + 70 + 1 + 7) % 2**32
    assert expected == 493
    block = SAMPLE_VF2PF.encode(U32)
    assert struct.unpack_from("<I", block, CHECKSUM_OFFSET)[0] == expected


@pytest.mark.parametrize(("key", "offset"), [(-1, 0), (2**32, 0), (0, -1), (0, 5), (0, 100)])
def test_checksum_refuses_bad_arguments(key: int, offset: int) -> None:
    with pytest.raises(ProtocolError):
        checksum(bytes(8), key, offset)


# ---------------------------------------------------------------- layout


def test_reserved_area_layout() -> None:
    assert PF2VF_OFFSET == 64 * 1024 and VF2PF_OFFSET == 65 * 1024 and BLOCK_SIZE == 1024
    assert PF2VF_OFFSET + BLOCK_SIZE <= VF2PF_OFFSET
    assert VF2PF_OFFSET + BLOCK_SIZE <= RESERVED_SIZE == 128 * 1024
    assert (FEATURE_FB_MAPPED, FEATURE_STAGING, FEATURE_NETGPU) == (1, 2, 4)


def test_pf2vf_field_offsets() -> None:
    block = PF2VF(
        feature_flags=0x11223344,
        fb_size=0x0102030405060708,
        time_slice_us=0x0A0B0C0D,
        vf2pf_interval_ms=2000,
        uuid=b"U" * 16,
        vf_index=30,
    ).encode(KEY)
    assert len(block) == BLOCK_SIZE
    assert struct.unpack_from("<II", block, 0) == (1024, PF2VF_VERSION)
    assert block[12:16] == bytes.fromhex("44332211")
    assert block[16:24] == bytes.fromhex("0807060504030201")
    assert block[24:28] == bytes.fromhex("0d0c0b0a")
    assert struct.unpack_from("<I", block, 28) == (2000,)
    assert block[32:48] == b"U" * 16
    assert struct.unpack_from("<I", block, 48) == (30,)
    assert block[52:] == bytes(BLOCK_SIZE - 52)


def test_vf2pf_field_offsets() -> None:
    block = VF2PF("v", 0x01020304, 0x1122334455667788, 9).encode(KEY)
    assert struct.unpack_from("<II", block, 0) == (1024, VF2PF_VERSION)
    assert block[12:76] == b"v" + bytes(63)
    assert block[76:80] == bytes.fromhex("04030201")
    assert block[80:88] == bytes.fromhex("8877665544332211")
    assert struct.unpack_from("<Q", block, 88) == (9,)
    assert block[104:] == bytes(BLOCK_SIZE - 104)


# ---------------------------------------------------------------- round trips


@given(info=pf2vfs, key=u32s)
def test_pf2vf_round_trip(info: PF2VF, key: int) -> None:
    block = info.encode(key)
    assert len(block) == BLOCK_SIZE
    assert PF2VF.decode(block, key) == info


@given(info=vf2pfs, key=u32s)
def test_vf2pf_round_trip(info: VF2PF, key: int) -> None:
    block = info.encode(key)
    assert len(block) == BLOCK_SIZE
    assert VF2PF.decode(block, key) == info


@given(info=pf2vfs, key=u32s, other=u32s)
def test_pf2vf_key_matters(info: PF2VF, key: int, other: int) -> None:
    block = info.encode(key)
    if other == key:
        assert PF2VF.decode(block, other) == info
    else:
        with pytest.raises(ProtocolError, match="checksum"):
            PF2VF.decode(block, other)


@given(info=vf2pfs, key=u32s, other=u32s)
def test_vf2pf_key_matters(info: VF2PF, key: int, other: int) -> None:
    block = info.encode(key)
    if other == key:
        assert VF2PF.decode(block, other) == info
    else:
        with pytest.raises(ProtocolError, match="checksum"):
            VF2PF.decode(block, other)


def test_checksum_message_gives_expected_and_found() -> None:
    block = SAMPLE_PF2VF.encode(0x1000)
    with pytest.raises(ProtocolError) as info:
        PF2VF.decode(block, 0x1001)
    assert "0x00001194" in str(info.value)  # found: 4500 as written with key 0x1000
    assert "0x00001195" in str(info.value)  # expected under key 0x1001


def test_decode_from_a_slice_of_a_mapped_fb() -> None:
    fb = bytearray(RESERVED_SIZE)
    fb[PF2VF_OFFSET : PF2VF_OFFSET + BLOCK_SIZE] = SAMPLE_PF2VF.encode(KEY)
    fb[VF2PF_OFFSET : VF2PF_OFFSET + BLOCK_SIZE] = SAMPLE_VF2PF.encode(KEY)
    view = memoryview(fb)
    pf2vf = PF2VF.decode(view[PF2VF_OFFSET : PF2VF_OFFSET + BLOCK_SIZE], KEY)
    vf2pf = VF2PF.decode(view[VF2PF_OFFSET : VF2PF_OFFSET + BLOCK_SIZE], KEY)
    assert (pf2vf, vf2pf) == (SAMPLE_PF2VF, SAMPLE_VF2PF)
    # The decoded value is a snapshot, not a window onto memory the other side rewrites.
    fb[PF2VF_OFFSET + 32 : PF2VF_OFFSET + 48] = b"X" * 16
    assert type(pf2vf.uuid) is bytes and pf2vf.uuid == bytes(range(16))


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize(
    ("cls", "sample"), [(PF2VF, SAMPLE_PF2VF), (VF2PF, SAMPLE_VF2PF)], ids=["PF2VF", "VF2PF"]
)
def test_every_single_byte_corruption_is_refused(cls: type, sample: PF2VF | VF2PF) -> None:
    # A one-byte change moves the byte sum by 1..255, or changes the stored
    # checksum: the keyed checksum catches every one of them.
    original = sample.encode(KEY)
    for pos in range(BLOCK_SIZE):
        for flip in (0x01, 0x80, 0xFF, 0x5A):
            data = bytearray(original)
            data[pos] ^= flip
            assert decode_or_none(cls.decode, bytes(data), KEY) is None, (pos, flip)


@given(info=vf2pfs, key=u32s, pos=st.integers(0, BLOCK_SIZE - 1), value=st.integers(0, 255))
def test_vf2pf_random_single_byte_corruption(info: VF2PF, key: int, pos: int, value: int) -> None:
    data = bytearray(info.encode(key))
    changed = data[pos] != value
    data[pos] = value
    decoded = decode_or_none(VF2PF.decode, bytes(data), key)
    assert decoded == (None if changed else info)


def random_blocks(version: int, used: int) -> st.SearchStrategy[bytes]:
    """Blocks with a right header and random fields; the padding is mostly zero.

    The checksum is resealed by the test, so only the field checks decide.
    """
    fields = st.binary(min_size=used - 12, max_size=used - 12)
    padding = st.one_of(
        st.just(bytes(BLOCK_SIZE - used)),
        st.binary(min_size=BLOCK_SIZE - used, max_size=BLOCK_SIZE - used),
    )
    head = struct.pack("<III", BLOCK_SIZE, version, 0)
    return st.tuples(fields, padding).map(lambda parts: head + parts[0] + parts[1])


@given(block=random_blocks(PF2VF_VERSION, 52), key=u32s)
def test_pf2vf_random_fields_with_a_valid_checksum(block: bytes, key: int) -> None:
    data = reseal(block, key)
    decoded = decode_or_none(PF2VF.decode, data, key)
    # Every field value is legal, so only nonzero padding may refuse the block.
    assert (decoded is None) == any(data[52:])
    if decoded is not None:
        assert decoded.encode(key) == data


@given(block=random_blocks(VF2PF_VERSION, 104), key=u32s)
def test_vf2pf_random_fields_with_a_valid_checksum(block: bytes, key: int) -> None:
    data = reseal(block, key)
    decoded = decode_or_none(VF2PF.decode, data, key)
    if decoded is not None:
        # Whatever the field checks accept must be the one encoding of its value.
        assert decoded.encode(key) == data


@given(data=st.binary(max_size=2 * BLOCK_SIZE), key=u32s)
def test_random_bytes(data: bytes, key: int) -> None:
    for cls in (PF2VF, VF2PF):
        decoded = decode_or_none(cls.decode, data, key)
        if decoded is not None:
            assert decoded.encode(key) == data


@pytest.mark.parametrize("cls", [PF2VF, VF2PF])
@pytest.mark.parametrize(
    "size", [0, 1, 12, BLOCK_SIZE - 1, BLOCK_SIZE + 1, RESERVED_SIZE, 16 << 20]
)
def test_wrong_lengths(cls: type, size: int) -> None:
    with pytest.raises(ProtocolError, match="length"):
        cls.decode(bytes(size), KEY)


@pytest.mark.parametrize(
    ("cls", "sample"), [(PF2VF, SAMPLE_PF2VF), (VF2PF, SAMPLE_VF2PF)], ids=["PF2VF", "VF2PF"]
)
def test_truncated_prefixes(cls: type, sample: PF2VF | VF2PF) -> None:
    block = sample.encode(KEY)
    for end in range(BLOCK_SIZE):
        with pytest.raises(ProtocolError):
            cls.decode(block[:end], KEY)


@pytest.mark.parametrize("data", [None, "x" * BLOCK_SIZE, BLOCK_SIZE, [0] * BLOCK_SIZE])
def test_non_buffers(data: object) -> None:
    for cls in (PF2VF, VF2PF):
        with pytest.raises(ProtocolError):
            cls.decode(data, KEY)


# ---------------------------------------------------------------- field checks behind the checksum


def _patched(block: bytes, offset: int, raw: bytes) -> bytes:
    data = bytearray(block)
    data[offset : offset + len(raw)] = raw
    return reseal(data, KEY)


@pytest.mark.parametrize(
    ("cls", "sample", "offset", "raw", "field"),
    [
        (PF2VF, SAMPLE_PF2VF, 0, struct.pack("<I", 512), "size"),
        (PF2VF, SAMPLE_PF2VF, 4, struct.pack("<I", 1), "version"),
        (PF2VF, SAMPLE_PF2VF, 4, struct.pack("<I", 3), "version"),
        (PF2VF, SAMPLE_PF2VF, 52, b"\x01", "padding"),
        (PF2VF, SAMPLE_PF2VF, 1023, b"\x01", "padding"),
        (VF2PF, SAMPLE_VF2PF, 0, struct.pack("<I", 2048), "size"),
        (VF2PF, SAMPLE_VF2PF, 4, struct.pack("<I", 2), "version"),
        (VF2PF, SAMPLE_VF2PF, 104, b"\x01", "padding"),
        (VF2PF, SAMPLE_VF2PF, 12, b"v" * 64, "NUL"),
        (VF2PF, SAMPLE_VF2PF, 12, b"v\0x", "after the terminating NUL"),
        (VF2PF, SAMPLE_VF2PF, 12, b"\xff\xfe", "utf-8"),
        (VF2PF, SAMPLE_VF2PF, 12, b"\xc3", "utf-8"),
    ],
)
def test_checks_behind_a_valid_checksum(
    cls: type, sample: PF2VF | VF2PF, offset: int, raw: bytes, field: str
) -> None:
    with pytest.raises(ProtocolError, match=field):
        cls.decode(_patched(sample.encode(KEY), offset, raw), KEY)


def test_driver_version_uses_the_whole_field() -> None:
    for text in ("", "a" * 63, "é" * 31, "\U0001f680" * 15):
        assert VF2PF.decode(VF2PF(text, 1, 2, 3).encode(KEY), KEY).driver_version == text


@pytest.mark.parametrize(
    "info",
    [
        VF2PF("a" * 64, 1, 2, 3),
        VF2PF("é" * 32, 1, 2, 3),  # 64 utf-8 bytes
        VF2PF("a\0b", 1, 2, 3),
        VF2PF("\ud800", 1, 2, 3),  # a lone surrogate has no utf-8 form
        VF2PF(b"gv", 1, 2, 3),  # type: ignore[arg-type]
        VF2PF("gv", -1, 2, 3),
        VF2PF("gv", 2**32, 2, 3),
        VF2PF("gv", 1, 2**64, 3),
        VF2PF("gv", 1, 2, -3),
    ],
)
def test_vf2pf_encode_refuses(info: VF2PF) -> None:
    with pytest.raises(ProtocolError, match="VF2PF"):
        info.encode(KEY)


@pytest.mark.parametrize(
    "info",
    [
        PF2VF(1, 2, 3, 4, bytes(15), 0),
        PF2VF(1, 2, 3, 4, "u" * 16, 0),  # type: ignore[arg-type]
        PF2VF(-1, 2, 3, 4, bytes(16), 0),
        PF2VF(1, 2**64, 3, 4, bytes(16), 0),
        PF2VF(1, 2, 2**32, 4, bytes(16), 0),
        PF2VF(1, 2, 3, -4, bytes(16), 0),
        PF2VF(1, 2, 3, 4, bytes(16), 2**32),
    ],
)
def test_pf2vf_encode_refuses(info: PF2VF) -> None:
    with pytest.raises(ProtocolError, match="PF2VF"):
        info.encode(KEY)


@pytest.mark.parametrize("key", [-1, 2**32, None])
def test_bad_keys_are_refused(key: object) -> None:
    with pytest.raises(ProtocolError, match="key"):
        SAMPLE_PF2VF.encode(key)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="key"):
        VF2PF.decode(SAMPLE_VF2PF.encode(KEY), key)  # type: ignore[arg-type]
