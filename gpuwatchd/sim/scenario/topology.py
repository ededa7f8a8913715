"""A simulated node's PCIe tree (`Topology`, its `PciFunction`s) and the NVLinks its
board wires (`nvlinks_wired`), both derived from the scenario's node."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpuwatchd.sim.models import GpuModel

if TYPE_CHECKING:
    from gpuwatchd.sim.scenario.schema import LinkCapability, Node


@dataclass(frozen=True)
class PciFunction:
    """One PCI function in the simulated tree: a GPU or a bridge above it."""

    name: str  # "gpu3", "rp1", "sw1-up", "sw1-dp1"
    bdf: str  # 0000:4e:00.0
    parent: str | None  # name of the bridge above, None under the host bridge
    domain_root: str  # the pciDDDD:BB directory it hangs from
    max_gen: int
    max_width: int
    numa_node: int


class Topology:
    """The PCIe tree a node's GPUs sit in, derived from the node description.

    switched: two GPUs per PCIe switch (upstream port + one downstream port per GPU),
    each switch under its own CPU root port, as on HGX boards. direct: each GPU directly
    under a root port.
    """

    def __init__(self, node: Node) -> None:
        model = node.model()
        self.functions: dict[str, PciFunction] = {}
        self.gpu_names: list[str] = []
        per_numa = max(1, -(-node.gpu_count // node.numa_nodes))
        for i in range(node.gpu_count):
            numa = min(i // per_numa, node.numa_nodes - 1)
            if node.pcie_topology == "switched":
                self._switched_gpu(i, numa, model)
            else:
                self._direct_gpu(i, numa, model)
        if node.pcie_max:
            self._capabilities(node.pcie_max)

    def _capabilities(self, caps: dict[str, LinkCapability]) -> None:
        """Give functions the scenario's own maxima (`Node.pcie_max`)."""
        gpus = set(self.gpu_names)
        for name, fn in list(self.functions.items()):
            group = (
                "gpus" if name in gpus else "root_ports" if fn.parent is None else "switch_ports"
            )
            gen, width = fn.max_gen, fn.max_width
            for key in (group, name):  # the function's own entry beats its group's
                cap = caps.get(key)
                if cap is not None:
                    gen = cap.gen if cap.gen is not None else gen
                    width = cap.width if cap.width is not None else width
            self.functions[name] = replace(fn, max_gen=gen, max_width=width)

    def _add(self, fn: PciFunction) -> None:
        self.functions.setdefault(fn.name, fn)

    def _switched_gpu(self, i: int, numa: int, model: GpuModel) -> None:
        sw, port = divmod(i, 2)
        # bus numbers stop at 0xff: 8 switches per PCI domain (segment), as large nodes do
        domain, slot = divmod(sw, 8)
        root_bus = 0x10 + 0x20 * slot  # each switch in its own root complex
        root, d = f"pci{domain:04x}:{root_bus:02x}", f"{domain:04x}"
        gen = model.pcie_max_gen  # HGX switches match the GPUs' generation
        rp = PciFunction(f"rp{sw}", f"{d}:{root_bus:02x}:01.1", None, root, gen, 16, numa)
        up = PciFunction(f"sw{sw}-up", f"{d}:{root_bus + 1:02x}:00.0", rp.name, root, gen, 16, numa)
        dp = PciFunction(
            f"sw{sw}-dp{port}",
            f"{d}:{root_bus + 2:02x}:{port * 8:02x}.0",
            up.name,
            root,
            gen,
            16,
            numa,
        )
        gpu = PciFunction(
            f"gpu{i}",
            f"{d}:{root_bus + 3 + port:02x}:00.0",
            dp.name,
            root,
            model.pcie_max_gen,
            model.pcie_max_width,
            numa,
        )
        for fn in (rp, up, dp, gpu):
            self._add(fn)
        self.gpu_names.append(gpu.name)

    def _direct_gpu(self, i: int, numa: int, model: GpuModel) -> None:
        domain, slot = divmod(i, 15)  # 15 root ports per PCI domain: bus numbers stop at 0xff
        root_bus = 0x10 + 0x10 * slot
        root, d = f"pci{domain:04x}:{root_bus:02x}", f"{domain:04x}"
        gen = model.pcie_max_gen
        rp = PciFunction(f"rp{i}", f"{d}:{root_bus:02x}:01.1", None, root, gen, 16, numa)
        gpu = PciFunction(
            f"gpu{i}",
            f"{d}:{root_bus + 1:02x}:00.0",
            rp.name,
            root,
            model.pcie_max_gen,
            model.pcie_max_width,
            numa,
        )
        self._add(rp)
        self._add(gpu)
        self.gpu_names.append(gpu.name)

    def gpu(self, index: int) -> PciFunction:
        return self.functions[self.gpu_names[index]]

    def path_to_root(self, name: str) -> list[PciFunction]:
        """Root port first, `name` last."""
        chain: list[PciFunction] = []
        current: str | None = name
        while current is not None:
            fn = self.functions[current]
            chain.append(fn)
            current = fn.parent
        return chain[::-1]

    def bridges(self) -> list[PciFunction]:
        return [fn for fn in self.functions.values() if not fn.name.startswith("gpu")]


def nvlinks_wired(node: Node) -> list[frozenset[int]]:
    """Per GPU, the NVLinks the board connects (the others are never active): all of
    them on NVSwitch and direct boards, the bridge's (`GpuModel.nvlink_bridge_links`)
    for GPUs paired by a bridge (0-1, 2-3, ...; an odd last GPU has none), none without."""
    model, fabric = node.model(), node.nvlink_fabric()
    every = frozenset(range(model.nvlinks))
    if fabric in ("nvswitch", "direct"):
        return [every] * node.gpu_count
    if fabric == "bridge":
        bridged = frozenset(model.nvlink_bridge_links) if model.nvlink_bridge_links else every
        return [bridged if (i ^ 1) < node.gpu_count else frozenset() for i in range(node.gpu_count)]
    return [frozenset()] * node.gpu_count
