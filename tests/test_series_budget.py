"""What a node costs the fleet's Prometheus (issue 24): the series each family shows on a
healthy 8-GPU node with the default config stay within its declared budget
(MetricSpec.budget, docs/metrics.md), the node within dcgm-exporter's default set (24
series per GPU, issue 46) and 30 KB a scrape; the families held back (`nonzero`,
`detail`) show when they matter, and `detail_metrics` shows every family the store holds.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

from gpuwatchd.config import Config
from gpuwatchd.exporter import SELF_METRICS
from gpuwatchd.metrics import MetricSpec
from gpuwatchd.rules.engine import RULE_METRICS
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.sources import load_builtin_sources

ROOT = Path(__file__).resolve().parents[1]
GPUS = 8
# dcgm-exporter's default counters: 25 series per GPU (docs/performance.md); the rest
# of what the rules read stays in the store, shown with detail_metrics (issue 46)
SERIES_PER_GPU = 24
MAX_BYTES = 30_000


def all_specs() -> list[MetricSpec]:
    sources = load_builtin_sources().values()
    return [*(s for source in sources for s in source.metrics), *SELF_METRICS, *RULE_METRICS]


@cache
def exposition(
    scenario: str, detail: bool = False, until: float = 600.0, dcgm: str | None = None
) -> bytes:
    """The exposition at `until`; `dcgm`: the node's DCGM ("none": not installed)."""
    scn = load_scenario(scenario)
    if dcgm is not None:
        scn = scn.model_copy(update={"node": scn.node.model_copy(update={"dcgm": dcgm})})
    simulation = Simulation(scn, Config(detail_metrics=detail))
    try:
        return simulation.run(until=until).exposition
    finally:
        simulation.close()


def series_by_family(body: bytes) -> Counter[str]:
    families: Counter[str] = Counter()
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            families[line.split("{")[0].split(" ")[0]] += 1
    return families


def test_every_family_declares_what_it_shows():
    for spec in all_specs():
        assert spec.export in ("always", "nonzero", "detail", "internal"), spec.name
        assert spec.series_budget >= 0, spec.name


@pytest.mark.parametrize("scenario", ["healthy-8gpu", "idle-8gpu"])
def test_a_healthy_node_stays_within_every_familys_budget(scenario):
    body = exposition(scenario)
    shown = series_by_family(body)
    over = []
    for spec in all_specs():
        allowed = spec.series_budget * (GPUS if spec.per_gpu else 1)
        if shown[spec.name] > allowed:
            over.append(f"{spec.name}: {shown[spec.name]} series, budget {allowed}")
    assert not over, "\n".join(over)
    total = sum(shown.values())
    assert total <= SERIES_PER_GPU * GPUS, f"{total} series on {GPUS} GPUs"
    assert len(body) <= MAX_BYTES


def test_an_idle_node_costs_less_than_a_busy_one():
    idle = sum(series_by_family(exposition("idle-8gpu")).values())
    assert idle < sum(series_by_family(exposition("healthy-8gpu")).values())


def test_nothing_held_back_hides_a_fault():
    """The families shown only when nonzero appear with the fault they describe."""
    shown = series_by_family(exposition("pcie-uplink-x8-8xh100"))
    # the uplink between the third switch and its root port: both ends, for both GPUs
    assert shown["gpuwatchd_pcie_link_degraded"] == 4
    assert shown["gpuwatchd_starvation_active"] == 2
    assert shown["gpuwatchd_starvation_info"] == 2
    assert shown["gpuwatchd_pcie_link_width"] == 0  # the link's detail: detail_metrics
    replays = exposition("pcie-replay-errors").decode()
    assert 'gpuwatchd_gpu_pcie_replay_errors_total{gpu="1",' in replays  # the failing riser
    assert 'gpuwatchd_gpu_pcie_replay_errors_total{gpu="2",' not in replays  # none ever


def test_detail_metrics_shows_every_family_the_rules_read():
    plain = series_by_family(exposition("healthy-8gpu"))
    detail = series_by_family(exposition("healthy-8gpu", detail=True))
    assert detail.keys() > plain.keys()
    held_back = {spec.name for spec in all_specs() if spec.export == "detail"}
    assert held_back & detail.keys() == held_back & set(detail)
    assert not held_back & plain.keys()
    internal = {spec.name for spec in all_specs() if spec.export == "internal"}
    assert internal and not internal & detail.keys()  # free text: never exported
    assert sum(detail.values()) > 2 * sum(plain.values())


def test_rules_waiting_for_the_probe_are_not_exported_as_not_evaluable():
    body = exposition("healthy-8gpu").decode()
    assert "gpuwatchd_starvation_not_evaluable{" not in body
    assert 'cause="input_pipeline_stall"' not in body


SERIES_PER_INSTANCE = 20  # every series a GPU instance adds, with DCGM
SERIES_PER_INSTANCE_WITHOUT_DCGM = 32  # ... without: the rules that need DCGM say so
INSTANCE = re.compile(r'gpu="(\d+)".*gpu_instance="(\d+)"')


def series_by_instance(body: bytes) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """The series labelled with a GPU instance: how many each (gpu, gpu_instance) has, and
    how many each family has."""
    instances: Counter[tuple[str, str]] = Counter()
    families: Counter[str] = Counter()
    for line in body.decode().splitlines():
        found = None if line.startswith("#") else INSTANCE.search(line)
        if found:
            instances[(found.group(1), found.group(2))] += 1
            families[line.split("{")[0]] += 1
    return instances, families


def test_a_mig_gpu_costs_a_gpu_plus_a_bounded_share_per_instance():
    """Fourteen 1g.10gb instances on two A100s cost the node's Prometheus what the same
    node without MIG costs (its twin: the same tenants on whole GPUs) and at most
    SERIES_PER_INSTANCE a GPU instance, every series that carries its label counted (its
    memory, processes, activity, main process, owner and causes), not a copy of every
    per-GPU family."""
    body = exposition("mig-7x1g-a100-mixed-tenants")
    per_instance, families = series_by_instance(body)
    assert len(per_instance) == 14
    assert max(per_instance.values()) <= SERIES_PER_INSTANCE, per_instance
    shown = series_by_family(body)
    twin = sum(series_by_family(exposition("mig-twin-shared-a100-no-mig")).values())
    assert sum(shown.values()) - sum(families.values()) <= twin


def test_without_dcgm_a_mig_instance_says_which_rules_cannot_judge_it():
    """Without DCGM an instance has no utilization or activity (NVML has none on MIG):
    the rules that need them are not evaluable there, each a series of its own, within
    SERIES_PER_INSTANCE_WITHOUT_DCGM an instance (issue 42 item 7; docs/mig.md)."""
    body = exposition("mig-7x1g-a100-mixed-tenants", until=120.0, dcgm="none")
    per_instance, families = series_by_instance(body)
    assert len(per_instance) == 14
    assert max(per_instance.values()) <= SERIES_PER_INSTANCE_WITHOUT_DCGM, per_instance
    assert families["gpuwatchd_starvation_not_evaluable"] > 14  # more than one rule each
    assert not any("_active_ratio" in family for family in families)
    said = " ".join((ROOT / "docs" / "mig.md").read_text().split())
    budgets = SERIES_PER_INSTANCE, SERIES_PER_INSTANCE_WITHOUT_DCGM
    assert "at most {} with DCGM and at most {} without".format(*budgets) in said
