"""Cumulative counters for the simulator's files, integrated from rates over time."""

from __future__ import annotations

from collections.abc import Hashable, Mapping


class Integrator:
    """Keeps kernel-style counters that rise by `rate × elapsed` between writes.

    `advance(t, rates)` adds, for every key, the rate seen at the previous write times
    the time since it (a step function, as a counter sampled at that rate would read).
    Time never goes backwards for a writer, even when the timeline loops, so counters
    only rise, as the kernel's do.
    """

    def __init__(self) -> None:
        self._last_t: float | None = None
        self._last_rates: dict[Hashable, float] = {}
        self.totals: dict[Hashable, float] = {}

    def advance(self, t: float, rates: Mapping[Hashable, float]) -> dict[Hashable, float]:
        if self._last_t is not None and t > self._last_t:
            dt = t - self._last_t
            for key, rate in self._last_rates.items():
                self.totals[key] = self.totals.get(key, 0.0) + rate * dt
        for key in rates:
            self.totals.setdefault(key, 0.0)
        if self._last_t is None or t >= self._last_t:
            self._last_t = t
            self._last_rates = dict(rates)
        return self.totals
