"""What a ResourceClaim asks of this driver: its devices here and their VfConfig.

Pure code, no I/O: a claim (the resource.k8s.io/v1 object as a JSON dict) in,
`Wanted` devices out, or a `ClaimError` naming the key, the value and the
reason. The opaque parameters are ``{"fb": "4GiB", "weight": 3}``, both
optional, with ``apiVersion: gpuvirt.io/v1`` and ``kind: VfConfig`` allowed.
Configs apply in the order the API server lists them (the class's first, then
the claim's), a later one overriding an earlier one key by key, as upstream
drivers merge them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuvirt.config import parse_vf_settings
from gpuvirt.errors import ConfigError, GpuvirtError

DRIVER = "gpuvirt.io"
API_VERSION = "gpuvirt.io/v1"
KIND = "VfConfig"


class ClaimError(GpuvirtError):
    """This claim cannot be prepared; the message says why. Never fatal to the plugin."""


@dataclass(frozen=True, slots=True)
class VfConfig:
    fb: int | None = None  # bytes
    weight: float | None = None

    def as_admin(self) -> dict[str, int | float]:
        """The body of the host's `POST /vf/N/set`."""
        return {k: v for k, v in (("fb", self.fb), ("weight", self.weight)) if v is not None}


@dataclass(frozen=True, slots=True)
class Wanted:
    """One allocated device of this driver on this node, and how to set it up."""

    request: str
    pool: str
    device: str
    config: VfConfig


def parse_config(params: Any, where: str = "parameters") -> VfConfig:
    """A VfConfig from one opaque parameters object.

    fb and weight follow the host's own rules for a VF (config.parse_vf_settings,
    as `gpuvirt vf set` does); apiVersion and kind are checked here. Whether an
    fb fits the device (beside the other VFs) only the host can say, when the
    driver asks it to set the VF; its refusal fails the claim the same way.
    """
    if isinstance(params, str | bytes):
        try:
            params = json.loads(params)
        except ValueError as e:
            raise ClaimError(f"{where}: not JSON ({e})") from None
    if not isinstance(params, Mapping):
        raise ClaimError(
            f'{where} = {_show(params)}: expected an object such as {{"fb": "4GiB", "weight": 3}}'
        )
    for key, expected in (("apiVersion", API_VERSION), ("kind", KIND)):
        if key in params and params[key] != expected:
            raise ClaimError(f"{where}: {key} = {_show(params[key])}: must be {expected!r}")
    settings = {k: v for k, v in params.items() if k not in ("apiVersion", "kind")}
    try:
        parsed = parse_vf_settings(settings, where)
    except ConfigError as e:
        raise ClaimError(str(e)) from None
    return VfConfig(fb=parsed.fb, weight=parsed.weight)


def wanted(claim: Mapping[str, Any], node: str) -> list[Wanted]:
    """This node's devices of this driver in `claim`'s allocation, each with its merged config."""
    name = _claim_name(claim)
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {name} is not allocated yet")
    devices = allocation.get("devices") or {}
    results = [r for r in devices.get("results") or [] if r.get("driver") == DRIVER]
    mine = [r for r in results if r.get("pool") == node]
    if not mine:
        pools = sorted({str(r.get("pool")) for r in results})
        raise ClaimError(
            f"claim {name} has no {DRIVER} device on node {node!r}"
            + (f" (its devices are in pools {', '.join(pools)})" if pools else "")
        )
    configs = [
        (i, c) for i, c in enumerate(devices.get("config") or [])
        if (c.get("opaque") or {}).get("driver") == DRIVER
    ]  # fmt: skip
    out = []
    for result in mine:
        merged: dict[str, Any] = {}
        for i, c in configs:
            if _applies(c.get("requests") or [], result["request"]):
                params = c["opaque"].get("parameters")
                where = f"claim {name}: config[{i}] ({c.get('source', '?')}) parameters"
                parse_config(params, where)  # each one checked where it was written
                merged.update(params if isinstance(params, Mapping) else json.loads(params))
        out.append(
            Wanted(
                request=result["request"],
                pool=result["pool"],
                device=result["device"],
                config=parse_config(merged, f"claim {name}: parameters"),
            )
        )
    return out


def _applies(requests: list[str], request: str) -> bool:
    # A result of a subrequest is named "request/subrequest"; a config for the
    # parent request covers it.
    return not requests or request in requests or request.split("/", 1)[0] in requests


def _claim_name(claim: Mapping[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def device_name(vf: int) -> str:
    """A VF's device name in the ResourceSlice."""
    return f"vf{vf}"


def vf_index(device: str, vf_count: int, where: str = "claim") -> int:
    """The VF behind a device name from an allocation; a name not ours is a ClaimError."""
    digits = device[2:] if device.startswith("vf") else ""
    if not digits.isdigit() or device != device_name(int(digits)) or int(digits) >= vf_count:
        raise ClaimError(
            f"{where}: allocated device {device!r} is not a VF of this node"
            f" (it has vf0..vf{vf_count - 1})"
        )
    return int(digits)
