"""CDI specs: what the container runtime adds to a container that uses a claim.

One spec file per claim in the CDI directory (kind ``gpuvirt.io/vf``), one CDI
device per prepared VF, whose container edits are exactly what the device
plugin's Allocate hands a container for that VF (gpuvirt.k8s.devices.allocate):
the ``GPUVIRT_*`` variables `gpuvirt.attach()` reads, the mailbox socket (its
directory where that holds nothing else) and that VF's token file, read-only;
never a mount through which another VF's token can be read. Files are written
atomically (temp file, fsync, rename), as the runtime may read the directory
at any moment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from gpuvirt.k8s.devices import Allocation
from gpuvirt.k8s.dra.params import DRIVER

CDI_VERSION = "0.6.0"
KIND = f"{DRIVER}/vf"
_NAME_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


def device_name(claim_uid: str, vf: int) -> str:
    name = f"{claim_uid}-vf{vf}"
    if not _NAME_OK.fullmatch(name):
        raise ValueError(f"claim uid {claim_uid!r} does not make a CDI device name")
    return name


def device_id(claim_uid: str, vf: int) -> str:
    return f"{KIND}={device_name(claim_uid, vf)}"


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{DRIVER}-vf_{claim_uid}.json"


def build_spec(claim_uid: str, vfs: dict[int, Allocation]) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [
            {"name": device_name(claim_uid, vf), "containerEdits": _edits(a)}
            for vf, a in sorted(vfs.items())
        ],
    }


def _edits(a: Allocation) -> dict[str, Any]:
    return {
        "env": [f"{k}={v}" for k, v in a.envs.items()],
        "mounts": [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["rbind", "ro" if m.read_only else "rw", "nosuid", "nodev", "noexec"],
            }
            for m in a.mounts
        ],
    }


def write_spec(cdi_dir: Path, claim_uid: str, vfs: dict[int, Allocation]) -> Path:
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
