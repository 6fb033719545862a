"""`HostConfig`: the whole configuration, its cross-field checks, the VF layout, TOML out."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, model_validator

from gpuvirt.config.sections import (
    MODEL,
    DeviceSection,
    EngineSection,
    HostSection,
    ResetSection,
    SchedulerSection,
    SriovSection,
    VFPlan,
    VFSection,
    is_loopback,
)  # fmt: skip
from gpuvirt.config.sizes import format_size
from gpuvirt.config.toml import toml_str
from gpuvirt.defaults import DEFAULT_EMU_FB_TOTAL, DEFAULT_VF_WEIGHT, FB_ALIGN, MIN_VF_FB
from gpuvirt.errors import ConfigError


class InvalidConfig(ConfigError):
    """Cross-field problems found by HostConfig's own check; the loader adds the source."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class HostConfig(BaseModel):
    """The whole host configuration. Build it with `load_config`, `parse_config` or `config_from_dict`."""

    model_config = MODEL

    host: HostSection = Field(default_factory=HostSection)
    device: DeviceSection = Field(default_factory=DeviceSection)
    sriov: SriovSection = Field(default_factory=SriovSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    reset: ResetSection = Field(default_factory=ResetSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    vf: list[VFSection] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Self:
        admin = self.host.admin_address(create=False)
        if (
            isinstance(admin, tuple)
            and not is_loopback(admin[0])
            and self.host.admin_token_file is None
        ):
            raise InvalidConfig([
                f"host.admin = {toml_str(self.host.admin or '')}: {admin[0]} is not a "
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
            raise InvalidConfig(problems)
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
                    f"{format_size(device_total)} free for FBs (after the engines' CUDA "
                    "contexts and kernel scratch); lower device.fb_total"
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
        if device_total is None:
            return ""
        return ", the device's free memory less what the engines take outside their FBs"

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
        h, d, s, r, e = self.host, self.device, self.scheduler, self.reset, self.engine
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
            f"socket = {toml_str(str(h.socket_path(create=False)))}",
            f"admin = {toml_str(admin_text)}",
            f"admin_token_file = {toml_str(str(h.admin_token_file))}"
            if h.admin_token_file is not None
            else "# admin_token_file: not set; a TCP admin address must be loopback",
            f"state_dir = {toml_str(str(h.state_path(create=False)))}",
            f"attach_timeout_ms = {h.attach_timeout_ms}",
            f"max_pending_attach = {h.max_pending_attach}",
            f"max_frames_per_s = {h.max_frames_per_s}",
            f"event_log_max = {toml_str(format_size(h.event_log_max))}",
            f"event_log_files = {h.event_log_files}",
            *(
                [f"socket_group = {_toml_value(h.socket_group)}"]
                if h.socket_group is not None
                else []
            ),
            f"socket_mode = 0o{h.socket_mode:o}",
            "",
            "[device]",
            f"backend = {toml_str(d.backend)}",
            f"fb_total = {toml_str(format_size(total))}"
            if total is not None
            else "# fb_total: not set; the device's free memory at start",
            f"pf_fb = {toml_str(format_size(d.pf_fb))}",
            f"kernel_scratch = {toml_str(format_size(d.kernel_scratch))}",
            "",
            "[sriov]",
            f"vf_num = {self.sriov.vf_num}",
            "",
            "[scheduler]",
            f"policy = {toml_str(s.policy)}",
            f"time_slice_ms = {s.time_slice_ms}",
            f"cmd_timeout_ms = {s.cmd_timeout_ms}",
            f"coop_idle_timeout_ms = {s.coop_idle_timeout_ms}",
            f"job_timeout_s = {float(s.job_timeout_s)!r}",
            f"fullaccess_timeout_ms = {s.fullaccess_timeout_ms}",
            "",
            "[reset]",
            f"ready_to_reset_wait_ms = {r.ready_to_reset_wait_ms}",
            f"guard_flr = {toml_str(r.guard_flr)}",
            "",
            "[engine]",
            f"sandbox = {toml_str(e.sandbox)}",
            f"uid_base = {e.uid_base}",
            f"memory = {toml_str(format_size(e.memory))}"
            if e.memory is not None
            else "# memory: not set; each engine's VF FB plus memory_allowance",
            f"memory_allowance = {toml_str(format_size(e.memory_allowance))}",
            f"tasks = {e.tasks}",
            f"nofile = {e.nofile}",
            f"scratch = {toml_str(format_size(e.scratch))}",
            f"poll_us = {e.poll_us}",
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
                lines.append(f"fb = {toml_str(format_size(fb))}")
            else:
                lines.append("# fb: an equal share of the device's free memory")
            lines.append(f"weight = {float(weight)!r}")
            lines.append(f"token_file = {toml_str(str(token_file))}")
            if uids is None:
                lines.append("# allowed_uids: not set; any uid holding the token may attach")
            else:
                lines.append(f"allowed_uids = [{', '.join(map(str, uids))}]")
        return "\n".join(lines) + "\n"


def _toml_value(value: str | int) -> str:
    return toml_str(value) if isinstance(value, str) else str(value)
