"""Source registry: name -> class, one module per source (as node_exporter does).

Each module registers its class with `@register`; `BUILTIN` names the modules the
daemon ships, in the order their sources are polled and documented.
"""

from __future__ import annotations

import importlib

from gpuwatchd.sources.base import Context, Source, SourceError

BUILTIN = (
    "nvml", "dcgm", "pcie", "interrupts", "cpu", "disks", "infiniband", "processes", "probe",
    "kmsg",
)  # fmt: skip

REGISTRY: dict[str, type[Source]] = {}


def register(cls: type[Source]) -> type[Source]:
    REGISTRY[cls.name] = cls
    return cls


def load_builtin_sources() -> dict[str, type[Source]]:
    """The built-in sources by name (importing a module registers its source)."""
    for module in BUILTIN:
        importlib.import_module(f"gpuwatchd.sources.{module}")
    return {name: REGISTRY[name] for name in BUILTIN}


__all__ = ["BUILTIN", "Context", "REGISTRY", "Source", "SourceError", "load_builtin_sources"]
