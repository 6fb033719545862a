"""CDI specs: what the container runtime adds to a container that uses a claim.

One spec file per claim in the CDI directory (kind ``gpuvirt.io/vf``), one CDI
device per prepared VF: the mailbox socket and that VF's token file bind-mounted
(the token read-only), and the ``GPUVIRT_*`` variables `gpuvirt.attach()` reads.
Never a mount through which another VF's token can be read: the socket's
directory is mounted only where it holds nothing but the socket (so the mount
survives a host restart, which makes a new socket file), else the socket file
itself, since an admin may keep tokens beside it.
Files are written atomically (temp file, fsync, rename), as the runtime may
read the directory at any moment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuvirt.k8s.dra.params import DRIVER

CDI_VERSION = "0.6.0"
KIND = f"{DRIVER}/vf"
# Where a container finds them; fixed so that images need no configuration.
CONTAINER_SOCKET = "/run/gpuvirt/host.sock"
CONTAINER_SOCKET_DIR = "/run/gpuvirt/mailbox"
CONTAINER_TOKEN = "/run/gpuvirt/token"
_NAME_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


@dataclass(frozen=True, slots=True)
class VfMount:
    """What one prepared VF needs inside the container."""

    vf: int
    socket: Path  # the host's mailbox socket, on the node
    token_file: Path  # this VF's token, on the node


def device_name(claim_uid: str, vf: int) -> str:
    name = f"{claim_uid}-vf{vf}"
    if not _NAME_OK.fullmatch(name):
        raise ValueError(f"claim uid {claim_uid!r} does not make a CDI device name")
    return name


def device_id(claim_uid: str, vf: int) -> str:
    return f"{KIND}={device_name(claim_uid, vf)}"


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{DRIVER}-vf_{claim_uid}.json"


def build_spec(claim_uid: str, vfs: list[VfMount]) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [
            {"name": device_name(claim_uid, m.vf), "containerEdits": _edits(m)} for m in vfs
        ],
    }


def _socket_mount(socket: Path) -> tuple[str, dict[str, Any]]:
    """The container's socket path, and the mount that puts it there."""
    options = ["rbind", "rw", "nosuid", "nodev", "noexec"]
    try:
        alone = os.listdir(socket.parent) == [socket.name]
    except OSError:
        alone = False
    if alone:
        mount = {"hostPath": str(socket.parent), "containerPath": CONTAINER_SOCKET_DIR}
        return f"{CONTAINER_SOCKET_DIR}/{socket.name}", {**mount, "options": options}
    mount = {"hostPath": str(socket), "containerPath": CONTAINER_SOCKET}
    return CONTAINER_SOCKET, {**mount, "options": options}


def _edits(m: VfMount) -> dict[str, Any]:
    socket, socket_mount = _socket_mount(m.socket)
    return {
        "env": [
            f"GPUVIRT_SOCKET={socket}",
            f"GPUVIRT_VF={m.vf}",
            f"GPUVIRT_TOKEN_FILE={CONTAINER_TOKEN}",
        ],
        "mounts": [
            socket_mount,
            {
                "hostPath": str(m.token_file),
                "containerPath": CONTAINER_TOKEN,
                "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
            },
        ],
    }


def write_spec(cdi_dir: Path, claim_uid: str, vfs: list[VfMount]) -> Path:
    path = spec_path(cdi_dir, claim_uid)
    write_atomic(path, json.dumps(build_spec(claim_uid, vfs), indent=2).encode())
    return path


def remove_spec(cdi_dir: Path, claim_uid: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        spec_path(cdi_dir, claim_uid).unlink()


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """`path` holds either its old contents or `data`, whatever happens meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
