"""The mailbox wire format: ATTACH, 16-byte frames, the liveness disambiguation, FAIL."""

from __future__ import annotations

import ast
import pathlib
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpuvirt.protocol
from gpuvirt.protocol import ProtocolError
from gpuvirt.protocol.mailbox import (
    ALIVE_MARK,
    ATTACH_SIZE,
    FRAME_SIZE,
    MAX_VFS,
    TOKEN_SIZE,
    Attach,
    FailReason,
    Frame,
    GuestMsg,
    HostMsg,
    alive_reply,
    classify_guest,
    classify_host,
    fail,
    is_alive_reply,
    query_alive,
    ready_to_access,
)

U32 = 2**32 - 1
TOKEN = bytes(range(0xA0, 0xA0 + TOKEN_SIZE))
vfs = st.integers(0, MAX_VFS - 1)
tokens = st.binary(min_size=TOKEN_SIZE, max_size=TOKEN_SIZE)
words = st.integers(0, U32)


def decode_or_none(decode: Callable[[bytes], object], data: object) -> object | None:
    """Decode, turning ProtocolError into None; any other exception fails the test."""
    try:
        return decode(data)  # type: ignore[arg-type]
    except ProtocolError:
        return None


def attach_bytes(
    magic: bytes = b"GVMB", version: int = 1, vf: int = 3, token: bytes = TOKEN, reserved: int = 0
) -> bytes:
    return struct.pack("<4sHH32sQ", magic, version, vf, token, reserved)


# ---------------------------------------------------------------- ATTACH


def test_attach_golden_bytes() -> None:
    data = Attach(vf=3, token=TOKEN).encode()
    assert data == b"GVMB" + b"\x01\x00" + b"\x03\x00" + TOKEN + bytes(8)
    assert len(data) == ATTACH_SIZE == 48


