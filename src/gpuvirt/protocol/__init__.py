"""gpuvirt's wire formats as pure code: bytes in, dataclasses out, no I/O.

- ``mailbox``: the ATTACH frame and the 16-byte PF/VF mailbox frames.
- ``info``: the PF2VF / VF2PF shared info blocks and their checksum.
- ``frames``: the NetGPU framed-mode header.

Every decoder raises :class:`ProtocolError` for input it refuses, and nothing
else. This package imports nothing else from gpuvirt, so both the host and
the guest (and tests) can use it without pulling in either side. Layouts are
documented byte by byte in docs/protocol.md.
"""

from . import errors, frames, info, mailbox
from .errors import ProtocolError

__all__ = ["ProtocolError", "errors", "frames", "info", "mailbox"]
