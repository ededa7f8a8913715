"""Source registry: name -> class, one module per source (as node_exporter does)."""

from __future__ import annotations

from gpuwatchd.sources.base import Context, Source, SourceError

REGISTRY: dict[str, type[Source]] = {}


def register(cls: type[Source]) -> type[Source]:
    REGISTRY[cls.name] = cls
    return cls


def load_builtin_sources() -> dict[str, type[Source]]:
    from gpuwatchd.sources import nvml, pcie  # noqa: F401 - imported to register

    return REGISTRY


__all__ = ["Context", "REGISTRY", "Source", "SourceError", "load_builtin_sources", "register"]
