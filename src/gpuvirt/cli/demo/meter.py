"""Shares of device time per VF over the demo run, from the host's status samples."""

from __future__ import annotations

from typing import Any


class ShareMeter:
    """Device time per VF over the run, from successive status samples.

    A VF's device time starts over when its engine restarts (an FLR), so a
    drop means 'new engine' and the new value is all new time. 'steady' only
    counts intervals in which every VF was ACTIVE with no FLR, the part of the
    run where the policy's shares are what it promises.
    """

    def __init__(self) -> None:
        self.prev: dict[int, tuple[float, str, int]] = {}
        self.total: dict[int, float] = {}
        self.steady: dict[int, float] = {}

    def add(self, status: dict[str, Any]) -> None:
        cur = {v["index"]: (v["device_ms"], v["state"], v["flr_count"]) for v in status["vfs"]}
        if self.prev:
            calm = all(self._calm(self.prev.get(i), now) for i, now in cur.items())
            for i, (ms, _, _) in cur.items():
                before = self.prev.get(i, (0.0, "", 0))[0]
                d = ms - before if ms >= before else ms
                self.total[i] = self.total.get(i, 0.0) + d
                if calm:
                    self.steady[i] = self.steady.get(i, 0.0) + d
        self.prev = cur

    @staticmethod
    def _calm(before: tuple[float, str, int] | None, now: tuple[float, str, int]) -> bool:
        """ACTIVE at both ends of the interval, and no FLR in between."""
        return before is not None and before[1] == now[1] == "ACTIVE" and before[2] == now[2]

    @staticmethod
    def shares(times: dict[int, float]) -> dict[int, float]:
        s = sum(times.values())
        return {i: (t / s if s else 0.0) for i, t in times.items()}
