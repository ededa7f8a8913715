"""What a source produces: metric specs and samples.

A source declares every metric family it can emit once (name, type, help, label
names) and returns flat samples on each poll. The exporter renders from the specs;
the store keys series by (name, label values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

PREFIX = "gpuwatchd_"
GPU_LABELS = ("gpu", "uuid")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # full name, with the gpuwatchd_ prefix; counters end in _total
    help: str
    labels: tuple[str, ...] = ()
    type: Literal["gauge", "counter"] = "gauge"


class Sample(NamedTuple):
    name: str
    labels: tuple[str, ...]  # values, in the order of the spec's label names
    value: float


def gauge(name: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(PREFIX + name, help, labels, "gauge")


def counter(name: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    assert name.endswith("_total"), name
    return MetricSpec(PREFIX + name, help, labels, "counter")
