"""The command channel's messages and copy descriptors (protocol/command.py): what
decodes is what was encoded, and any other bytes are a ProtocolError naming what was
wrong, never another exception (the engine replies BAD_REQUEST with it and goes on)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvirt.protocol import ProtocolError
from gpuvirt.protocol.command import (
    COPY,
    HEADER,
    HEADER_SIZE,
    MAX_MESSAGE,
    Copy,
    Kind,
    Message,
    Status,
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
messages = st.builds(
    Message,
    st.sampled_from(Kind),
    u64,
    u32,
    st.sampled_from([int(s) for s in Status]),
    st.binary(max_size=512),
)


@given(messages)
def test_a_message_decodes_to_what_was_encoded(msg: Message) -> None:
    got = Message.decode(msg.encode())
    assert got == msg and got.kind is msg.kind


@given(st.binary(max_size=HEADER_SIZE * 3))
def test_any_bytes_decode_or_fail_with_a_protocol_error(data: bytes) -> None:
    try:
        msg = Message.decode(data)
    except ProtocolError as e:
        assert str(e).startswith("command message:")
        return
    assert msg.encode() == data  # what decodes re-encodes to the same bytes


@given(st.integers(0, 255).filter(lambda k: k not in {int(k) for k in Kind}))
def test_an_unknown_kind_is_named(code: int) -> None:
    with pytest.raises(ProtocolError, match=f"unknown kind {code}"):
        Message.decode(HEADER.pack(code, 0, 0, 1, 1))


def test_reserved_bits_and_short_headers_are_refused() -> None:
    with pytest.raises(ProtocolError, match="reserved field is 7"):
        Message.decode(HEADER.pack(Kind.LAUNCH, 0, 7, 1, 1))
    with pytest.raises(ProtocolError, match="shorter than the header"):
        Message.decode(HEADER.pack(Kind.LAUNCH, 0, 0, 1, 1)[:-1])


def test_a_message_over_the_channels_limit_is_refused_before_sending() -> None:
    Message(Kind.LAUNCH, payload=b"x" * (MAX_MESSAGE - HEADER_SIZE)).encode()
    with pytest.raises(ProtocolError, match="exceeds the channel"):
        Message(Kind.LAUNCH, payload=b"x" * (MAX_MESSAGE - HEADER_SIZE + 1)).encode()


@given(st.lists(st.tuples(u64, u64, u64), min_size=1, max_size=16))
def test_copy_descriptors_round_trip_packed_one_by_one_or_together(
    ranges: list[tuple[int, int, int]],
) -> None:
    copies = [Copy(*r) for r in ranges]
    packed = b"".join(Copy.pack(*r) for r in ranges)
    assert packed == Copy.encode_many(copies)
    assert Copy.decode_many(packed) == copies
    assert [Copy.decode(c.encode()) for c in copies] == copies


@given(st.binary(max_size=COPY.size * 4))
def test_copy_payloads_of_any_other_length_are_refused(data: bytes) -> None:
    if data and len(data) % COPY.size == 0:
        assert len(Copy.decode_many(data)) == len(data) // COPY.size
        return
    with pytest.raises(ProtocolError, match="expected a positive multiple"):
        Copy.decode_many(data)
