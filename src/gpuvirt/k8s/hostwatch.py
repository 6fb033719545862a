"""Follows one gpuvirt host through its admin API, for ListAndWatch and Allocate.

A thread long-polls ``/events``. Every VF state transition in a batch becomes a
view of its own, in order, so that a reset over in 45 ms still shows as
Unhealthy then Healthy; after the batch ``/status`` is read again (FB sizes,
guests). Each subscriber (one per ListAndWatch stream) gets every view. When the
host cannot be reached (stopped, restarting) every device turns Unhealthy and
the thread tries again every RETRY_S; a host that comes back (a new pid, its
event numbers starting afresh) is read from the start.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from gpuvirt.admin_client import AdminClient
from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s.devices import HostView, host_view, initial_view

LONG_POLL_S = 10.0  # one /events request waits this long for news
RETRY_S = 0.5  # between attempts to reach a host that is gone


class HostWatcher:
    def __init__(self, admin: AdminClient, vf_num: int) -> None:
        self.admin = admin
        self._lock = threading.Lock()
        self._view = initial_view(vf_num)
        self._subscribers: set[queue.SimpleQueue[HostView]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuvirt-hostwatch", daemon=True)
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def view(self) -> HostView:
        return self._view

    def fresh(self) -> HostView:
        """The host's status read now (for Allocate), else the last view."""
        try:
            return host_view(self.admin.status())
        except GpuvirtError:
            return self._view

    def subscribe(self) -> tuple[HostView, queue.SimpleQueue[HostView]]:
        """The view now, and a queue that gets every later one."""
        q: queue.SimpleQueue[HostView] = queue.SimpleQueue()
        with self._lock:
            self._subscribers.add(q)
            return self._view, q

    def unsubscribe(self, q: queue.SimpleQueue[HostView]) -> None:
        with self._lock:
            self._subscribers.discard(q)

    def _publish(self, view: HostView) -> None:
        with self._lock:
            if view == self._view:
                return
            self._view = view
            for q in self._subscribers:
                q.put(view)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except (GpuvirtError, ValueError, OSError) as e:
                self.last_error = str(e)
                self._publish(self._view.gone())
                self._stop.wait(RETRY_S)

    def _follow(self) -> None:
        """Until the host is gone or replaced: each transition, and its status after
        every batch of events."""
        seq = self._last_seq()
        view = host_view(self.admin.status())
        self._publish(view)
        while not self._stop.is_set():
            events = self.admin.events(after=seq, wait=LONG_POLL_S)
            for ev in events:
                if ev.get("kind") == "transition" and isinstance(ev.get("vf"), int):
                    view = view.with_state(ev["vf"], str(ev["data"]["new"]))
                    self._publish(view)
            if not events:
                continue
            seq = events[-1]["seq"]
            fresh = host_view(self.admin.status())
            self._publish(fresh)
            if fresh.pid != view.pid:
                return  # another host process: its event numbers are not ours
            view = fresh

    def _last_seq(self) -> int:
        last: list[dict[str, Any]] = self.admin.request("GET", "/events?after=0&limit=1")
        return last[-1]["seq"] if last else 0
