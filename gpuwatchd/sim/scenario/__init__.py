"""Scenario files: a node, a timeline of phases, and the ground truth to check against.

The format is documented in docs/scenarios.md. A scenario is pure data: `Timeline`
answers "what is every value on the node at virtual time t", and the fakes (NVML,
sysfs) render that state in the real bindings' and the kernel's formats.

Layout
------
Split by responsibility into the modules of this package; every public name the module
had before the split is importable from the package itself.

* `schema`: the pydantic models of a scenario file (node, phases, noise, expectations)
  and their validation;
* `noise`: the seeded jitter the `noise:` section puts on values;
* `topology`: the PCIe tree of a node's GPUs and the NVLinks its board wires;
* `timeline`: `Timeline`, every value at virtual time t;
* `load`: built-in scenarios and `load_scenario`.
"""

from __future__ import annotations

from gpuwatchd.config import parse_duration
from gpuwatchd.sim.scenario.load import SCENARIO_PACKAGE, builtin_scenarios, load_scenario
from gpuwatchd.sim.scenario.schema import (
    CLOCK_EVENT_REASONS,
    COUNTERS,
    FABRIC_STATES,
    NVLINK_FABRICS,
    PCIE_GROUPS,
    PCIE_WIDTHS,
    RAMPABLE,
    Change,
    Expectation,
    Fabric,
    GpuProcess,
    GpuSelector,
    GpuValues,
    LinkCapability,
    LinkValues,
    Node,
    Noise,
    Phase,
    Privileges,
    Scenario,
    Strict,
)
from gpuwatchd.sim.scenario.timeline import IDLE_DEFAULTS, Timeline, XidEvent, get_path
from gpuwatchd.sim.scenario.topology import PciFunction, Topology, nvlinks_wired

__all__ = [
    "CLOCK_EVENT_REASONS",
    "Expectation",
    "GpuValues",
    "Node",
    "Phase",
    "PciFunction",
    "Privileges",
    "Scenario",
    "Timeline",
    "Topology",
    "XidEvent",
    "nvlinks_wired",
    "builtin_scenarios",
    "load_scenario",
    "parse_duration",
    # the other public names of the module before the split
    "COUNTERS",
    "Change",
    "FABRIC_STATES",
    "Fabric",
    "GpuProcess",
    "GpuSelector",
    "IDLE_DEFAULTS",
    "LinkCapability",
    "LinkValues",
    "NVLINK_FABRICS",
    "Noise",
    "PCIE_GROUPS",
    "PCIE_WIDTHS",
    "RAMPABLE",
    "SCENARIO_PACKAGE",
    "Strict",
    "get_path",
]
