"""The one error type of the wire-format layer.

Every decoder in ``gpuvirt.protocol`` raises :class:`ProtocolError` for input
it refuses, and nothing else: a host that reads guest bytes needs exactly one
``except`` clause to stay up, whatever a guest sends. Low-level failures
(``struct.error``, ``UnicodeDecodeError``, a non-buffer argument) are turned
into it here, at the edge, so they never leak.

It subclasses ``ValueError`` (malformed input is a bad value) and deliberately
not ``gpuvirt.GpuvirtError``: this package imports nothing else from gpuvirt,
and the layers above decide what a refused frame means to a user.
"""

from __future__ import annotations

# as_view and check_uint are this package's own input guards, not public API.
__all__ = ["ProtocolError"]


class ProtocolError(ValueError):
    """Malformed or refused wire data; the message names the field, the value and the reason.

    ``field`` and ``value`` are kept as attributes when the raiser knows them
    (``None`` otherwise), for logs and tests that want more than the text.
    """

    def __init__(self, message: str, *, field: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value

    @classmethod
    def bad(
        cls, field: str, value: object, reason: str, *, shown: str | None = None
    ) -> ProtocolError:
        """Build the standard message ``<field> = <value>: <reason>``.

        The value is shown with ``repr`` (guest-chosen text must not smuggle
        control characters into logs) unless *shown* gives a better spelling,
        such as hex for checksums.
        """
        text = repr(value) if shown is None else shown
        return cls(f"{field} = {text}: {reason}", field=field, value=value)


def as_view(data: object, field: str) -> memoryview:
    """Return *data* as a flat memoryview of bytes, or raise ProtocolError.

    Accepts bytes, bytearray, memoryview and any other contiguous buffer. An
    ``int`` is refused even though ``bytes(n)`` would accept it: a length is
    not data, and ``bytes(2**40)`` would try to allocate a terabyte.
    """
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise ProtocolError.bad(
            field,
            data,
            "expected bytes, bytearray or memoryview",
            shown=f"<{type(data).__name__}>",
        ) from None
    if view.format == "B" and view.ndim == 1 and view.contiguous:
        return view
    try:
        return view.cast("B")
    except (TypeError, ValueError):
        raise ProtocolError.bad(
            field,
            data,
            "not a contiguous buffer",
            shown=f"<memoryview format={view.format!r} ndim={view.ndim}>",
        ) from None


def check_uint(field: str, value: object, bits: int) -> int:
    """Return *value* if it is an int in 0..2**bits-1, else raise ProtocolError.

    ``bool`` is refused: ``True`` as a length or a message id is always a bug.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError.bad(field, value, f"expected an int, got {type(value).__name__}")
    if not 0 <= value < (1 << bits):
        raise ProtocolError.bad(field, value, f"out of range for u{bits} (0..{(1 << bits) - 1})")
    return value
