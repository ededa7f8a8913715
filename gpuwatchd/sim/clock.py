"""Time for a simulated node: virtual (stepped by the caller) or real."""

from __future__ import annotations

import time


class SimClock:
    """Seconds since the scenario started, and the matching wall-clock time.

    Virtual: time moves only when `advance` is called, so a 30-minute scenario replays
    in as long as the CPU needs. Real: time is the process's monotonic clock. `start_at`
    starts the scenario that many seconds in (the wall clock still reads now).
    """

    def __init__(
        self, virtual: bool, start_wall: float | None = None, start_at: float = 0.0
    ) -> None:
        self.virtual = virtual
        self.start_wall = (time.time() if start_wall is None else start_wall) - start_at
        self._start_mono = time.monotonic() - start_at
        self._elapsed = start_at

    def elapsed(self) -> float:
        if self.virtual:
            return self._elapsed
        return time.monotonic() - self._start_mono

    def now(self) -> float:
        """Wall-clock (unix) seconds."""
        return self.start_wall + self.elapsed()

    def advance(self, seconds: float) -> None:
        if not self.virtual:
            raise RuntimeError("a real-time clock cannot be advanced")
        self._elapsed += seconds
