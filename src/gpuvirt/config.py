"""Host configuration: TOML in, validated and frozen settings out.

Rules of this module:

- Every default gpuvirt has lives here and nowhere else. Other modules read
  a `HostConfig` (or the constants below); they never carry their own copy
  of a number.
- A bad configuration is refused as a whole with one `ConfigError` that
  lists every problem found, one per line, each as ``dotted.key = value:
  reason``. The host never starts half-configured, and a pydantic
  `ValidationError` never reaches a caller of `load_config`.
- Paths that depend on the machine (the runtime and state directories) are
  resolved on request, by fixed rules, so the daemon and the CLI clients
  started by the same user find the same socket.

It imports nothing of gpuvirt's except `gpuvirt.errors`: it sits at the top
of the layering in DESIGN.md.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import ipaddress
import math
import os
import re
import secrets
import stat
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from gpuvirt.errors import ConfigError

__all__ = [
    "ADMIN_SOCKET_NAME",
    "CONFIG_ENV",
    "DEFAULT_CMD_TIMEOUT_MS",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_EMU_FB_TOTAL",
    "DEFAULT_FULLACCESS_TIMEOUT_MS",
    "DEFAULT_GUARD_FLR",
    "DEFAULT_JOB_TIMEOUT_S",
    "DEFAULT_PF_FB",
    "DEFAULT_POLICY",
    "DEFAULT_READY_TO_RESET_WAIT_MS",
    "DEFAULT_TIME_SLICE_MS",
    "DEFAULT_VF_NUM",
    "DEFAULT_VF_WEIGHT",
    "FB_ALIGN",
    "FB_RESERVED",
    "MAX_SIZE",
    "MAX_TIME_SLICE_MS",
    "MAX_VF_NUM",
    "MIN_VF_FB",
    "SOCKET_NAME",
    "SYSTEM_RUNTIME_DIR",
    "SYSTEM_STATE_DIR",
    "TMP_ROOT",
    "TOKEN_BYTES",
    "DeviceSection",
    "GiB",
    "HostConfig",
    "HostSection",
    "KiB",
    "MiB",
    "ResetSection",
    "SchedulerSection",
    "SriovSection",
    "TiB",
    "VFPlan",
    "VFSection",
    "default_runtime_dir",
    "default_state_dir",
    "format_size",
    "is_loopback",
    "load_config",
    "load_or_create_token",
    "parse_config",
    "parse_size",
    "parse_token",
    "parse_window",
    "read_token",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# --- defaults (DESIGN.md, "Configuration") ---------------------------------
CONFIG_ENV = "GPUVIRT_CONFIG"
DEFAULT_CONFIG_PATH = Path("/etc/gpuvirt/gpuvirt.toml")

SYSTEM_RUNTIME_DIR = Path("/run/gpuvirt")
SYSTEM_STATE_DIR = Path("/var/lib/gpuvirt")
# Literally /tmp, not tempfile.gettempdir(): a client with a different $TMPDIR
# than the daemon must still find the same socket.
TMP_ROOT = Path("/tmp")
SOCKET_NAME = "host.sock"
ADMIN_SOCKET_NAME = "admin.sock"

DEFAULT_EMU_FB_TOTAL = 2 * GiB
DEFAULT_PF_FB = 256 * MiB
DEFAULT_VF_NUM = 4
MAX_VF_NUM = 31  # GIM's limit
DEFAULT_POLICY = "liquid"
DEFAULT_TIME_SLICE_MS = 6  # GIM's GFX default
MAX_TIME_SLICE_MS = 500
DEFAULT_CMD_TIMEOUT_MS = 500
DEFAULT_JOB_TIMEOUT_S = 10.0
DEFAULT_FULLACCESS_TIMEOUT_MS = 1500
DEFAULT_READY_TO_RESET_WAIT_MS = 10
DEFAULT_GUARD_FLR = "3/60s"
DEFAULT_VF_WEIGHT = 1.0
# Per-peer limits on the mailbox and the event log (DESIGN.md, "Untrusted inputs").
DEFAULT_ATTACH_TIMEOUT_MS = 5000  # a connection not attached by then is closed
DEFAULT_MAX_PENDING_ATTACH = 64  # connections not yet attached, all peers together
DEFAULT_MAX_FRAMES_PER_S = 1000  # per connection; an honest guest sends a handful
DEFAULT_EVENT_LOG_MAX = 16 * MiB  # events.jsonl is rotated past this
DEFAULT_EVENT_LOG_FILES = 4  # rotated files kept: events.jsonl.1 .. .N

FB_RESERVED = 128 * KiB  # head of every FB: PF2VF at 64 KiB, VF2PF at 65 KiB
MIN_VF_FB = 1 * MiB
FB_ALIGN = 64 * KiB  # VFs sized by the split start and end on this boundary
TOKEN_BYTES = 32

# Directory modes. The runtime dir under /run is traversable by everyone
# because the socket itself (mode 0660) decides who may connect; everything
# per-user, and the state dir holding tokens, is private.
_SYSTEM_RUNTIME_MODE = 0o755
_PRIVATE_MODE = 0o700

# A size string longer than this is garbage, and refusing it early keeps huge
# digit strings away from Fraction().
_MAX_SIZE_TEXT = 64
MAX_SIZE = (1 << 64) - 1

Policy = Literal["fairness", "round_robin", "liquid", "weighted"]
Backend = Literal["emu", "cuda"]


# --- sizes and windows --------------------------------------------------------

_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)[ \t]*([A-Za-z]*)", re.ASCII)
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "ki": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mi": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gi": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "ti": TiB,
    "tib": TiB,
    "tb": 1000**4,
}
_UNIT_HELP = (
    "use B, KiB, MiB, GiB, TiB (K, M, G, T mean the same) or KB, MB, GB, TB for powers of 1000"
)


def parse_size(value: int | str, *, allow_zero: bool = False) -> int:
    """Bytes in a size such as ``"2GiB"``, ``"1.5 GiB"``, ``"1GB"``, ``"4096"`` or ``4096``.

    KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; KB/MB/GB/TB are
    powers of 1000. Units are case-insensitive and may follow a space. The
    result must be a whole number of bytes. Raises ValueError with the reason.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(
            f'expected a size (a whole number of bytes or a string like "2GiB"), '
            f"got {_toml_type(value)}"
        )
    if isinstance(value, int):
        n = value
    else:
        text = value.strip()
        if len(text) > _MAX_SIZE_TEXT:
            raise ValueError("not a size: far too long")
        if text.startswith("-"):
            raise ValueError("a size cannot be negative")
        m = _SIZE_RE.fullmatch(text)
        if m is None:
            raise ValueError(
                "not a size: expected a number with an optional unit, "
                "e.g. 2GiB, 256MiB, 1.5GiB or 4096"
            )
        number, unit = m.groups()
        multiplier = _SIZE_UNITS.get(unit.lower())
        if multiplier is None:
            raise ValueError(f"unknown size unit {unit!r}: {_UNIT_HELP}")
        exact = Fraction(number) * multiplier
        if exact.denominator != 1:
            raise ValueError(f"{number} {unit or 'B'} is not a whole number of bytes")
        n = int(exact)
    if n < 0:
        raise ValueError("a size cannot be negative")
    if n == 0 and not allow_zero:
        raise ValueError("a size must be greater than zero")
    if n > MAX_SIZE:
        raise ValueError("a size must be below 16 EiB")
    return n


