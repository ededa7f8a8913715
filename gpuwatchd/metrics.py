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
# a MIG GPU instance's series: its GPU's labels, its GI id (dcgm-exporter's GPU_I_ID) and
# the GI's profile (GPU_I_PROFILE, e.g. 3g.40gb)
INSTANCE_LABELS = GPU_LABELS + ("gpu_instance", "profile")


# What the exposition shows of a family (the store, the rules and the status page always
# have all of it): every node's Prometheus pays for each series, so a family that is
# mostly zeros, constant, or node_exporter's is not shown by default.
#   always:  every series
#   nonzero: the series whose value is not 0: a rare event's counter from its first event,
#            a flag while it is set (absent reads as 0 where the GPU's other series exist)
#   detail:  only with `detail_metrics: true` (rule evidence, configuration, constants)
#   internal: never: text for the rules' summaries (the kernel log's driver messages),
#            which would be an unbounded label; it reaches Prometheus only frozen in a
#            firing cause's starvation_info summary
Export = Literal["always", "nonzero", "detail", "internal"]


@dataclass(frozen=True)
class MetricSpec:
    name: str  # full name, with the gpuwatchd_ prefix; counters end in _total
    help: str
    labels: tuple[str, ...] = ()
    type: Literal["gauge", "counter"] = "gauge"
    export: Export = "always"
    # series the family may show on a healthy 8-GPU node with the default config: per GPU
    # where it has a `gpu` label, else per node (docs/metrics.md; tests/test_series_budget)
    budget: int | None = None  # None: 1 where shown always, else 0
    # a MIG GPU instance's form of a per-GPU family: the family it splits (full name); the
    # rules read it as that family when they judge the instance (docs/mig.md)
    instance_of: str | None = None

    @property
    def series_budget(self) -> int:
        if self.budget is not None:
            return self.budget
        return 1 if self.export == "always" else 0

    @property
    def per_gpu(self) -> bool:
        return "gpu" in self.labels or "gpu_bus_id" in self.labels

    def shown(self, detail: bool) -> bool:
        """Whether the exposition shows the family at all."""
        if self.export == "internal":
            return False
        return detail or self.export != "detail"


class Sample(NamedTuple):
    name: str
    labels: tuple[str, ...]  # values, in the order of the spec's label names
    value: float


def gauge(
    name: str,
    help: str,
    labels: tuple[str, ...] = (),
    export: Export = "always",
    budget: int | None = None,
) -> MetricSpec:
    return MetricSpec(PREFIX + name, help, labels, "gauge", export, budget)


def counter(
    name: str,
    help: str,
    labels: tuple[str, ...] = (),
    export: Export = "always",
    budget: int | None = None,
) -> MetricSpec:
    assert name.endswith("_total"), name
    return MetricSpec(PREFIX + name, help, labels, "counter", export, budget)


def gpu_gauge(
    name: str,
    help: str,
    extra: tuple[str, ...] = (),
    export: Export = "always",
    budget: int | None = None,
) -> MetricSpec:
    """Per GPU: labels gpu, uuid, then `extra`."""
    return gauge(name, help, GPU_LABELS + extra, export, budget)


def gpu_counter(
    name: str,
    help: str,
    extra: tuple[str, ...] = (),
    export: Export = "always",
    budget: int | None = None,
) -> MetricSpec:
    """Per GPU: labels gpu, uuid, then `extra`."""
    return counter(name, help, GPU_LABELS + extra, export, budget)


def instance_form(
    spec: MetricSpec, help: str | None = None, judged: bool = True, export: Export | None = None
) -> MetricSpec:
    """The per-MIG-GPU-instance form of the per-GPU family `spec`: `gpu_X` becomes
    `gpu_instance_X` (any other `Y`, `gpu_instance_Y`), labels INSTANCE_LABELS then the
    family's own; shown as `spec` is, budget 0 (a healthy non-MIG node has none).
    `judged`: the rules read it in place of `spec` when they judge an instance (the
    instance's share of the physics); False for a detail of the GPU's own physics that
    the GPU's family keeps counting (an Xid hits the GPU, whichever instance it names).
    `export`: what the exposition shows, where not `spec`'s (up to 7 instances a GPU)."""
    assert spec.labels[:2] == GPU_LABELS, spec.name
    bare = spec.name.removeprefix(PREFIX)
    name = PREFIX + "gpu_instance_" + bare.removeprefix("gpu_")
    text = help or f"{spec.help.rstrip('.')}; per MIG GPU instance."
    labels = INSTANCE_LABELS + spec.labels[2:]
    shown = export or spec.export
    return MetricSpec(name, text, labels, spec.type, shown, 0, spec.name if judged else None)