@given(vf=vfs, token=tokens)
def test_attach_round_trip(vf: int, token: bytes) -> None:
    attach = Attach(vf=vf, token=token)
    data = attach.encode()
    assert Attach.decode(data) == attach
    assert Attach.decode(bytearray(data)) == attach
    assert Attach.decode(memoryview(data)) == attach


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (attach_bytes(magic=b"GVMC"), "magic"),
        (attach_bytes(magic=b"\0\0\0\0"), "magic"),
        (attach_bytes(version=0), "version"),
        (attach_bytes(version=2), "version"),
        (attach_bytes(vf=MAX_VFS), "vf"),
        (attach_bytes(vf=0xFFFF), "vf"),
        (attach_bytes(reserved=1), "reserved"),
        (attach_bytes(reserved=1 << 63), "reserved"),
    ],
)
def test_attach_decode_refuses(data: bytes, field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        Attach.decode(data)


def test_attach_decode_accepts_the_last_vf() -> None:
    assert Attach.decode(attach_bytes(vf=MAX_VFS - 1)).vf == MAX_VFS - 1


@pytest.mark.parametrize(
    "attach",
    [
        Attach(vf=0, token=TOKEN[:-1]),
        Attach(vf=0, token=TOKEN + b"\0"),
        Attach(vf=0, token=b""),
        Attach(vf=0, token="a" * 32),  # type: ignore[arg-type]
        Attach(vf=MAX_VFS, token=TOKEN),
        Attach(vf=-1, token=TOKEN),
        Attach(vf=1.0, token=TOKEN),  # type: ignore[arg-type]
        Attach(vf=0, token=TOKEN, version=2),
        Attach(vf=0, token=TOKEN, version=True),
    ],
)
def test_attach_encode_refuses(attach: Attach) -> None:
    with pytest.raises(ProtocolError):
        attach.encode()


def test_attach_every_single_byte_corruption() -> None:
    original = attach_bytes()
    accepted = 0
    for pos in range(ATTACH_SIZE):
        for value in range(256):
            if value == original[pos]:
                continue
            data = bytearray(original)
            data[pos] = value
            decoded = decode_or_none(Attach.decode, bytes(data))
            if decoded is not None:
                # Accepted only if it means exactly what those bytes say.
                assert decoded.encode() == data, (pos, value)
                accepted += 1
    # Only the token (32 bytes x 255 values) and the low vf byte (another VF
    # below MAX_VFS: 31 values less the original) may change and still decode.
    assert accepted == TOKEN_SIZE * 255 + (MAX_VFS - 1)


@given(st.binary(max_size=3 * ATTACH_SIZE))
def test_attach_random_bytes(data: bytes) -> None:
    decoded = decode_or_none(Attach.decode, data)
    if decoded is not None:
        assert decoded.encode() == data


@given(st.binary(min_size=ATTACH_SIZE - 4, max_size=ATTACH_SIZE - 4))
def test_attach_random_bytes_after_the_magic(rest: bytes) -> None:
    data = b"GVMB" + rest
    decoded = decode_or_none(Attach.decode, data)
    if decoded is not None:
        assert decoded.encode() == data
        assert decoded.vf < MAX_VFS


@pytest.mark.parametrize("size", [0, 1, ATTACH_SIZE - 1, ATTACH_SIZE + 1, 16 << 20])
def test_attach_wrong_lengths(size: int) -> None:
    data = (attach_bytes() * (size // ATTACH_SIZE + 1))[:size]
    with pytest.raises(ProtocolError, match="length"):
        Attach.decode(data)


def test_attach_truncated_prefixes() -> None:
    data = attach_bytes()
    for end in range(ATTACH_SIZE):
        with pytest.raises(ProtocolError):
            Attach.decode(data[:end])


@pytest.mark.parametrize("data", [None, "GVMB" * 12, 48, 48.0, [0] * 48, object()])
def test_attach_non_buffers(data: object) -> None:
    with pytest.raises(ProtocolError):
        Attach.decode(data)  # type: ignore[arg-type]


def test_attach_repr_and_errors_keep_the_token_out() -> None:
    attach = Attach(vf=2, token=TOKEN)
    assert TOKEN.hex() not in repr(attach) and repr(TOKEN) not in repr(attach)
    with pytest.raises(ProtocolError) as info:
        Attach(vf=2, token=TOKEN[:-1]).encode()
    assert repr(TOKEN[:-1]) not in str(info.value)
    assert "31 bytes" in str(info.value)


# ---------------------------------------------------------------- frames


@given(msg=words, dw1=words, dw2=words, dw3=words)
def test_frame_round_trip(msg: int, dw1: int, dw2: int, dw3: int) -> None:
    frame = Frame(msg, dw1, dw2, dw3)
    data = frame.encode()
    assert len(data) == FRAME_SIZE
    assert data == struct.pack("<4I", msg, dw1, dw2, dw3)
    assert Frame.decode(data) == frame


def test_frame_golden_bytes() -> None:
    assert Frame(GuestMsg.READY_TO_RESET, 1, 0x01020304).encode() == (
        b"\xc9\0\0\0" + b"\x01\0\0\0" + b"\x04\x03\x02\x01" + b"\0\0\0\0"
    )


@pytest.mark.parametrize("bad", [-1, U32 + 1, 2**64, 1.0, "1", None, True])
@pytest.mark.parametrize("word", ["msg", "dw1", "dw2", "dw3"])
def test_frame_encode_refuses(word: str, bad: object) -> None:
    fields: dict[str, object] = {"msg": 1, "dw1": 0, "dw2": 0, "dw3": 0, word: bad}
    with pytest.raises(ProtocolError, match=word.upper() if word != "msg" else "msg"):
        Frame(**fields).encode()  # type: ignore[arg-type]


@given(st.binary(max_size=64))
def test_frame_decode_any_bytes(data: bytes) -> None:
    decoded = decode_or_none(Frame.decode, data)
    assert (decoded is not None) == (len(data) == FRAME_SIZE)
    if decoded is not None:
        assert decoded.encode() == data


@pytest.mark.parametrize("size", [0, 15, 17, 32, 16 << 20])
def test_frame_wrong_lengths(size: int) -> None:
    with pytest.raises(ProtocolError, match="16 bytes"):
        Frame.decode(bytes(size))


def test_frame_decode_keeps_unknown_ids() -> None:
    frame = Frame.decode(struct.pack("<4I", 0xDEAD, 1, 2, 3))
    assert frame == Frame(0xDEAD, 1, 2, 3)
    assert classify_guest(frame) is None
    assert classify_host(frame) is None


def test_message_ids_match_amdgpu() -> None:
    assert {m.name: m.value for m in GuestMsg} == {
        "REQ_GPU_INIT_ACCESS": 1,
        "REL_GPU_INIT_ACCESS": 2,
        "REQ_GPU_FINI_ACCESS": 3,
        "REL_GPU_FINI_ACCESS": 4,
        "REQ_GPU_RESET_ACCESS": 5,
        "REQ_GPU_INIT_DATA": 6,
        "LOG_VF_ERROR": 200,
        "READY_TO_RESET": 201,
    }
    assert {m.name: m.value for m in HostMsg} == {
        "READY_TO_ACCESS_GPU": 1,
        "FLR_NOTIFICATION": 2,
        "FLR_NOTIFICATION_COMPLETION": 3,
        "SUCCESS": 4,
        "FAIL": 5,
        "QUERY_ALIVE": 6,
        "GPU_INIT_DATA_READY": 7,
    }


@pytest.mark.parametrize("msg", list(GuestMsg))
def test_classify_guest_known(msg: GuestMsg) -> None:
    assert classify_guest(Frame.decode(Frame(msg).encode())) is msg


@pytest.mark.parametrize("msg", list(HostMsg))
def test_classify_host_known(msg: HostMsg) -> None:
    assert classify_host(Frame.decode(Frame(msg).encode())) is msg


@pytest.mark.parametrize("msg", [0, 7, 8, 199, 202, U32])
def test_classify_guest_unknown(msg: int) -> None:
    assert classify_guest(Frame(msg)) is None


# ---------------------------------------------------------------- liveness


def test_alive_mark_spells_aliv() -> None:
    assert struct.pack("<I", ALIVE_MARK) == b"ALIV"


@given(nonce=st.integers(1, U32))
def test_alive_round_trip(nonce: int) -> None:
    query = Frame.decode(query_alive(nonce).encode())
    assert classify_host(query) is HostMsg.QUERY_ALIVE
    assert query.dw1 == nonce
    reply = Frame.decode(alive_reply(query.dw1).encode())
    assert reply.msg == 6 and reply.dw1 == nonce and reply.dw2 == ALIVE_MARK
    assert is_alive_reply(reply)
    assert is_alive_reply(reply, nonce)
    assert not is_alive_reply(reply, nonce ^ 1)
    # The reply shares id 6 with REQ_GPU_INIT_DATA but must never be taken for it.
    assert classify_guest(reply) is None


@given(dw1=words, dw3=words)
def test_plain_init_data_is_not_an_alive_reply(dw1: int, dw3: int) -> None:
    frame = Frame.decode(Frame(GuestMsg.REQ_GPU_INIT_DATA, dw1, 0, dw3).encode())
    assert not is_alive_reply(frame)
    assert classify_guest(frame) is GuestMsg.REQ_GPU_INIT_DATA


@pytest.mark.parametrize("msg", [m for m in GuestMsg if m != GuestMsg.REQ_GPU_INIT_DATA])
def test_only_id_6_can_be_an_alive_reply(msg: GuestMsg) -> None:
    frame = Frame(msg, 5, ALIVE_MARK)
    assert not is_alive_reply(frame)
    assert classify_guest(frame) is msg


@pytest.mark.parametrize("nonce", [0, -1, U32 + 1])
def test_alive_nonce_must_be_a_nonzero_u32(nonce: int) -> None:
    with pytest.raises(ProtocolError, match="nonce"):
        query_alive(nonce)
    with pytest.raises(ProtocolError, match="nonce"):
        alive_reply(nonce)


# ---------------------------------------------------------------- FAIL, READY_TO_ACCESS_GPU


def test_fail_reason_values() -> None:
    assert {r.name: r.value for r in FailReason} == {
        "BAD_TOKEN": 0x1001,
        "BAD_VF": 0x1002,
        "BAD_UID": 0x1003,
        "VF_BUSY": 0x1004,
        "VF_DISABLED": 0x1005,
        "QUARANTINED": 0x1006,
        "BAD_STATE": 0x1007,
        "BAD_ATTACH": 0x1008,
        "TOO_MANY": 0x1009,
        "TOO_MANY_UID": 0x100A,
    }


def test_fail_for_a_reason() -> None:
    assert fail(FailReason.BAD_TOKEN).encode() == struct.pack("<4I", 5, 0x1001, 0, 0)


def test_fail_for_an_unknown_id() -> None:
    # An id equal to a reason code is still told apart by DW2.
    assert fail(0x1001, unknown=True).encode() == struct.pack("<4I", 5, 0x1001, 1, 0)
    assert fail(999, unknown=True) == Frame(HostMsg.FAIL, 999, 1, 0)


def test_fail_refuses_out_of_range_ids() -> None:
    with pytest.raises(ProtocolError):
        fail(2**32, unknown=True).encode()


def test_ready_to_access_words() -> None:
    frame = ready_to_access(fb_mib=512, key=0xCAFEBABE, nfds=2)
    assert frame.encode() == struct.pack("<4I", 1, 512, 0xCAFEBABE, 2)


# ---------------------------------------------------------------- the package itself


def test_protocol_error_is_a_value_error_and_not_a_gpuvirt_error() -> None:
    import gpuvirt.errors

    assert issubclass(ProtocolError, ValueError)
    assert not issubclass(ProtocolError, gpuvirt.errors.GpuvirtError)
    err = ProtocolError.bad("ATTACH vf", 40, "must be below 31")
    assert str(err) == "ATTACH vf = 40: must be below 31"
    assert (err.field, err.value) == ("ATTACH vf", 40)


# The protocol layer is pure: no I/O, no threads, nothing from the rest of gpuvirt.
FORBIDDEN_MODULES = {"socket", "os", "asyncio", "threading", "select", "selectors", "mmap"}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(level, module) of every import in *path*; level > 0 for relative imports."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


@pytest.mark.parametrize(
    "path",
    sorted(pathlib.Path(gpuvirt.protocol.__file__).parent.glob("*.py")),
    ids=lambda p: p.name,
)
def test_protocol_imports_nothing_else_from_gpuvirt(path: pathlib.Path) -> None:
    for level, module in _imports(path):
        if level > 1:
            pytest.fail(f"{path.name}: relative import leaves the package: {'.' * level}{module}")
        if level == 0 and module.split(".")[0] == "gpuvirt":
            assert module == "gpuvirt.protocol" or module.startswith("gpuvirt.protocol."), (
                f"{path.name} imports {module}"
            )
        if level == 0:
            assert module.split(".")[0] not in FORBIDDEN_MODULES, f"{path.name} imports {module}"