_FORMAT_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_size(n: int) -> str:
    """A byte count for people: ``"256 MiB"``, ``"1.5 GiB"``, ``"1500 B"``.

    Always exact: the largest binary unit is used only when the number fits
    in at most three decimals, so ``parse_size(format_size(n)) == n``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"format_size needs a non-negative int, got {n!r}")
    for unit, multiplier in _FORMAT_UNITS:
        if n >= multiplier:
            thousandths = Fraction(n * 1000, multiplier)
            if thousandths.denominator == 1:
                whole, frac = divmod(int(thousandths), 1000)
                number = str(whole) if frac == 0 else f"{whole}.{frac:03d}".rstrip("0")
                return f"{number} {unit}"
    return f"{n} B"


_WINDOW_RE = re.compile(r"([0-9]+)[ \t]*/[ \t]*([0-9]+(?:\.[0-9]+)?)[ \t]*([A-Za-z]+)", re.ASCII)
_WINDOW_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_window(value: str) -> tuple[int, float]:
    """``"3/60s"`` → ``(3, 60.0)``: a count per sliding window (units ms, s, m, h)."""
    if not isinstance(value, str):
        raise ValueError(f'expected a string like "3/60s", got {_toml_type(value)}')
    m = _WINDOW_RE.fullmatch(value.strip())
    if m is None:
        raise ValueError(
            'expected COUNT/WINDOW such as "3/60s", "3/2m" or "5/500ms" (units ms, s, m, h)'
        )
    count_text, window_text, unit = m.groups()
    scale = _WINDOW_UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown time unit {unit!r}: use ms, s, m or h")
    count = int(count_text)
    window = float(window_text) * scale
    if count < 1:
        raise ValueError("the count must be at least 1")
    if not window > 0 or not math.isfinite(window):
        raise ValueError("the window must be longer than zero")
    return count, window


# --- field types --------------------------------------------------------------


def _toml_type(value: object) -> str:
    """The TOML word for a value's type, for 'got a string'-style messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str | os.PathLike):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, datetime | date | time):
        return "a date/time"
    if value is None:
        return "nothing"
    return type(value).__name__


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
        _parse_admin(value)
    return value


