"""VF tokens: 256-bit secrets, parsed and stored without ever showing them.

Light on purpose (no pydantic, no host config): the guest library parses its
token with it.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

from gpuvirt.errors import ConfigError
from gpuvirt.protocol.mailbox import TOKEN_SIZE as TOKEN_BYTES  # the ATTACH frame's field

_DIR_MODE = 0o700

_HEX64 = re.compile(r"[0-9a-fA-F]{64}", re.ASCII)
_TOKEN_FILE_MAX = 2 * TOKEN_BYTES + 2  # hex, and "\r\n" at most


def parse_token(value: str | bytes) -> bytes:
    """The 32-byte VF token from 64 hex characters (str or ASCII bytes) or 32 raw bytes.

    Errors say what was wrong by length and kind only, never the secret.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if len(raw) == TOKEN_BYTES:
            return raw
        text = raw.strip().decode("ascii", errors="replace")
        if _HEX64.fullmatch(text):
            return bytes.fromhex(text)
        raise ConfigError(
            f"a token must be 32 raw bytes or 64 hex characters; got {len(raw)} bytes"
        )
    if isinstance(value, str):
        text = value.strip()
        if _HEX64.fullmatch(text):
            return bytes.fromhex(text)
        if len(text) == 2 * TOKEN_BYTES:
            raise ConfigError(
                "a token must be 64 hex characters (0-9, a-f); got 64 characters "
                "that are not all hex digits"
            )
        raise ConfigError(f"a token must be 64 hex characters; got {len(text)} characters")
    raise ConfigError(f"a token must be a str or bytes, got {type(value).__name__}")


def load_or_create_token(path: Path) -> bytes:
    """The VF token stored in ``path``, creating a fresh random one if the file is missing.

    The file holds 64 hex characters and a newline, mode 0600; its directory
    is made mode 0700 when missing. A file that others may read or write, or
    that is not exactly one token, is refused (ConfigError), not repaired:
    a token others could read is already spent.
    """
    path = Path(path)
    token = read_token(path)
    if token is None:
        token = _create_token(path)
    return token


def read_token(path: Path) -> bytes | None:
    """The token in ``path``, or None if there is no such file (never creates one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ConfigError(f"token file {path} is a directory") from None
    except PermissionError:
        raise ConfigError(f"token file {path} cannot be read: permission denied") from None
    except OSError as e:
        raise ConfigError(f"token file {path} cannot be read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"token file {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o066:
            raise ConfigError(
                f"token file {path} has mode {mode:04o}: group or others may read or write "
                f"it; the token may be known to others. Remove the file to get a new token, "
                f"or chmod 600 it if you are sure it is still secret"
            )
        if st.st_size > _TOKEN_FILE_MAX:
            raise ConfigError(
                f"token file {path} must hold exactly 64 hex characters (and an optional "
                f"newline); it holds {st.st_size} bytes"
            )
        try:
            data = os.read(fd, _TOKEN_FILE_MAX + 1)
        except OSError as e:
            raise ConfigError(f"token file {path} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    body = data.removesuffix(b"\n").removesuffix(b"\r")
    if not _HEX64.fullmatch(body.decode("ascii", errors="replace")):
        raise ConfigError(
            f"token file {path} must hold exactly 64 hex characters (and an optional "
            f"newline); it holds {len(data)} bytes of something else"
        )
    return bytes.fromhex(body.decode("ascii"))


def _create_token(path: Path) -> bytes:
    try:
        path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create the directory for token file {path}: {e.strerror or e}"
        ) from None
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        # O_EXCL: never write a secret into a file (or through a link) that
        # someone else prepared.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        # Another process won the race, or a dangling link is in the way.
        existing = read_token(path)
        if existing is None:
            raise ConfigError(
                f"token file {path} exists but cannot be opened (a dangling symbolic link?)"
            ) from None
        return existing
    except OSError as e:
        raise ConfigError(f"cannot create token file {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken the owner's bits away
        os.write(fd, token.hex().encode("ascii") + b"\n")
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        path.unlink(missing_ok=True)  # a half-written token would be refused next time
        raise ConfigError(f"cannot write token file {path}: {e.strerror or e}") from None
    os.close(fd)
    return token
