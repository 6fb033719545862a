"""The node's ResourceSlice: one device per VF, kept in step with the host.

`build_slice` is pure (the host's status in, a resource.k8s.io/v1
ResourceSlice out). `SlicePublisher` follows the host's event log by
long-polling the admin endpoint: after any event it re-reads the VF table and
writes the slice again only if a device changed (health, fb, weight, ...),
with the pool's generation one higher, as the API asks of a driver that
updates a pool. While the host is unreachable every device is published as
Unhealthy. `remove` deletes this node's slices when the plugin stops.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s.devices import SERVING
from gpuvirt.k8s.dra.kube import Kube, KubeError
from gpuvirt.k8s.dra.params import DRIVER, device_name

log = logging.getLogger("gpuvirt.k8s.dra")

API_VERSION = "resource.k8s.io/v1"
RETRY_S = 2.0  # after the host or the API server failed us
POLL_S = 10.0  # one long-poll of the host's events


def slice_name(node: str) -> str:
    return f"{node}-{DRIVER}"


def devices(
    vfs: list[dict[str, Any]], backend: str, reachable: bool = True
) -> list[dict[str, Any]]:
    out = []
    for v in vfs:
        healthy = reachable and v["state"] in SERVING
        attributes = {
            "index": {"int": v["index"]},
            "backend": {"string": backend},
            "fbBytes": {"int": v["fb_total"]},
            # DRA attributes have no floats; a fractional weight (config only) rounds.
            "weight": {"int": max(1, round(v["weight"]))},
            "health": {"string": "Healthy" if healthy else "Unhealthy"},
            "state": {"string": v["state"] if reachable else "UNKNOWN"},
        }
        out.append(
            {
                "name": device_name(v["index"]),
                "attributes": attributes,
                "capacity": {"fb": {"value": str(v["fb_total"])}},
            }
        )
    return out


def build_slice(node: str, generation: int, devs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node)},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devs,
        },
    }


class SlicePublisher:
    def __init__(self, kube: Kube, host: Any, node: str) -> None:
        self.kube = kube
        self.host = host  # AdminClient
        self.node = node
        self.stopping = threading.Event()
        # Held while writing, so that no write lands after stop() removed the slice.
        self._writing = threading.Lock()
        self.published: dict[str, Any] | None = None  # the slice as the API server has it
        self.updates = 0  # slices written, for whoever watches
        self._last: tuple[list[dict[str, Any]], str] | None = None  # last good (vfs, backend)
        self.host_pid: int | None = None  # a new pid: a restarted host, counting events anew

    # ---- one step ----------------------------------------------------------------

    def sync(self) -> bool:
        """Publish the host's VFs now if they differ from the slice; True if it wrote."""
        try:
            st = self.host.status()
            self.host_pid = st["pid"]
            self._last = (st["vfs"], st["backend"])
            devs = devices(st["vfs"], st["backend"])
        except GpuvirtError as e:
            if self._last is None:
                log.warning("host unreachable and no VF seen yet: %s", e)
                return False
            devs = devices(*self._last, reachable=False)
        return self._write(devs)

    def _write(self, devs: list[dict[str, Any]]) -> bool:
        with self._writing:
            return not self.stopping.is_set() and self._write_locked(devs)

    def _write_locked(self, devs: list[dict[str, Any]]) -> bool:
        if self.published is None:
            self.published = self._adopt()
        if self.published is not None and self.published["spec"].get("devices") == devs:
            return False
        if self.published is None:
            self.published = self.kube.create_slice(build_slice(self.node, 1, devs))
        else:
            generation = self.published["spec"]["pool"]["generation"] + 1
            body = build_slice(self.node, generation, devs)
            body["metadata"]["resourceVersion"] = self.published["metadata"]["resourceVersion"]
            try:
                self.published = self.kube.replace_slice(body)
            except KubeError as e:
                if e.status == 409:  # someone else wrote it: read it again next time
                    self.published = None
                raise
        self.updates += 1
        log.info(
            "ResourceSlice %s generation %d: %s", slice_name(self.node),
            self.published["spec"]["pool"]["generation"],
            ", ".join(f"{d['name']} {d['attributes']['health']['string']}" for d in devs),
        )  # fmt: skip
        return True

    def _adopt(self) -> dict[str, Any] | None:
        """The slice a previous run left, if any; other slices of ours on this node go."""
        mine = None
        for s in self.kube.slices(self.node, DRIVER):
            if s["metadata"]["name"] == slice_name(self.node):
                mine = s
            else:
                self.kube.delete_slice(s["metadata"]["name"])
        return mine

    # ---- the loop ----------------------------------------------------------------

    def start(self) -> SlicePublisher:
        threading.Thread(target=self._run, name="slices", daemon=True).start()
        return self

    def _run(self) -> None:
        after, pid = 0, None
        while not self.stopping.is_set():
            try:
                self.sync()
                if self.host_pid != pid:
                    after, pid = 0, self.host_pid
                events = self.host.events(after=after, wait=POLL_S)
                if events:
                    after = events[-1]["seq"]
            except GpuvirtError as e:
                log.warning("ResourceSlice not updated: %s", e)
                self.stopping.wait(RETRY_S)

    def stop(self) -> None:
        """Stop following the host and delete this node's slices."""
        self.stopping.set()
        # The thread may sit in a long-poll of the host; it writes nothing after this.
        with self._writing:
            self.remove()

    def remove(self) -> None:
        for s in self.kube.slices(self.node, DRIVER):
            self.kube.delete_slice(s["metadata"]["name"])
        self.published = None
