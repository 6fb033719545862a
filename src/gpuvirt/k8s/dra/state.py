"""Prepared claims: configure VFs for a claim, hand back CDI ids, and undo it all.

The plain class behind the gRPC face (driver.py), tested without gRPC. Every
step is looked up in the checkpoint first, so a repeated prepare returns what
it returned before and a repeated unprepare is a no-op, also across a plugin
restart. One lock serializes prepares and unprepares: two claims running at
once can never both take a VF, since each checks the checkpoint's holder of
every VF under that lock before touching it.

Order, prepare: checkpoint PREPARING (with each VF's fb and weight before) →
`vf set` on the host → CDI spec → checkpoint PREPARED. Unprepare: detach the
guest if one is still there (disable + enable: the engine and FB go, fresh
ones come) → restore fb and weight → scrub the FB → remove the CDI spec →
drop the claim from the checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s.devices import SERVING, WITH_GUEST, AllocateError, allocate, host_view
from gpuvirt.k8s.dra import cdi
from gpuvirt.k8s.dra.checkpoint import Checkpoint, ClaimEntry, Phase, PreparedDevice
from gpuvirt.k8s.dra.params import ClaimError, VfConfig, Wanted, vf_index, wanted

log = logging.getLogger("gpuvirt.k8s.dra")


class Host(Protocol):
    """What the driver needs of the host's admin API (gpuvirt.admin_client.AdminClient)."""

    def status(self) -> dict[str, Any]: ...
    def vf(self, index: int, action: str | None = None) -> dict[str, Any]: ...
    def vf_set(
        self, index: int, fb: int | str | None = None, weight: float | None = None
    ) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


class State:
    def __init__(
        self,
        node: str,  # this node's name: its pool in the allocations
        host: Host,
        claims: Callable[[str, str], dict[str, Any]],  # (namespace, name) -> ResourceClaim
        checkpoint: Checkpoint,
        cdi_dir: Path,
    ) -> None:
        self.node = node
        self.host = host
        self.claims = claims
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self.lock = threading.Lock()

    # ---- prepare -----------------------------------------------------------------

    def prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        """The claim's devices, prepared; ClaimError (this claim only) or GpuvirtError."""
        with self.lock:
            entry = self.checkpoint.claims.get(ref.uid)
            if entry is not None and entry.phase == Phase.PREPARED:
                if not cdi.spec_path(self.cdi_dir, ref.uid).exists():
                    self._write_cdi(ref.uid, entry, self.host.status())  # lost meanwhile
                log.info("claim %s/%s (%s): already prepared", ref.namespace, ref.name, ref.uid)
                return entry.devices
            if entry is not None:
                # An interrupted prepare: put the VFs back first, then start over.
                self._restore(entry)
                del self.checkpoint.claims[ref.uid]
                self.checkpoint.save()
            return self._prepare(ref)

    def _prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        claim = self.claims(ref.namespace, ref.name)
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != ref.uid:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name} has uid {uid!r} on the API server, not"
                f" {ref.uid!r}: it was deleted and made again"
            )
        status = self.host.status()
        vfs = status["vfs"]
        wants = wanted(claim, self.node)
        devices = []
        for w in wants:
            index = vf_index(w.device, len(vfs), f"claim {ref.namespace}/{ref.name}")
            self._check_free(ref, index, vfs[index])
            devices.append(self._device(ref, w, index, vfs[index]))
        entry = ClaimEntry(ref.namespace, ref.name, Phase.PREPARING, devices)
        self.checkpoint.claims[ref.uid] = entry
        self.checkpoint.save()
        try:
            for w, d in zip(wants, devices, strict=True):
                self._configure(ref, d.vf, w.config)
            self._write_cdi(ref.uid, entry, self.host.status())
        except (GpuvirtError, OSError) as e:
            self._restore(entry)
            del self.checkpoint.claims[ref.uid]
            self.checkpoint.save()
            if isinstance(e, ClaimError):
                raise
            raise ClaimError(f"claim {ref.namespace}/{ref.name}: {e}") from None
        entry.phase = Phase.PREPARED
        self.checkpoint.save()
        log.info(
            "claim %s/%s (%s): prepared %s", ref.namespace, ref.name, ref.uid,
            ", ".join(f"VF{d.vf} {d.previous} -> {w.config.as_admin()}"
                      for w, d in zip(wants, devices, strict=True)),
        )  # fmt: skip
        return devices

    def _check_free(self, ref: ClaimRef, index: int, vf: dict[str, Any]) -> None:
        holder = self.checkpoint.holder(index)
        if holder is not None and holder != ref.uid:
            other = self.checkpoint.claims[holder]
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name}: VF{index} is prepared for claim"
                f" {other.namespace}/{other.name} ({holder}); it is freed when that claim is"
                " unprepared"
            )
        if vf["state"] not in SERVING:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name}: VF{index} is {vf['state']}; it cannot take"
                " a guest now"
            )

    def _device(self, ref: ClaimRef, w: Wanted, index: int, vf: dict[str, Any]) -> PreparedDevice:
        return PreparedDevice(
            request=w.request,
            pool=w.pool,
            device=w.device,
            vf=index,
            cdi_ids=[cdi.device_id(ref.uid, index)],
            previous={"fb": vf["fb_total"], "weight": vf["weight"]},
        )

    def _configure(self, ref: ClaimRef, index: int, config: VfConfig) -> None:
        body = config.as_admin()
        if body:
            try:
                self.host.vf_set(index, **body)
            except GpuvirtError as e:
                raise ClaimError(
                    f"claim {ref.namespace}/{ref.name}: parameters for VF{index} refused by"
                    f" the host: {e}"
                ) from None

    def _write_cdi(self, uid: str, entry: ClaimEntry, status: dict[str, Any]) -> None:
        """The CDI spec: for each VF, what the device plugin's Allocate would give."""
        view = host_view(status)
        try:
            edits = {d.vf: allocate(view, [d.device]) for d in entry.devices}
        except AllocateError as e:
            raise ClaimError(f"claim {entry.namespace}/{entry.name}: {e}") from None
        cdi.write_spec(self.cdi_dir, uid, edits)

    # ---- unprepare ---------------------------------------------------------------

    def unprepare(self, ref: ClaimRef) -> None:
        """Free the claim's VFs; a claim not prepared here is already unprepared."""
        with self.lock:
            entry = self.checkpoint.claims.get(ref.uid)
            if entry is None:
                log.info("claim %s/%s (%s): not prepared here", ref.namespace, ref.name, ref.uid)
                cdi.remove_spec(self.cdi_dir, ref.uid)
                return
            self._restore(entry)
            cdi.remove_spec(self.cdi_dir, ref.uid)
            del self.checkpoint.claims[ref.uid]
            self.checkpoint.save()
            log.info(
                "claim %s/%s (%s): unprepared, VF%s scrubbed", ref.namespace, ref.name, ref.uid,
                ", VF".join(str(d.vf) for d in entry.devices),
            )  # fmt: skip

    def _restore(self, entry: ClaimEntry) -> None:
        for d in entry.devices:
            state = self.host.vf(d.vf)["state"]
            if state in WITH_GUEST:
                self.host.vf(d.vf, "disable")
                self.host.vf(d.vf, "enable")
            now = self.host.vf(d.vf)
            back = {k: v for k, v in d.previous.items() if now[_STATUS_KEY[k]] != v}
            if back:
                self.host.vf_set(d.vf, **back)
            if self.host.vf(d.vf)["state"] == "AVAIL":
                self.host.vf(d.vf, "clear-fb")


_STATUS_KEY = {"fb": "fb_total", "weight": "weight"}
