"""Per-item backoff for a loop that retries what failed (invariant 7: nothing loops without
backoff, and one failing item never holds up the others).

The reaper's passes (expired leases, abandoned rq jobs) run every second; an item whose give
back failed is skipped until its retry is due, the delay doubling with each failure up to a
cap, and forgotten once it succeeds or is no longer there to retry.
"""

from __future__ import annotations

import time
from collections.abc import Iterable


class Backoff:
    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._due: dict[str, tuple[float, int]] = {}  # item -> (monotonic time, failures)

    def __len__(self) -> int:
        return len(self._due)

    def due(self, item: str) -> bool:
        entry = self._due.get(item)
        return entry is None or time.monotonic() >= entry[0]

    def failed(self, item: str) -> float:
        """Record one more failure of ``item``; returns the seconds until its next try."""
        n = self._due.get(item, (0.0, 0))[1] + 1
        delay = min(self.max_s, self.first_s * 2.0 ** (n - 1))
        self._due[item] = (time.monotonic() + delay, n)
        return delay

    def done(self, item: str) -> None:
        self._due.pop(item, None)

    def keep_only(self, items: Iterable[str]) -> None:
        """Forget every item not in ``items`` (what is still there to retry)."""
        keep = set(items)
        for item in [i for i in self._due if i not in keep]:
            del self._due[item]
