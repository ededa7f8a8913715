"""A simulated node's DCGM and a DCGM source reading it, for the DCGM source tests.

`Sim` builds the node's DCGM installation (`SimDcgm`: the fake bindings under the node's
root where DCGM installs them, and a host engine) at virtual time and runs the real
source on it; `Metrics` looks samples up by name and GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from series import Metrics as SampleIndex

from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.dcgm import SimDcgm, SimHostengine
from gpuwatchd.sim.scenario import Scenario, Timeline, load_scenario
from gpuwatchd.sources.base import Context
from gpuwatchd.sources.dcgm import DcgmConfig, DcgmSource, DcgmUnavailable

P = "gpuwatchd_"
WALL0 = 1_700_000_000.0


def scenario(phases: list[dict[str, Any]] | None = None, **node: Any) -> Scenario:
    node = {"gpu_count": 2, "pcie_topology": "direct", "hostname": "node7", **node}
    phases = phases or [
        {
            "name": "run",
            "duration": 3600,
            "set": {
                "utilization_gpu": 90,
                "power_w": 300,
                "sm_active": 0.7,
                "sm_occupancy": 0.3,
                "tensor_active": 0.4,
                "dram_active": 0.3,
                "gr_engine_active": 0.92,
                "pcie_tx_mb_s": 100,
                "pcie_rx_mb_s": 2000,
                "nvlink_tx_mb_s": 5000,
                "nvlink_rx_mb_s": 6000,
                "memory_used_mib": 1024,
            },
        }
    ]
    return Scenario.model_validate({"name": "t", "node": node, "phases": phases})


class Sim:
    """A node's DCGM installation at virtual time and a DCGM source reading it."""

    def __init__(
        self,
        root: Path,
        scn: Scenario | str | None = None,
        at: float = 10.0,
        environ: dict[str, str] | None = None,  # the daemon's environment (NODE_NAME)
        **config: Any,
    ) -> None:
        scn = load_scenario(scn) if isinstance(scn, str) else scn or scenario()
        self.timeline = Timeline(scn)
        self.clock = SimClock(virtual=True, start_wall=WALL0)
        self.clock.advance(at)
        self.dcgm = SimDcgm(self.timeline, self.clock, root)
        self.engine: SimHostengine = self.dcgm.hostengine  # type: ignore[assignment]
        extras = {
            "now": self.clock.now,
            "clock": self.clock.elapsed,
            "hostname": scn.node.hostname,
            **self.dcgm.context_extras(),
        }
        if environ is not None:
            extras["environ"] = environ
        self.config = DcgmConfig(**config)
        self.source = DcgmSource(self.config, Context(extras=extras))

    def collect(self) -> Metrics:
        return Metrics(self.source.collect())

    def down(self) -> DcgmUnavailable:
        with pytest.raises(DcgmUnavailable) as info:
            self.source.collect()
        return info.value

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def close(self) -> None:
        self.source.close()
        self.dcgm.close()


class Metrics(SampleIndex):
    def value(self, name: str, gpu: int, *extra: str) -> float:
        return {
            labels[2:]: v for labels, v in self.by_name[P + name].items() if labels[0] == str(gpu)
        }[extra]

    def names(self) -> set[str]:
        return {n.removeprefix(P) for n in self.by_name}

    def state(self) -> str:
        states = self.by_name[P + "dcgm_state"]
        assert sum(states.values()) == 1
        return next(labels[0] for labels, v in states.items() if v == 1)

    def profiling(self, gpu: int) -> str:
        states = {
            labels[2]: v
            for labels, v in self.by_name[P + "gpu_dcgm_profiling_state"].items()
            if labels[0] == str(gpu)
        }
        assert sum(states.values()) == 1
        return next(s for s, v in states.items() if v == 1)


def state_of(error: DcgmUnavailable) -> str:
    return Metrics(error.samples).state()


def sims(root: Path) -> Iterator[Callable[..., Sim]]:
    """The body of a `make` fixture: builds Sims under `root`, closes them after the test."""
    built: list[Sim] = []

    def build(scn: Scenario | str | None = None, **kwargs: Any) -> Sim:
        sim = Sim(root / f"node{len(built)}", scn, **kwargs)
        built.append(sim)
        return sim

    yield build
    for sim in built:
        sim.close()
