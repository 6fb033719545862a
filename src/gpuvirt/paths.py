"""Where the host's sockets and state live, by fixed rules, for the host and its clients alike.

Paths that depend on the machine are resolved on request, so the daemon, the
CLI and a guest started by the same user find the same socket. Light on
purpose (no pydantic, no host config model): the guest library uses it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tomllib
from pathlib import Path

from gpuvirt.errors import ConfigError

CONFIG_ENV = "GPUVIRT_CONFIG"
DEFAULT_CONFIG_PATH = Path("/etc/gpuvirt/gpuvirt.toml")

SYSTEM_RUNTIME_DIR = Path("/run/gpuvirt")
SYSTEM_STATE_DIR = Path("/var/lib/gpuvirt")
# Literally /tmp, not tempfile.gettempdir(): a client with a different $TMPDIR
# than the daemon must still find the same socket.
TMP_ROOT = Path("/tmp")
SOCKET_NAME = "host.sock"
ADMIN_SOCKET_NAME = "admin.sock"

# Directory modes. The runtime dir under /run is traversable by everyone
# because the socket itself (mode 0660) decides who may connect; everything
# per-user, and the state dir holding tokens, is private.
_SYSTEM_RUNTIME_MODE = 0o755
_PRIVATE_MODE = 0o700


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _usable(path: Path, *, create: bool, parents: bool, mode: int) -> bool:
    """Whether we can put files in ``path``, making it (with ``mode``) if ``create``."""
    try:
        if path.is_dir():
            return os.access(path, os.W_OK | os.X_OK)
        if path.exists() or path.is_symlink():
            return False  # a file or a dangling link is in the way
        ancestor = path.parent
        if parents:
            while not ancestor.exists() and ancestor != ancestor.parent:
                ancestor = ancestor.parent
        if not _writable_dir(ancestor):
            return False
        if create:
            path.mkdir(mode=mode, parents=parents, exist_ok=True)
            os.chmod(path, mode)  # mkdir's mode is filtered through the umask
        return True
    except OSError:
        return False


def _private_tmp_dir(*, create: bool) -> Path:
    uid = os.getuid()
    path = TMP_ROOT / f"gpuvirt-{uid}"
    if create:
        try:
            path.mkdir(mode=_PRIVATE_MODE)
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(
                f"no usable runtime directory: cannot create {path}: {e.strerror or e}; "
                "set host.socket and host.admin"
            ) from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path  # create=False: it would be made on first use
    except OSError as e:
        raise ConfigError(f"runtime directory {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"runtime directory {path} is not a directory (a link or a file); remove it "
            "or set host.socket and host.admin"
        )
    if st.st_uid != uid:
        # Anyone can create names in /tmp; another user's directory here could
        # be a trap to intercept tokens sent over our socket.
        raise ConfigError(
            f"runtime directory {path} belongs to uid {st.st_uid}, not to you (uid {uid}); "
            "refusing to use it: remove it, or set host.socket and host.admin"
        )
    if create and stat.S_IMODE(st.st_mode) != _PRIVATE_MODE:
        os.chmod(path, _PRIVATE_MODE)
    return path


def default_runtime_dir(*, create: bool = True) -> Path:
    """Where the default sockets live; the same answer for the daemon and its clients.

    /run/gpuvirt if it is a writable directory or can be created; else
    $XDG_RUNTIME_DIR/gpuvirt (if $XDG_RUNTIME_DIR is set, absolute and
    exists); else /tmp/gpuvirt-<uid>, mode 0700, refused (ConfigError) if it
    belongs to another uid. ``create=False`` only decides, making nothing.
    """
    if _usable(SYSTEM_RUNTIME_DIR, create=create, parents=False, mode=_SYSTEM_RUNTIME_MODE):
        return SYSTEM_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    # The XDG spec says to ignore relative paths; and the runtime dir itself
    # is the session manager's to create, never ours.
    if xdg and os.path.isabs(xdg):
        candidate = Path(xdg) / "gpuvirt"
        if _usable(candidate, create=create, parents=False, mode=_PRIVATE_MODE):
            return candidate
    return _private_tmp_dir(create=create)


def default_state_dir(*, create: bool = True) -> Path:
    """Where the event log and token files live by default.

    /var/lib/gpuvirt if writable or creatable; else $XDG_STATE_HOME/gpuvirt
    (if set and absolute); else ~/.local/state/gpuvirt. Made mode 0700.
    """
    candidates = [(SYSTEM_STATE_DIR, False)]
    xdg = os.environ.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        candidates.append((Path(xdg) / "gpuvirt", True))
    with contextlib.suppress(RuntimeError, KeyError):  # no home directory known
        candidates.append((Path.home() / ".local" / "state" / "gpuvirt", True))
    for path, parents in candidates:
        if _usable(path, create=create, parents=parents, mode=_PRIVATE_MODE):
            return path
    tried = ", ".join(str(p) for p, _ in candidates)
    raise ConfigError(f"no usable state directory (tried {tried}); set host.state_dir")


def mailbox_socket() -> Path:
    """The mailbox socket as a client finds it without the host's config model.

    ``[host] socket`` of the configuration file ($GPUVIRT_CONFIG, else
    /etc/gpuvirt/gpuvirt.toml when present) if it sets one, else the default
    in `default_runtime_dir`. The host validates that file; this only reads
    the one key, so a guest need not load pydantic to find its host.
    """
    env = os.environ.get(CONFIG_ENV)
    path = Path(env) if env else DEFAULT_CONFIG_PATH
    if env or path.exists():
        try:
            host = tomllib.loads(path.read_text("utf-8")).get("host", {})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {path}: cannot read [host] socket: {e}") from None
        socket = host.get("socket") if isinstance(host, dict) else None
        if isinstance(socket, str) and os.path.isabs(socket):
            return Path(socket)
        if socket is not None:
            raise ConfigError(f"config file {path}: host.socket = {socket!r}: not an absolute path")
    return default_runtime_dir(create=False) / SOCKET_NAME


def socket_served(path: Path) -> bool:
    """Whether something listens on the Unix socket at ``path`` now (a stale socket file
    of a process that is gone refuses the connection)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True
