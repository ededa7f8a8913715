"""A simulated node's PCIe tree (`Topology`, its `PciFunction`s) and the NVLinks its
board wires (`nvlinks_wired`), both derived from the scenario's node."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpuwatchd.sim.models import GpuModel

if TYPE_CHECKING:
    from gpuwatchd.sim.host import IbPort
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
    under a root port. An RDMA device placed `beside_gpu` gets a downstream port of that
    GPU's switch (direct: a root port of the GPU's root complex); one placed only on a
    `numa_node`, a root complex of its own there.
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
        self.nic_names: dict[str, str] = {}  # RDMA device -> its function's name
        self._nics_beside: dict[tuple[str, str | None], int] = {}
        for port in node.host.ib_ports:
            placed = port.beside_gpu is not None or port.numa_node is not None
            if placed and port.device not in self.nic_names:
                self._nic(port)
        if node.pcie_max:
            self._capabilities(node.pcie_max)

    def _capabilities(self, caps: dict[str, LinkCapability]) -> None:
        """Give functions the scenario's own maxima (`Node.pcie_max`)."""
        gpus = set(self.gpu_names)
        for name, fn in list(self.functions.items()):
            if name in self.nic_names.values():
                continue
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

    def _nic(self, port: IbPort) -> None:
        """Add the function of `port`'s RDMA device and the port it hangs from."""
        k = len(self.nic_names)
        gen = 5 if port.rate_gbps >= 400 else 4
        if port.beside_gpu is None:  # a root complex of its own on its NUMA node
            numa, root, domain = port.numa_node or 0, f"pci{0x20 + k:04x}:00", f"{0x20 + k:04x}"
            above, bdf, bus = None, f"{domain}:00:01.0", 1
        else:
            gpu = self.gpu(port.beside_gpu)
            numa, root = gpu.numa_node, gpu.domain_root
            parent = self.functions[gpu.parent or ""]
            above = parent.parent  # switched: the GPU's switch upstream port; direct: none
            beside = self._nics_beside.get((root, above), 0)
            self._nics_beside[(root, above)] = beside + 1
            domain, root_bus = parent.bdf.split(":")[0], int(parent.bdf.split(":")[1], 16)
            if above is not None:  # a downstream port of the GPU's switch
                up_bus = int(self.functions[above].bdf.split(":")[1], 16)
                bdf, bus = f"{domain}:{up_bus + 1:02x}:{0x10 + beside:02x}.0", up_bus + 4 + beside
            else:  # a root port on the GPU's root bus
                bdf, bus = f"{domain}:{root_bus:02x}:02.{beside}", root_bus + 2 + beside
        bridge = PciFunction(f"nic{k}-port", bdf, above, root, gen, 16, numa)
        nic = PciFunction(f"nic{k}", f"{domain}:{bus:02x}:00.0", bridge.name, root, gen, 16, numa)
        self._add(bridge)
        self._add(nic)
        self.nic_names[port.device] = nic.name

    def sysfs_path(self, name: str) -> str:
        """The function's directory below `devices/` ("pci0000:10/0000:10:01.1/...")."""
        chain = self.path_to_root(name)
        return "/".join([chain[0].domain_root, *(fn.bdf for fn in chain)])

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

    def endpoints(self) -> set[str]:
        """The functions at the end of a link: the GPUs and the RDMA devices."""
        return {*self.gpu_names, *self.nic_names.values()}

    def bridges(self) -> list[PciFunction]:
        ends = self.endpoints()
        return [fn for fn in self.functions.values() if fn.name not in ends]


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


def nvlink_peers(node: Node) -> list[dict[int, int | None]]:
    """Per GPU, what each wired NVLink faces: another GPU's index, or None for an
    NVSwitch. A direct board splits a GPU's links over the other GPUs in blocks, in
    index order (4 A100s: links 0-3 to the first other GPU, 4-7 the second, 8-11 the
    third; leftover links to the last); a bridge joins GPUs 0-1, 2-3, ..."""
    fabric, count = node.nvlink_fabric(), node.gpu_count
    out: list[dict[int, int | None]] = []
    for gpu, wired in enumerate(nvlinks_wired(node)):
        links = sorted(wired)
        others = [peer for peer in range(count) if peer != gpu]
        if fabric == "nvswitch":
            out.append(dict.fromkeys(links))
        elif fabric == "bridge":
            out.append(dict.fromkeys(links, gpu ^ 1))
        elif others:
            per, last = max(1, len(links) // len(others)), len(others) - 1
            out.append({link: others[min(i // per, last)] for i, link in enumerate(links)})
        else:
            out.append({})  # one GPU on a direct board: its links reach nothing
    return out