def _parse_admin(text: str) -> Path | tuple[str, int]:
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

_MODEL = ConfigDict(extra="forbid", frozen=True, strict=True)


# --- sections -----------------------------------------------------------------


class HostSection(BaseModel):
    """``[host]``: where the daemon listens and keeps its state.

    Unset paths (None) mean "the default", resolved by the methods below.
    """

    model_config = _MODEL

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

    def socket_path(self, *, create: bool = True) -> Path:
        """The mailbox socket: ``socket``, else ``default_runtime_dir()/host.sock``."""
        if self.socket is not None:
            return self.socket
        return default_runtime_dir(create=create) / SOCKET_NAME

    def admin_address(self, *, create: bool = True) -> Path | tuple[str, int]:
        """The admin endpoint: a Unix socket path, or ``(host, port)`` for TCP."""
        if self.admin is not None:
            return _parse_admin(self.admin)
        return default_runtime_dir(create=create) / ADMIN_SOCKET_NAME

    def state_path(self, *, create: bool = True) -> Path:
        """The state directory (event log, tokens): ``state_dir`` or the default."""
        if self.state_dir is not None:
            return self.state_dir
        return default_state_dir(create=create)


class DeviceSection(BaseModel):
    """``[device]``: which backend and how much device memory to carve."""

    model_config = _MODEL

    backend: Backend = "emu"
    # None: 2 GiB on emu; on cuda the device's free memory (see HostConfig.effective_fb_total).
    fb_total: NonZeroSize | None = None
    pf_fb: Size = DEFAULT_PF_FB


class SriovSection(BaseModel):
    """``[sriov]``: how many VFs."""

    model_config = _MODEL

    vf_num: Annotated[int, _in_range(1, MAX_VF_NUM)] = DEFAULT_VF_NUM


class SchedulerSection(BaseModel):
    """``[scheduler]``: world-switch policy and the timeouts that mean "hang"."""

    model_config = _MODEL

    policy: Policy = DEFAULT_POLICY
    time_slice_ms: Annotated[int, _in_range(1, MAX_TIME_SLICE_MS)] = DEFAULT_TIME_SLICE_MS
    cmd_timeout_ms: Annotated[int, _in_range(1)] = DEFAULT_CMD_TIMEOUT_MS
    job_timeout_s: Annotated[float, _in_range(0, above=True)] = DEFAULT_JOB_TIMEOUT_S
    fullaccess_timeout_ms: Annotated[int, _in_range(1)] = DEFAULT_FULLACCESS_TIMEOUT_MS


class ResetSection(BaseModel):
    """``[reset]``: FLR handshake wait and the guard that quarantines a flapping VF."""

    model_config = _MODEL

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


