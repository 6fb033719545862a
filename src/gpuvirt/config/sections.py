"""The configuration's sections as pydantic models, and the field types they use.

Every field type checks its own value and says why it is wrong in words a
TOML author understands; cross-field checks live in model.py.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from gpuvirt.config.sizes import format_size, parse_size, parse_window
from gpuvirt.defaults import (
    DEFAULT_ATTACH_TIMEOUT_MS,
    DEFAULT_CMD_TIMEOUT_MS,
    DEFAULT_COOP_IDLE_TIMEOUT_MS,
    DEFAULT_ENGINE_NOFILE,
    DEFAULT_ENGINE_SCRATCH,
    DEFAULT_ENGINE_TASKS,
    DEFAULT_EVENT_LOG_FILES,
    DEFAULT_EVENT_LOG_MAX,
    DEFAULT_FULLACCESS_TIMEOUT_MS,
    DEFAULT_GUARD_FLR,
    DEFAULT_JOB_TIMEOUT_S,
    DEFAULT_KERNEL_SCRATCH,
    DEFAULT_MAX_FRAMES_PER_S,
    DEFAULT_MAX_PENDING_ATTACH,
    DEFAULT_MEMORY_ALLOWANCE,
    DEFAULT_PF_FB,
    DEFAULT_POLICY,
    DEFAULT_POLL_US,
    DEFAULT_READY_TO_RESET_WAIT_MS,
    DEFAULT_SANDBOX,
    DEFAULT_SOCKET_MODE,
    DEFAULT_TIME_SLICE_MS,
    DEFAULT_UID_BASE,
    DEFAULT_VF_NUM,
    DEFAULT_VF_WEIGHT,
    MAX_TIME_SLICE_MS,
    MIN_VF_FB,
)  # fmt: skip
from gpuvirt.paths import (
    ADMIN_SOCKET_NAME,
    SOCKET_NAME,
    default_runtime_dir,
    default_state_dir,
)  # fmt: skip
from gpuvirt.protocol.mailbox import MAX_VFS

Policy = Literal["fairness", "round_robin", "liquid", "weighted"]
SandboxMode = Literal["required", "best-effort", "off"]
Backend = Literal["emu", "cuda"]


def _size_type(minimum: int, why: str = "") -> Any:
    """An int field that takes a size string or a byte count, at least ``minimum``."""

    def check(value: int) -> int:
        if value < minimum:
            if minimum == 1:
                raise ValueError("must be greater than zero")
            raise ValueError(f"must be at least {format_size(minimum)}{why}")
        return value

    return Annotated[
        int,
        BeforeValidator(lambda value: parse_size(value, allow_zero=True)),
        AfterValidator(check),
    ]


def _in_range(
    low: int | float, high: int | float | None = None, *, above: bool = False
) -> AfterValidator:
    """Bounds with messages that name the whole range, unlike pydantic's ge/le."""

    def check(value: int | float) -> int | float:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number")
        if above and not value > low:
            raise ValueError(f"must be greater than {low}")
        if not above and value < low:
            raise ValueError(
                f"must be at least {low}" if high is None else f"must be between {low} and {high}"
            )
        if high is not None and value > high:
            raise ValueError(f"must be between {low} and {high}")
        return value

    return AfterValidator(check)


def _absolute(text: str) -> Path:
    if not text.strip():
        raise ValueError("must not be empty")
    if "\0" in text:
        raise ValueError("must not contain a NUL character")
    path = Path(text).expanduser()
    if not path.is_absolute():
        # The daemon's working directory is not the client's.
        raise ValueError("must be an absolute path")
    return path


def _abs_path(value: object) -> object:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        return value  # the strict Path check reports the wrong type
    return _absolute(value)


def _admin_text(value: object) -> object:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        parse_admin(value)
    return value


