"""What a node costs the fleet's Prometheus (issue 24): the series each family shows on a
healthy 8-GPU node with the default config stay within its declared budget
(MetricSpec.budget, docs/metrics.md), the node within 60 series per GPU and 60 KB a
scrape; the families held back (`nonzero`, `detail`) show when they matter, and
`detail_metrics` shows every family the store holds.
"""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest

from gpuwatchd.config import Config
from gpuwatchd.exporter import SELF_METRICS
from gpuwatchd.metrics import MetricSpec
from gpuwatchd.rules.engine import RULE_METRICS
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.sources import load_builtin_sources

GPUS = 8
SERIES_PER_GPU = 60
MAX_BYTES = 60_000


def all_specs() -> list[MetricSpec]:
    sources = load_builtin_sources().values()
    return [*(s for source in sources for s in source.metrics), *SELF_METRICS, *RULE_METRICS]


@cache
def exposition(scenario: str, detail: bool = False, until: float = 600.0) -> bytes:
    simulation = Simulation(load_scenario(scenario), Config(detail_metrics=detail))
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
        assert spec.export in ("always", "nonzero", "detail"), spec.name
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
    assert sum(detail.values()) > 2 * sum(plain.values())


def test_rules_waiting_for_the_probe_are_not_exported_as_not_evaluable():
    body = exposition("healthy-8gpu").decode()
    assert "gpuwatchd_starvation_not_evaluable{" not in body
    assert 'cause="input_pipeline_stall"' not in body


SERIES_PER_INSTANCE = 20


def test_a_mig_gpu_costs_a_gpu_plus_a_bounded_share_per_instance():
    """Fourteen 1g.10gb instances on two A100s cost the node's Prometheus what the same
    node without MIG costs (its twin: the same tenants on whole GPUs) and at most
    SERIES_PER_INSTANCE a GPU instance (its memory, processes, activity, main process
    and owner), not a copy of every per-GPU family."""
    shown = series_by_family(exposition("mig-7x1g-a100-mixed-tenants"))
    per_instance = sum(n for name, n in shown.items() if "_gpu_instance_" in name)
    instances = shown["gpuwatchd_gpu_instance_info"]
    assert instances == 14
    assert per_instance <= SERIES_PER_INSTANCE * instances, per_instance
    twin = sum(series_by_family(exposition("mig-twin-shared-a100-no-mig")).values())
    assert sum(shown.values()) - per_instance <= twin