class VFSection(BaseModel):
    """One ``[[vf]]`` table: settings for the VF with this ``index``."""

    model_config = _MODEL

    index: Annotated[int, _in_range(0)]
    fb: VFSize | None = None
    weight: Annotated[float, _in_range(0, above=True)] = DEFAULT_VF_WEIGHT
    token_file: AbsPath | None = None
    allowed_uids: Annotated[list[int] | None, AfterValidator(_uid_list)] = None


@dataclass(frozen=True, slots=True)
class VFPlan:
    """One VF as the host will set it up: every value resolved."""

    index: int
    fb: int  # bytes, including the reserved 128 KiB head
    weight: float
    token_file: Path
    allowed_uids: tuple[int, ...] | None  # None: any uid holding the token


class _InvalidConfig(ConfigError):
    """Cross-field problems found by HostConfig's own check; the loader adds the source."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class HostConfig(BaseModel):
    """The whole host configuration. Build it with `load_config` or `HostConfig.from_dict`."""

    model_config = _MODEL

    host: HostSection = Field(default_factory=HostSection)
    device: DeviceSection = Field(default_factory=DeviceSection)
    sriov: SriovSection = Field(default_factory=SriovSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    reset: ResetSection = Field(default_factory=ResetSection)
    vf: list[VFSection] = Field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> HostConfig:
        """Validate parsed TOML; every problem becomes one line of a ConfigError."""
        return _build(data, source, frozenset())

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Self:
        admin = self.host.admin_address(create=False)
        if (
            isinstance(admin, tuple)
            and not is_loopback(admin[0])
            and self.host.admin_token_file is None
        ):
            raise _InvalidConfig([
                f"host.admin = {_toml_str(self.host.admin or '')}: {admin[0]} is not a "
                "loopback address, and the admin API would be open to the network without "
                "authentication; set host.admin_token_file (a bearer token) or listen on "
                "127.0.0.1, [::1] or a Unix socket"
            ])  # fmt: skip
        total = self.device.fb_total
        if total is None and self.device.backend == "emu":
            total = DEFAULT_EMU_FB_TOTAL
        # cuda without fb_total: the sizes are checked again in vf_layout(device_total).
        _, problems = self._fb_plan(total, self._total_note(None))
        if problems:
            raise _InvalidConfig(problems)
        return self

    def effective_fb_total(self, device_total: int | None = None) -> int:
        """Bytes carved from the device: PF reserve plus every VF's FB.

        ``device.fb_total`` when set; else 2 GiB on emu; else (cuda)
        ``device_total``, the device's free memory, which the caller must pass.
        """
        if device_total is not None and (
            isinstance(device_total, bool) or not isinstance(device_total, int) or device_total <= 0
        ):
            raise ConfigError(f"device_total = {device_total!r}: must be a positive int of bytes")
        configured = self.device.fb_total
        if configured is not None:
            if device_total is not None and configured > device_total:
                raise ConfigError(
                    f"device.fb_total = {format_size(configured)}: the device has only "
                    f"{format_size(device_total)} free; lower device.fb_total"
                )
            return configured
        if self.device.backend == "emu":
            return DEFAULT_EMU_FB_TOTAL
        if device_total is None:
            raise ConfigError(
                'device.fb_total is not set and device.backend = "cuda": the size comes '
                "from the device's free memory, which must be passed as device_total"
            )
        return device_total

    def vf_layout(self, device_total: int | None = None) -> list[VFPlan]:
        """Every VF 0..vf_num-1 with its FB size, weight, token file and allowed uids."""
        total = self.effective_fb_total(device_total)
        sizes, problems = self._fb_plan(total, self._total_note(device_total))
        if problems:
            raise ConfigError("\n".join(problems))
        by_index = {vf.index: vf for vf in self.vf}
        state_dir: Path | None = None
        plans = []
        for index in range(self.sriov.vf_num):
            vf = by_index.get(index)
            token_file = vf.token_file if vf is not None else None
            if token_file is None:
                if state_dir is None:
                    # Only a path here; load_or_create_token makes the directory.
                    state_dir = self.host.state_path(create=False)
                token_file = state_dir / f"vf{index}.token"
            uids = vf.allowed_uids if vf is not None else None
            plans.append(
                VFPlan(
                    index=index,
                    fb=sizes[index],
                    weight=vf.weight if vf is not None else DEFAULT_VF_WEIGHT,
                    token_file=token_file,
                    allowed_uids=tuple(uids) if uids is not None else None,
                )
            )
        return plans

    def _total_note(self, device_total: int | None) -> str:
        if self.device.fb_total is not None:
            return ""
        if self.device.backend == "emu":
            return ", the emu default"
        return ", the device's free memory" if device_total is not None else ""

    def _fb_plan(self, fb_total: int | None, note: str) -> tuple[dict[int, int], list[str]]:
        """FB bytes per VF index, and the problems that stop the layout (if any)."""
        problems: list[str] = []
        vf_num = self.sriov.vf_num
        position: dict[int, int] = {}
        explicit: dict[int, int] = {}
        for pos, vf in enumerate(self.vf):
            key = f"vf[{pos}].index = {vf.index}"
            if vf.index >= vf_num:
                problems.append(
                    f"{key}: must be below sriov.vf_num ({vf_num}); "
                    f"VFs are numbered 0..{vf_num - 1}"
                )
            elif vf.index in position:
                problems.append(
                    f"{key}: duplicate; vf[{position[vf.index]}] already configures VF {vf.index}"
                )
            else:
                position[vf.index] = pos
                if vf.fb is not None:
                    explicit[vf.index] = vf.fb
        if fb_total is None:
            return {}, problems
        pf_fb = self.device.pf_fb
        if pf_fb >= fb_total:
            problems.append(
                f"device.pf_fb = {format_size(pf_fb)}: must be less than device.fb_total "
                f"({format_size(fb_total)}{note})"
            )
            return {}, problems
        available = fb_total - pf_fb
        used = sum(explicit.values())
        if used > available:
            keys = " + ".join(f"vf[{position[i]}].fb" for i in explicit)
            problems.append(
                f"{keys} = {format_size(used)}: together with device.pf_fb "
                f"({format_size(pf_fb)}) this exceeds device.fb_total "
                f"({format_size(fb_total)}{note}) by {format_size(used - available)}"
            )
            return {}, problems
        sizes = dict(explicit)
        rest = [i for i in range(vf_num) if i not in explicit]
        if rest:
            share = (available - used) // len(rest) // FB_ALIGN * FB_ALIGN
            if share < MIN_VF_FB:
                problems.append(
                    f"sriov.vf_num = {vf_num}: the {len(rest)} VF(s) without an explicit fb "
                    f"would get {format_size(share)} each ({format_size(available - used)} left "
                    f"of device.fb_total ({format_size(fb_total)}{note}) after device.pf_fb and "
                    f"explicit vf fb sizes), below the minimum of {format_size(MIN_VF_FB)}; "
                    "lower sriov.vf_num or the other sizes, or raise device.fb_total"
                )
            sizes.update(dict.fromkeys(rest, share))
        return sizes, problems

    def dump_toml(self, device_total: int | None = None) -> str:
        """The effective configuration as TOML with every key (``gpuvirt host --print-config``).

        Loading the result gives the same effective settings. On cuda without
        ``device.fb_total``, sizes are known only with ``device_total``;
        without it they are left as comments.
        """
        h, d, s, r = self.host, self.device, self.scheduler, self.reset
        admin = h.admin_address(create=False)
        if isinstance(admin, tuple):
            host, port = admin
            admin_text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        else:
            admin_text = str(admin)
        try:
            total: int | None = self.effective_fb_total(device_total)
        except ConfigError:
            total = None
        lines = [
            "# gpuvirt host configuration: effective values, every key",
            "",
            "[host]",
            f"socket = {_toml_str(str(h.socket_path(create=False)))}",
            f"admin = {_toml_str(admin_text)}",
            f"admin_token_file = {_toml_str(str(h.admin_token_file))}"
            if h.admin_token_file is not None
            else "# admin_token_file: not set; a TCP admin address must be loopback",
            f"state_dir = {_toml_str(str(h.state_path(create=False)))}",
            f"attach_timeout_ms = {h.attach_timeout_ms}",
            f"max_pending_attach = {h.max_pending_attach}",
            f"max_frames_per_s = {h.max_frames_per_s}",
            f"event_log_max = {_toml_str(format_size(h.event_log_max))}",
            f"event_log_files = {h.event_log_files}",
            "",
            "[device]",
            f"backend = {_toml_str(d.backend)}",
            f"fb_total = {_toml_str(format_size(total))}"
            if total is not None
            else "# fb_total: not set; the device's free memory at start",
            f"pf_fb = {_toml_str(format_size(d.pf_fb))}",
            "",
            "[sriov]",
            f"vf_num = {self.sriov.vf_num}",
            "",
            "[scheduler]",
            f"policy = {_toml_str(s.policy)}",
            f"time_slice_ms = {s.time_slice_ms}",
            f"cmd_timeout_ms = {s.cmd_timeout_ms}",
            f"job_timeout_s = {float(s.job_timeout_s)!r}",
            f"fullaccess_timeout_ms = {s.fullaccess_timeout_ms}",
            "",
            "[reset]",
            f"ready_to_reset_wait_ms = {r.ready_to_reset_wait_ms}",
            f"guard_flr = {_toml_str(r.guard_flr)}",
        ]
        rows: list[tuple[int, int | None, float, Path, tuple[int, ...] | None]]
        if total is not None:
            rows = [
                (p.index, p.fb, p.weight, p.token_file, p.allowed_uids)
                for p in self.vf_layout(device_total)
            ]
        else:
            # Shares of an unknown total: keep what was written, default the rest.
            by_index = {vf.index: vf for vf in self.vf}
            state_dir = h.state_path(create=False)
            rows = []
            for i in range(self.sriov.vf_num):
                vf = by_index.get(i) or VFSection(index=i)
                uids = tuple(vf.allowed_uids) if vf.allowed_uids is not None else None
                token = vf.token_file or state_dir / f"vf{i}.token"
                rows.append((i, vf.fb, vf.weight, token, uids))
        for index, fb, weight, token_file, uids in rows:
            lines += ["", "[[vf]]", f"index = {index}"]
            if fb is not None:
                lines.append(f"fb = {_toml_str(format_size(fb))}")
            else:
                lines.append("# fb: an equal share of the device's free memory")
            lines.append(f"weight = {float(weight)!r}")
            lines.append(f"token_file = {_toml_str(str(token_file))}")
            if uids is None:
                lines.append("# allowed_uids: not set; any uid holding the token may attach")
            else:
                lines.append(f"allowed_uids = [{', '.join(map(str, uids))}]")
        return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    """A TOML basic string (json.dumps would emit surrogate pairs TOML refuses)."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


