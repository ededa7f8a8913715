"""Values the simulated host engine integrates over the timeline (energy, violation time,
NVLink traffic) and when a watch's latest sample was taken."""

from __future__ import annotations

import bisect
import math

from gpuwatchd.sim.dcgm.fields import VIOLATIONS
from gpuwatchd.sim.scenario import Timeline

_VIOLATION_INDEX = {fid: 2 + i for i, fid in enumerate(VIOLATIONS)}  # in Integrals' totals


def sample_time(t: float, since: float, interval: float) -> float:
    """A watch's latest sample at t: on its interval grid, not before it was set up."""
    return max(since, math.floor(t / interval + 1e-9) * interval)


class Integrals:
    """Energy, violation time and NVLink traffic integrated exactly over the timeline.

    Within a phase every value is constant or a linear ramp, so a phase's integral is
    its length times the value at its midpoint; the current phase adds the part up to t.
    """

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.gpus = timeline.scenario.node.gpu_count
        self._rates_cache: tuple[float, list[tuple[float, ...]]] | None = None
        phases = timeline.phases()
        self._starts = [start for start, _ in phases]
        self._durations = [phase.duration for _, phase in phases]
        self._cumulative: list[list[tuple[float, ...]]] = []  # per phase start, per GPU
        totals = [self._zero() for _ in range(self.gpus)]
        for start, duration in zip(self._starts, self._durations, strict=True):
            self._cumulative.append([tuple(x) for x in totals])
            rates = self._rates(start + duration / 2)
            totals = [
                [a + r * duration for a, r in zip(acc, rate, strict=True)]
                for acc, rate in zip(totals, rates, strict=True)
            ]
        self._cycle = [tuple(x) for x in totals]

    @staticmethod
    def _zero() -> list[float]:
        return [0.0] * (2 + len(VIOLATIONS))

    def _rates(self, t: float) -> list[tuple[float, ...]]:
        cached = self._rates_cache
        if cached is not None and cached[0] == t:
            return cached[1]
        out = []
        for v in self.timeline.state(t)[0]:
            reasons = set(v.get("clock_event_reasons") or ())
            nvlink = (v.get("nvlink_tx_mb_s") or 0.0) + (v.get("nvlink_rx_mb_s") or 0.0)
            out.append(
                (
                    float(v["power_w"]),
                    nvlink * 1e6,
                    *(1.0 if reasons & why else 0.0 for why in VIOLATIONS.values()),
                )
            )
        self._rates_cache = (t, out)
        return out

    def _total(self, gpu: int, index: int, t: float) -> float:
        timeline = self.timeline
        duration = timeline.duration
        cycles, local = 0, t
        if timeline.loop and duration > 0:
            cycles = int(t // duration)
            local = t - cycles * duration
        total = cycles * self._cycle[gpu][index]
        if not self._starts:
            return total
        if not timeline.loop and local >= duration:  # after the end, values stay frozen
            rate = self._rates(duration)[gpu][index]
            return total + self._cycle[gpu][index] + rate * (local - duration)
        p = max(0, bisect.bisect_right(self._starts, local) - 1)
        start = self._starts[p]
        elapsed = local - start
        rate = self._rates(start + elapsed / 2)[gpu][index] if elapsed > 0 else 0.0
        return total + self._cumulative[p][gpu][index] + rate * elapsed

    def energy_j(self, gpu: int, t: float) -> float:
        return self._total(gpu, 0, t)

    def nvlink_bytes(self, gpu: int, t: float) -> float:
        return self._total(gpu, 1, t)

    def violation_s(self, gpu: int, field_id: int, t: float) -> float:
        return self._total(gpu, _VIOLATION_INDEX[field_id], t)
