"""The host's side of tenant confinement: `[engine]` handed to the device layer's
sandbox (device/sandbox/), and the mailbox socket made reachable by tenant uids
no wider than `host.socket_group` / `host.socket_mode` say (docs/security.md)."""

from __future__ import annotations

import grp
import os
from pathlib import Path

from gpuvirt.config import HostConfig, HostSection
from gpuvirt.device.sandbox import Mode, Settings
from gpuvirt.errors import ConfigError


def sandbox_settings(config: HostConfig) -> Settings:
    e = config.engine
    return Settings(
        Mode(e.sandbox), e.uid_base, e.memory, e.memory_allowance, e.tasks, e.nofile,
        e.scratch, config.device.backend,
    )  # fmt: skip


def secure_socket(path: Path, host: HostSection) -> None:
    if host.socket_group is not None:
        os.chown(path, -1, socket_gid(host.socket_group))
    os.chmod(path, host.socket_mode)


def socket_gid(group: str | int) -> int:
    """host.socket_group as a gid: a group name or a number."""
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"host.socket_group = {group!r}: no such group") from None