# --- loading and error reports ------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> HostConfig:
    """Read, merge and validate the host configuration.

    ``path`` None means ``$GPUVIRT_CONFIG``, then /etc/gpuvirt/gpuvirt.toml if
    it exists, then the built-in defaults. ``overrides`` are dotted keys
    (``{"sriov.vf_num": 8}``) with TOML-typed values, applied over the file;
    a None value means "not overridden". Raises ConfigError, never anything
    from pydantic.
    """
    if path is None:
        env = os.environ.get(CONFIG_ENV)
        if env:
            return _load_file(Path(env), overrides, f" (from ${CONFIG_ENV})")
        if DEFAULT_CONFIG_PATH.exists():
            return _load_file(DEFAULT_CONFIG_PATH, overrides, "")
        return _merge_and_build({}, overrides, "built-in defaults")
    return _load_file(Path(path), overrides, "")


def parse_config(
    text: str, overrides: Mapping[str, object] | None = None, *, source: str = "<string>"
) -> HostConfig:
    """Like `load_config`, from TOML text instead of a file."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: TOML syntax error: {e}") from None
    return _merge_and_build(data, overrides, source)


def _load_file(path: Path, overrides: Mapping[str, object] | None, how: str) -> HostConfig:
    where = f"config file {path}{how}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"{where} cannot be read: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 (byte {e.start}); TOML files are UTF-8") from None
    return parse_config(text, overrides, source=str(path))


def _merge_and_build(
    data: dict[str, Any], overrides: Mapping[str, object] | None, source: str
) -> HostConfig:
    keys: set[tuple[str, ...]] = set()
    if overrides:
        data = copy.deepcopy(data)
        for dotted, value in overrides.items():
            if value is None:
                continue
            parts = tuple(dotted.split("."))
            if not all(parts):
                raise ConfigError(f"override {dotted!r}: not a dotted key such as sriov.vf_num")
            node: Any = data
            for i, part in enumerate(parts[:-1]):
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    where = ".".join(parts[: i + 1])
                    raise ConfigError(
                        f"override {dotted!r}: {where} is {_toml_type(node)}, not a table"
                    )
            node[parts[-1]] = value
            keys.add(parts)
        source += " with overrides"
    return _build(data, source, frozenset(keys))


def _build(
    data: Mapping[str, Any], source: str, override_keys: frozenset[tuple[str, ...]]
) -> HostConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid configuration ({source}): expected a table, got {data!r}")
    try:
        return HostConfig.model_validate(data)
    except ValidationError as e:
        problems = [_describe(err, override_keys) for err in e.errors(include_url=False)]
    except _InvalidConfig as e:
        problems = e.problems
    raise ConfigError(
        f"invalid configuration ({source}):\n" + "\n".join(f"  {p}" for p in problems)
    )


def _dotted(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: object) -> str:
    """A value as it would look in TOML, shortened."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = _toml_str(value)
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, list | tuple):
        text = "[" + ", ".join(_show(v) for v in value) + "]"
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "path_type": "expected a path string",
    "list_type": "expected an array",
    "model_type": "expected a table",
    "model_attributes_type": "expected a table",
    "dict_type": "expected a table",
}


