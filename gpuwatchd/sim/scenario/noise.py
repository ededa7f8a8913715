"""Seeded jitter on a scenario's values (the `noise:` section, docs/scenarios.md).

An amplitude is a number in the value's unit or a percentage of it; a `_Jitter` applies
one value's draws, kept within its field's bounds. `_draw` is the deterministic uniform
draw behind them (the same in every process and on every platform).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Any

from gpuwatchd.sim.host import _NESTED as HOST_NESTED
from gpuwatchd.sim.host import HostValues, host_path_keys

_AMPLITUDE = re.compile(r"([0-9]+(?:\.[0-9]+)?)%")


def _amplitude(where: str, value: float | str) -> tuple[float, bool]:
    """A noise amplitude: a number in the value's unit, or "N%" of the value."""
    if isinstance(value, str):
        match = _AMPLITUDE.fullmatch(value.strip())
        if match is None:
            raise ValueError(f'{where}: an amplitude is a number or a percentage ("5%")')
        return float(match.group(1)) / 100, True
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: an amplitude is a finite number >= 0")
    return float(value), False


def _bounds(field: Any) -> tuple[float, float, bool]:
    """(low, high, low is exclusive) of a pydantic field's ge/gt/le constraints."""
    low, high, exclusive = -math.inf, math.inf, False
    for item in field.metadata:
        if getattr(item, "ge", None) is not None:
            low = float(item.ge)
        if getattr(item, "gt", None) is not None:
            low, exclusive = float(item.gt), True
        if getattr(item, "le", None) is not None:
            high = float(item.le)
    return low, high, exclusive


def _host_field(path: str) -> Any:
    """The pydantic field a host path ends at (check_host_ramp has accepted it), or
    None for a per-core percentage (a core's clock is bounded as the node's)."""
    parts = host_path_keys(path)
    if len(parts) == 2:
        return HostValues.model_fields["cpu_mhz"] if parts[0] == "core_mhz" else None
    if len(parts) == 3:
        return HOST_NESTED[parts[0]].model_fields[parts[2]]
    return HostValues.model_fields[parts[0]]


@dataclass(frozen=True)
class _Jitter:
    """One noisy value: its amplitude, its bounds, and a stable id for the draws."""

    ident: int
    amplitude: float
    relative: bool
    low: float
    high: float
    exclusive: bool  # low is a strict bound (gt): stay above it
    integer: bool

    @classmethod
    def of(cls, name: str, amplitude: float | str, field: Any) -> _Jitter:
        amp, relative = _amplitude(name, amplitude)
        low, high, exclusive = (0.0, 100.0, False) if field is None else _bounds(field)
        integer = field is not None and field.annotation == (int | None)
        # crc32, not hash(): str hashes differ between Python processes
        return cls(zlib.crc32(name.encode()), amp, relative, low, high, exclusive, integer)

    def apply(self, value: Any, seed: int, index: int, slot: int) -> Any:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return value
        spread = self.amplitude * (abs(value) if self.relative else 1.0)
        if spread == 0:
            return value
        jittered = value + spread * _draw(seed, self.ident, index, slot)
        low = self.low
        if self.exclusive:  # e.g. a step time (gt 0): never reach the bound
            low = value if value <= low else low + (value - low) / 2
        jittered = min(self.high, max(low, jittered))
        return round(jittered) if self.integer else jittered


_MASK = (1 << 64) - 1


def _draw(seed: int, ident: int, index: int, slot: int) -> float:
    """A uniform draw in [-1, 1) fixed by its arguments: splitmix64's finaliser over their
    mix (cheap, and the same in every process and on every platform)."""
    z = (seed * 0x9E3779B97F4A7C15 + ident * 0xD1B54A32D192ED03 + index * 0x8CB92BA72F3D8DD7
         + slot * 0xBF58476D1CE4E5B9) & _MASK  # fmt: skip
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z >> 11) / (1 << 52) - 1.0