def parse_admin(text: str) -> Path | tuple[str, int]:
    if not text.strip():
        raise ValueError("must not be empty")
    if "/" in text or text.startswith("~"):
        return _absolute(text)
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError('expected an absolute socket path or HOST:PORT such as "127.0.0.1:9464"')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError('write an IPv6 address in brackets, e.g. "[::1]:9464"')
    if not host or any(c.isspace() for c in host):
        raise ValueError("HOST:PORT needs a host name or address before the colon")
    if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError("the port must be a number from 1 to 65535")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """Only an address the kernel keeps on this machine; a name other than localhost is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _window_text(value: str) -> str:
    parse_window(value)
    return value


def _uid_list(value: list[int] | None) -> list[int] | None:
    if value is None:
        return None
    if not value:
        raise ValueError("must not be empty: leave allowed_uids out to allow any uid")
    for uid in value:
        if not 0 <= uid < 1 << 32:
            raise ValueError(f"uid {uid} is out of range (0..4294967295)")
    return value


AbsPath = Annotated[Path, BeforeValidator(_abs_path)]
NonZeroSize = _size_type(1)
Size = _size_type(0)
VFSize = _size_type(MIN_VF_FB, " (the first 128 KiB of every FB hold the info blocks)")

MODEL = ConfigDict(extra="forbid", frozen=True, strict=True)


class HostSection(BaseModel):
    """``[host]``: where the daemon listens and keeps its state.

    Unset paths (None) mean "the default", resolved by the methods below.
    """

    model_config = MODEL

    socket: AbsPath | None = None
    admin: Annotated[str, BeforeValidator(_admin_text)] | None = None
    # Bearer token for a TCP admin address (created if missing); required off loopback.
    admin_token_file: AbsPath | None = None
    state_dir: AbsPath | None = None
    attach_timeout_ms: Annotated[int, _in_range(1, 60_000)] = DEFAULT_ATTACH_TIMEOUT_MS
    max_pending_attach: Annotated[int, _in_range(1, 65_536)] = DEFAULT_MAX_PENDING_ATTACH
    max_frames_per_s: Annotated[int, _in_range(1, 10_000_000)] = DEFAULT_MAX_FRAMES_PER_S
    event_log_max: NonZeroSize = DEFAULT_EVENT_LOG_MAX
    event_log_files: Annotated[int, _in_range(1, 100)] = DEFAULT_EVENT_LOG_FILES
    # Group (name or gid) that owns the mailbox socket, so tenants who are ordinary
    # users can attach to a root host; socket_mode is its mode (no bits for others
    # unless set here).
    socket_group: str | int | None = None
    socket_mode: Annotated[int, _in_range(0, 0o777)] = DEFAULT_SOCKET_MODE

    def socket_path(self, *, create: bool = True) -> Path:
        """The mailbox socket: ``socket``, else ``default_runtime_dir()/host.sock``."""
        if self.socket is not None:
            return self.socket
        return default_runtime_dir(create=create) / SOCKET_NAME

    def admin_address(self, *, create: bool = True) -> Path | tuple[str, int]:
        """The admin endpoint: a Unix socket path, or ``(host, port)`` for TCP."""
        if self.admin is not None:
            return parse_admin(self.admin)
        return default_runtime_dir(create=create) / ADMIN_SOCKET_NAME

    def state_path(self, *, create: bool = True) -> Path:
        """The state directory (event log, tokens): ``state_dir`` or the default."""
        if self.state_dir is not None:
            return self.state_dir
        return default_state_dir(create=create)


class DeviceSection(BaseModel):
    """``[device]``: which backend and how much device memory to carve."""

    model_config = MODEL

    backend: Backend = "emu"
    # None: 2 GiB on emu; on cuda the device's free memory (see HostConfig.effective_fb_total).
    fb_total: NonZeroSize | None = None
    pf_fb: Size = DEFAULT_PF_FB
    # cuda: each engine's cap on its kernels' temporaries, outside its FB (budgeted).
    kernel_scratch: Size = DEFAULT_KERNEL_SCRATCH


class SriovSection(BaseModel):
    """``[sriov]``: how many VFs."""

    model_config = MODEL

    vf_num: Annotated[int, _in_range(1, MAX_VFS)] = DEFAULT_VF_NUM


class SchedulerSection(BaseModel):
    """``[scheduler]``: world-switch policy and the timeouts that mean "hang"."""

    model_config = MODEL

    policy: Policy = DEFAULT_POLICY
    time_slice_ms: Annotated[int, _in_range(1, MAX_TIME_SLICE_MS)] = DEFAULT_TIME_SLICE_MS
    cmd_timeout_ms: Annotated[int, _in_range(1)] = DEFAULT_CMD_TIMEOUT_MS
    # Cooperative engines (cuda) acknowledge IDLE at a kernel boundary: this is how long
    # past its slice a kernel may run before it counts as a hang.
    coop_idle_timeout_ms: Annotated[int, _in_range(1)] = DEFAULT_COOP_IDLE_TIMEOUT_MS
    job_timeout_s: Annotated[float, _in_range(0, above=True)] = DEFAULT_JOB_TIMEOUT_S
    fullaccess_timeout_ms: Annotated[int, _in_range(1)] = DEFAULT_FULLACCESS_TIMEOUT_MS


class ResetSection(BaseModel):
    """``[reset]``: FLR handshake wait and the guard that quarantines a flapping VF."""

    model_config = MODEL

    ready_to_reset_wait_ms: Annotated[int, _in_range(0)] = DEFAULT_READY_TO_RESET_WAIT_MS
    guard_flr: Annotated[str, AfterValidator(_window_text)] = DEFAULT_GUARD_FLR

    @property
    def guard_count(self) -> int:
        """FLRs allowed within one window; one more quarantines the VF."""
        return parse_window(self.guard_flr)[0]

    @property
    def guard_window_s(self) -> float:
        """Length of the guard's sliding window in seconds."""
        return parse_window(self.guard_flr)[1]


