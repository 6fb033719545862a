"""Host configuration: TOML in, validated and frozen settings out.

- Every default lives in `gpuvirt.defaults` (outside this package, so the device
  layer reads them without pydantic); other modules read a `HostConfig` or
  those constants and never carry their own copy of a number.
- A bad configuration is refused as a whole with one `ConfigError` listing
  every problem, one per line, ``dotted.key = value: reason`` (`loader`).
  The host never starts half-configured.
- `sizes` parses "2GiB" and "3/60s"; `sections` holds the section models and
  their field types; `model` the whole `HostConfig` and the VF layout.
- Paths (`gpuvirt.paths`) and tokens (`gpuvirt.tokens`) live outside this
  package, because the guest library needs them without pydantic.
"""

from __future__ import annotations

from gpuvirt.config.loader import config_from_dict, load_config, parse_config, parse_vf_settings
from gpuvirt.config.model import HostConfig
from gpuvirt.config.sections import (
    DeviceSection,
    EngineSection,
    HostSection,
    ResetSection,
    SchedulerSection,
    SriovSection,
    VFPlan,
    VFSection,
    VFSettings,
    is_loopback,
)  # fmt: skip
from gpuvirt.config.sizes import MAX_SIZE, format_size, parse_size, parse_window
from gpuvirt.defaults import (
    DEFAULT_CMD_TIMEOUT_MS,
    DEFAULT_COOP_IDLE_TIMEOUT_MS,
    DEFAULT_EMU_FB_TOTAL,
    DEFAULT_FULLACCESS_TIMEOUT_MS,
    DEFAULT_GUARD_FLR,
    DEFAULT_JOB_TIMEOUT_S,
    DEFAULT_KERNEL_SCRATCH,
    DEFAULT_PF_FB,
    DEFAULT_POLICY,
    DEFAULT_READY_TO_RESET_WAIT_MS,
    DEFAULT_TIME_SLICE_MS,
    DEFAULT_VF_NUM,
    DEFAULT_VF_WEIGHT,
    ENGINE_START_TIMEOUT_S,
    FB_ALIGN,
    LIVENESS_INTERVAL_S,
    LIVENESS_TIMEOUT_S,
    MAX_TIME_SLICE_MS,
    MIN_VF_FB,
    VF2PF_INTERVAL_MS,
    VF2PF_MAX_BAD,
    GiB,
    KiB,
    MiB,
    TiB,
)  # fmt: skip
from gpuvirt.paths import (
    ADMIN_SOCKET_NAME,
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    SOCKET_NAME,
    SYSTEM_RUNTIME_DIR,
    SYSTEM_STATE_DIR,
    TMP_ROOT,
    default_runtime_dir,
    default_state_dir,
)  # fmt: skip
from gpuvirt.tokens import TOKEN_BYTES, load_or_create_token, parse_token, read_token

__all__ = [
    "ADMIN_SOCKET_NAME",
    "CONFIG_ENV",
    "DEFAULT_CMD_TIMEOUT_MS",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_COOP_IDLE_TIMEOUT_MS",
    "DEFAULT_EMU_FB_TOTAL",
    "DEFAULT_FULLACCESS_TIMEOUT_MS",
    "DEFAULT_GUARD_FLR",
    "DEFAULT_JOB_TIMEOUT_S",
    "DEFAULT_KERNEL_SCRATCH",
    "DEFAULT_PF_FB",
    "DEFAULT_POLICY",
    "DEFAULT_READY_TO_RESET_WAIT_MS",
    "DEFAULT_TIME_SLICE_MS",
    "DEFAULT_VF_NUM",
    "DEFAULT_VF_WEIGHT",
    "ENGINE_START_TIMEOUT_S",
    "FB_ALIGN",
    "LIVENESS_INTERVAL_S",
    "LIVENESS_TIMEOUT_S",
    "MAX_SIZE",
    "MAX_TIME_SLICE_MS",
    "MIN_VF_FB",
    "SOCKET_NAME",
    "SYSTEM_RUNTIME_DIR",
    "SYSTEM_STATE_DIR",
    "TMP_ROOT",
    "TOKEN_BYTES",
    "VF2PF_INTERVAL_MS",
    "VF2PF_MAX_BAD",
    "DeviceSection",
    "EngineSection",
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
    "VFSettings",
    "config_from_dict",
    "default_runtime_dir",
    "default_state_dir",
    "format_size",
    "is_loopback",
    "load_config",
    "load_or_create_token",
    "parse_config",
    "parse_size",
    "parse_token",
    "parse_vf_settings",
    "parse_window",
    "read_token",
]  # fmt: skip
