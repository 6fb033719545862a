"""The errors a NetGPU user can meet; all are GpuvirtErrors.

A stream's bad input never raises in the middle of another stream's data: it
becomes a StreamError recorded on its Rx, and the Rx raises RxError (listing
them all) only once every stream has ended.
"""

from __future__ import annotations

from gpuvirt.errors import GpuvirtError


class NetGPUError(GpuvirtError):
    """A NetGPU request that cannot be done as asked (pool sizes, modes, providers)."""


class TokenError(NetGPUError):
    """A token passed to `pool.release` that the pool does not have out."""

    def __init__(self, token: object, why: str) -> None:
        super().__init__(f"token {token!r}: {why}")
        self.token = token


class StreamError(NetGPUError):
    """One stream failed (bad header, truncation, oversize, disconnect); the others go on."""

    def __init__(self, stream: int | None, peer: str, reason: str) -> None:
        who = f"stream {stream}" if stream is not None else "a stream"
        super().__init__(f"{who} from {peer}: {reason}")
        self.stream = stream
        self.peer = peer
        self.reason = reason


class RxError(NetGPUError):
    """Raised when a receive ends and one or more of its streams failed."""

    def __init__(self, errors: list[StreamError]) -> None:
        lines = "\n".join(f"  - {e}" for e in errors)
        n = len(errors)
        super().__init__(
            f"{n} stream{'s' if n > 1 else ''} failed (the fragments already delivered are "
            f"intact):\n{lines}"
        )
        self.errors = errors
