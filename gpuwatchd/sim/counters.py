"""Cumulative counters for the simulator's files, integrated from rates over time."""

from __future__ import annotations

from collections.abc import Hashable, Mapping


class Integrator:
    """Keeps kernel-style counters that rise by `rate × elapsed` between writes.

    `advance(t, rates)` brings every counter to t at the rates in force (those given
    at an earlier write: a step function, as a counter sampled at that rate would read).
    A counter is computed from where it stood when its rates last changed, so it reads
    the same at t however many writes came in between. Time never goes backwards for a
    writer, even when the timeline loops, so counters only rise, as the kernel's do.
    """

    def __init__(self) -> None:
        self._last_t: float | None = None
        self._last_rates: dict[Hashable, float] = {}
        self._since = 0.0  # when the rates in force took effect
        self._base: dict[Hashable, float] = {}  # the counters then
        self.totals: dict[Hashable, float] = {}

    def advance(self, t: float, rates: Mapping[Hashable, float]) -> dict[Hashable, float]:
        if self._last_t is not None and t > self._last_t:
            elapsed, base = t - self._since, self._base
            for key, rate in self._last_rates.items():
                self.totals[key] = base.get(key, 0.0) + rate * elapsed
        for key in rates:
            self.totals.setdefault(key, 0.0)
        if self._last_t is None or t >= self._last_t:
            self._last_t = t
            if rates != self._last_rates:
                self._last_rates = dict(rates)
                self._base, self._since = dict(self.totals), t
        return self.totals
