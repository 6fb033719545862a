"""Token buckets for what peers can make the host do: read frames, write events.

Loop-only (no lock): every bucket belongs to the asyncio side of the host.
"""

from __future__ import annotations

import time


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else rate
        self._tokens = self.burst
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def available(self) -> float:
        self._refill()
        return self._tokens

    def take(self, n: float = 1) -> bool:
        """Take n tokens if there are that many."""
        self._refill()
        if self._tokens < n:
            return False
        self._tokens -= n
        return True

    def spend(self, n: float) -> None:
        """Take n tokens even into debt (what was already read must be paid for)."""
        self._refill()
        self._tokens -= n

    def wait_s(self, n: float = 1) -> float:
        """Seconds until n tokens are there; 0 if they are now."""
        return max(0.0, (n - self.available()) / self.rate)


class EventThrottle:
    """At most `rate` events a second of one kind; the rest are counted, not written.

    `admit()` says whether to write this one, and with it how many were dropped
    since the last one written, so the log still says how much happened.
    """

    def __init__(self, rate: float, burst: float) -> None:
        self._bucket = TokenBucket(rate, burst)
        self._dropped = 0

    def admit(self) -> int | None:
        if not self._bucket.take():
            self._dropped += 1
            return None
        dropped, self._dropped = self._dropped, 0
        return dropped