class EngineSection(BaseModel):
    """``[engine]``: how every engine (a tenant's kernels) is confined; docs/security.md."""

    model_config = MODEL

    # required: refuse to start unless every protection can be applied; best-effort:
    # start with what there is and say what is missing; off: development only.
    sandbox: SandboxMode = DEFAULT_SANDBOX
    uid_base: Annotated[int, _in_range(1, 2**31 - 64)] = DEFAULT_UID_BASE
    memory: NonZeroSize | None = None  # None: the VF's FB plus memory_allowance
    memory_allowance: Size = DEFAULT_MEMORY_ALLOWANCE
    tasks: Annotated[int, _in_range(4, 65536)] = DEFAULT_ENGINE_TASKS
    nofile: Annotated[int, _in_range(32, 1 << 20)] = DEFAULT_ENGINE_NOFILE
    scratch: NonZeroSize = DEFAULT_ENGINE_SCRATCH
    # µs an engine polls its guest channel before it sleeps, while it has the device to
    # itself (gpuvirt/poll.py); 0: never poll.
    poll_us: Annotated[int, _in_range(0, 1_000_000)] = DEFAULT_POLL_US


class VFSection(BaseModel):
    """One ``[[vf]]`` table: settings for the VF with this ``index``."""

    model_config = MODEL

    index: Annotated[int, _in_range(0)]
    fb: VFSize | None = None
    weight: Annotated[float, _in_range(0, above=True)] = DEFAULT_VF_WEIGHT
    token_file: AbsPath | None = None
    allowed_uids: Annotated[list[int] | None, AfterValidator(_uid_list)] = None


class VFSettings(BaseModel):
    """A change to one running VF (``gpuvirt vf set``, the admin API, a DRA claim's
    parameters): the same keys and rules as ``[[vf]]``; None leaves a value as it is."""

    model_config = MODEL

    fb: VFSize | None = None
    weight: Annotated[float, _in_range(0, above=True)] | None = None


@dataclass(frozen=True, slots=True)
class VFPlan:
    """One VF as the host will set it up: every value resolved."""

    index: int
    fb: int  # bytes, including the reserved 128 KiB head
    weight: float
    token_file: Path
    allowed_uids: tuple[int, ...] | None  # None: any uid holding the token
