"""bench/bench_ingest.py's harness (issue 24): its bodies, and that a real Prometheus
stores exactly the series they hold. Checks the harness, not timings."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_ingest as bench  # noqa: E402


@pytest.fixture(scope="module")
def body() -> str:
    return bench.gpuwatchd_exposition("healthy-8gpu", until=120)


def test_strip_keeps_only_the_exposition() -> None:
    printed = (
        "scenario x: simulated 600s in 1.90s wall (601 steps)\n\n"
        "end of phase 'training' (t=299s)\n"
        "     gpu     util%\n       0        97\n  firing: none\n"
        "      421s  gpu 0  nccl_stall firing: GPU at 100% utilization\n"
    )
    exposition = (
        "# HELP up_total A counter.\n# TYPE up_total counter\n"
        'up_total{gpu="0",summary="a b } c"} 3.0\n'
    )
    assert bench.strip_to_exposition(printed + exposition) == exposition


def test_dcgm_body_is_the_default_counters_for_the_same_gpus(body: str) -> None:
    gpus = bench.gpus_of(body)
    assert len(gpus) == 8
    dcgm = bench.dcgm_exposition(bench.for_gpus(gpus, 3), bench.hostname(3))
    series = bench.distinct_series(dcgm)
    assert len(series) == len(bench.DCGM_DEFAULT_COUNTERS) * 8
    labels = {name for _, pairs in series for name, _ in pairs}
    assert labels == {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
                      "DCGM_FI_DRIVER_VERSION"}  # fmt: skip
    assert {gpu.uuid for gpu in gpus}.isdisjoint(dcgm.split('"'))  # the node's own UUIDs


def test_nodes_differ_and_values_move_but_series_do_not(body: str) -> None:
    node0, node1 = bench.for_node(body, 0), bench.for_node(body, 1)
    uuids = [{g.uuid for g in bench.gpus_of(b)} for b in (body, node0, node1)]
    assert len(set().union(*uuids)) == 24
    template = bench.Template.of(node1)
    rng = random.Random(0)
    scrapes = [template.render(n, rng).decode() for n in range(3)]
    assert all(bench.distinct_series(s) == bench.distinct_series(node1) for s in scrapes)
    assert scrapes[0] != scrapes[1]
    counters = [i for i, line in enumerate(template.lines) if line.kind == bench.COUNTER]
    assert counters
    for i in counters:  # a counter never goes back, or Prometheus would count a reset
        values = [float(s.splitlines()[i].rsplit(" ", 1)[1]) for s in scrapes]
        assert values == sorted(values)


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_prometheus_holds_exactly_the_bodies_series(body: str, tmp_path: Path) -> None:
    gpus = bench.gpus_of(body)
    bodies = [bench.for_node(body, 0), bench.for_node(body, 1)]
    bodies += [bench.dcgm_exposition(bench.for_gpus(gpus, i), bench.hostname(i)) for i in (2, 3)]
    templates = [bench.Template.of(b) for b in bodies]

    result = bench.ingest(templates, seconds=3, interval=1, workdir=tmp_path)  # counts, no rates

    expected = sum(t.series + bench.SCRAPE_SERIES_PER_TARGET for t in templates)
    assert result["prometheus_tsdb_head_series"] == expected
    assert result["samples_per_scrape"] == pytest.approx(sum(t.series for t in templates) / 4)
    assert result["down"] == 0
