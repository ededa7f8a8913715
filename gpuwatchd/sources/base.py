"""The source contract: one kind of telemetry, one class, polled on its own interval."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from gpuwatchd.config import SourceConfig
from gpuwatchd.metrics import MetricSpec, Sample


class SourceError(Exception):
    """The whole source failed this poll (its series go stale); the message says why."""


@dataclass
class Context:
    """What sources may touch on this node: file roots and the NVML binding to use.

    Tests and the simulator point the roots at written trees and pass a simulated
    `pynvml`; production passes /proc, /sys and the real nvidia-ml-py module.
    """

    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")
    pynvml: ModuleType | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Source(ABC):
    name: ClassVar[str]
    metrics: ClassVar[tuple[MetricSpec, ...]]

    def __init__(self, config: SourceConfig, context: Context) -> None:
        self.config = config
        self.context = context

    @abstractmethod
    def collect(self) -> list[Sample]:
        """Return every current sample, or raise SourceError (or anything) on failure."""

    def close(self) -> None:  # noqa: B027 - most sources hold nothing
        """Release what the source holds (library handles, threads)."""