def _fields_at(loc: Sequence[int | str]) -> list[str]:
    """Field names of the model a location points into, for 'did you mean'."""
    model: Any = HostConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        if getattr(annotation, "__origin__", None) is list:
            annotation = annotation.__args__[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _describe(err: Mapping[str, Any], override_keys: frozenset[tuple[str, ...]]) -> str:
    loc = tuple(err["loc"])
    key = _dotted(loc)
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return f"{key}: missing; this key is required"
    if kind == "extra_forbidden":
        known = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {close[0]}?" if close else "known keys here: " + ", ".join(known)
        reason = f"unknown key; {hint}"
    elif kind == "literal_error":
        reason = f"must be one of {ctx.get('expected')}"
    elif kind == "value_error" and "error" in ctx:
        reason = str(ctx["error"])
    elif kind == "list_type" and loc == ("vf",):
        reason = f"expected an array of tables, got {_toml_type(value)}: write each VF as [[vf]]"
    elif kind in _EXPECTED:
        reason = f"{_EXPECTED[kind]}, got {_toml_type(value)}"
    else:
        reason = str(err.get("msg", kind))
    line = f"{key} = {_show(value)}: {reason}"
    if any(loc[: len(k)] == k or k[: len(loc)] == loc for k in override_keys):
        line += " (set by an override)"
    return line


# --- runtime and state directories --------------------------------------------


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


# --- tokens -------------------------------------------------------------------

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
    token = _read_token(path)
    if token is None:
        token = _create_token(path)
    return token


def read_token(path: Path) -> bytes | None:
    """The token in ``path``, or None if there is no such file (never creates one)."""
    return _read_token(Path(path))


def _read_token(path: Path) -> bytes | None:
    """The token in ``path``, or None if there is no such file."""
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
        path.parent.mkdir(mode=_PRIVATE_MODE, parents=True, exist_ok=True)
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
        existing = _read_token(path)
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


# --- host mechanism constants (not configurable; here so every number lives in one file) ---

ENGINE_START_TIMEOUT_S = 30.0  # INIT_GPU of a fresh engine process: a Python start, not a switch
LIVENESS_INTERVAL_S = 5.0  # QUERY_ALIVE period per guest
LIVENESS_TIMEOUT_S = 2.0  # DESIGN.md: no answer within 2 s = the guest is gone
VF2PF_INTERVAL_MS = 2000  # PF2VF tells the guest this; the host reads VF2PF as often
VF2PF_MAX_BAD = 5  # consecutive bad VF2PF reads before the VF is logged untrustworthy
