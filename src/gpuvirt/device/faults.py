"""Test-only fault switch for engine starts, shared by both backends.

Read once by the host from GPUVIRT_FAULT_ENGINE_START: "VF:SKIP:COUNT" makes
VF's engine starts after the first SKIP fail (the process really exits during
start), COUNT times, or forever when COUNT is 0. Several specs: comma-separated.
"""

from __future__ import annotations

FAULT_ENV = "GPUVIRT_FAULT_ENGINE_START"


class StartFaults:
    def __init__(self, spec: str) -> None:
        self.plan: dict[int, list[int]] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            vf, skip, count = (int(x) for x in part.split(":"))
            self.plan[vf] = [skip, count if count else -1]
        self.starts: dict[int, int] = {}

    def should_fail(self, vf: int) -> bool:
        n = self.starts.get(vf, 0)
        self.starts[vf] = n + 1
        if vf not in self.plan:
            return False
        skip, left = self.plan[vf]
        if n < skip or left == 0:
            return False
        if left > 0:
            self.plan[vf][1] = left - 1
        return True
