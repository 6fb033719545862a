"""What the device plugin tells the kubelet, worked out from the host's status.

No gRPC and no network here: the host's `/status` JSON in, devices, health,
preferred allocations and Allocate's envs and mounts out. The only I/O is the
look at the mailbox socket's directory and the token files that Allocate needs
to decide what it may mount.

A container gets exactly this (DESIGN.md, "Kubernetes"):
- ``GPUVIRT_SOCKET``, ``GPUVIRT_VF``, ``GPUVIRT_TOKEN_FILE`` (and ``GPUVIRT_VFS``,
  every VF it holds, for a container given more than one);
- each of its VFs' token files, read-only, at ``/run/gpuvirt/tokens/vfN.token``;
- the mailbox socket: its directory (read-only, at ``/run/gpuvirt/mailbox``)
  where that holds nothing but the socket, so a host restart (a new socket
  inode) reaches running pods; else the socket file alone.
Never a directory through which another VF's token could be read.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gpuvirt.errors import GpuvirtError

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# A VF in one of these can take (or is serving) a guest; the rest (UNAVAIL = disabled,
# RESETTING, QUARANTINED, FAILED) cannot, and the kubelet must not hand it out.
SERVING = frozenset({"AVAIL", "FULLACCESS", "ACTIVE", "SUSPEND"})
WITH_GUEST = frozenset({"FULLACCESS", "ACTIVE", "SUSPEND"})

CONTAINER_ROOT = PurePosixPath("/run/gpuvirt")
CONTAINER_MAILBOX = CONTAINER_ROOT / "mailbox"
CONTAINER_TOKENS = CONTAINER_ROOT / "tokens"

_ID = re.compile(r"vf([0-9]{1,2})", re.ASCII)


class AllocateError(GpuvirtError):
    """Allocate cannot hand out what was asked; the message says which device and why."""


def device_id(index: int) -> str:
    return f"vf{index}"


def vf_index(device: str) -> int:
    m = _ID.fullmatch(device)
    if m is None:
        raise AllocateError(f"device {device!r}: not one of this plugin's (vf0, vf1, ...)")
    return int(m.group(1))


@dataclass(frozen=True)
class VFView:
    index: int
    state: str
    fb: int
    has_guest: bool
    token_file: str

    @property
    def healthy(self) -> bool:
        return self.state in SERVING


@dataclass(frozen=True)
class HostView:
    """The host as the plugin last saw it; `reachable` False while it is gone."""

    reachable: bool
    socket: str | None
    vfs: tuple[VFView, ...]
    pid: int | None = None

    def health(self) -> dict[str, str]:
        """Every device and its health; all Unhealthy while the host is unreachable."""
        return {
            device_id(v.index): HEALTHY if self.reachable and v.healthy else UNHEALTHY
            for v in self.vfs
        }

    def gone(self) -> HostView:
        """The same devices, unreachable (kept listed so that the kubelet keeps them)."""
        return HostView(False, self.socket, self.vfs, self.pid)

    def with_state(self, index: int, state: str) -> HostView:
        """The view after one state transition the host logged."""
        vfs = tuple(
            dataclasses.replace(v, state=state) if v.index == index else v for v in self.vfs
        )
        return dataclasses.replace(self, vfs=vfs)

    def vf(self, device: str) -> VFView:
        index = vf_index(device)
        for v in self.vfs:
            if v.index == index:
                return v
        raise AllocateError(f"device {device!r}: the host has no VF {index}")


def initial_view(vf_num: int) -> HostView:
    """Before the host has answered: the configured VFs, all Unhealthy."""
    return HostView(False, None, tuple(VFView(i, "UNKNOWN", 0, False, "") for i in range(vf_num)))


def host_view(status: dict[str, Any]) -> HostView:
    """The parts of `/status` the plugin uses. A host that sends something else is a bug
    there, reported with what was missing."""
    try:
        vfs = tuple(
            VFView(
                index=int(v["index"]),
                state=str(v["state"]),
                fb=int(v["fb_total"]),
                has_guest=v.get("guest_pid") is not None or str(v["state"]) in WITH_GUEST,
                token_file=str(v["token_file"]),
            )
            for v in status["vfs"]
        )
        return HostView(True, str(status["socket"]), vfs, int(status["pid"]))
    except (KeyError, TypeError, ValueError) as e:
        raise GpuvirtError(
            f"the host's /status lacks what the device plugin needs: {e!r}"
        ) from None


def preferred(view: HostView, available: list[str], must: list[str], size: int) -> list[str]:
    """`size` devices: every one of `must`, then VFs with no guest before those with one,
    then the largest FB first (then the lowest index)."""
    chosen = list(dict.fromkeys(must))[:size]
    known = {device_id(v.index): v for v in view.vfs}

    def rank(device: str) -> tuple[int, int, int]:
        v = known.get(device)
        if v is None:
            return (2, 0, 0)
        return (1 if v.has_guest else 0, -v.fb, v.index)

    rest = sorted((d for d in dict.fromkeys(available) if d not in chosen), key=rank)
    return chosen + rest[: max(0, size - len(chosen))]


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class Allocation:
    envs: dict[str, str]
    mounts: tuple[MountSpec, ...]


def allocate(view: HostView, devices: list[str]) -> Allocation:
    """Envs and mounts for one container holding `devices`."""
    if not devices:
        raise AllocateError("no devices asked for")
    if view.socket is None:
        raise AllocateError("the gpuvirt host has not been reachable yet; try again")
    vfs = sorted({view.vf(d).index: view.vf(d) for d in devices}.values(), key=lambda v: v.index)
    mounts = [_socket_mount(Path(view.socket))]
    for v in vfs:
        _check_token_file(v)
        mounts.append(MountSpec(str(CONTAINER_TOKENS / f"vf{v.index}.token"), v.token_file, True))
    first = vfs[0]
    envs = {
        "GPUVIRT_SOCKET": str(CONTAINER_MAILBOX / Path(view.socket).name),
        "GPUVIRT_VF": str(first.index),
        "GPUVIRT_TOKEN_FILE": str(CONTAINER_TOKENS / f"vf{first.index}.token"),
        "GPUVIRT_VFS": ",".join(str(v.index) for v in vfs),
    }
    return Allocation(envs, tuple(mounts))


def _socket_mount(socket: Path) -> MountSpec:
    """The socket's directory when it holds nothing else (a restarted host's new socket
    then reaches the pod), else the socket file alone. Read-only either way: connecting
    to a socket needs no write access to the mount."""
    try:
        others = [name for name in os.listdir(socket.parent) if name != socket.name]
    except OSError as e:
        raise AllocateError(
            f"mailbox socket directory {socket.parent}: {e.strerror or e}"
        ) from None
    if not others:
        return MountSpec(str(CONTAINER_MAILBOX), str(socket.parent), True)
    try:
        st = os.stat(socket)
    except OSError as e:
        raise AllocateError(
            f"mailbox socket {socket}: {e.strerror or e}; is the gpuvirt host running?"
        ) from None
    if not stat.S_ISSOCK(st.st_mode):
        raise AllocateError(f"mailbox socket {socket} is not a socket")
    return MountSpec(str(CONTAINER_MAILBOX / socket.name), str(socket), True)


def _check_token_file(v: VFView) -> None:
    # A runtime asked to bind a missing file makes a directory there instead.
    try:
        st = os.stat(v.token_file)
    except OSError as e:
        raise AllocateError(f"VF{v.index}: token file {v.token_file}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise AllocateError(f"VF{v.index}: token file {v.token_file} is not a regular file")
