"""The simulator's sysfs: a scenario's PCIe tree written in the kernel's real formats.

`SysfsWriter(root, timeline).write(t)` lays out, under `root`, what Linux shows under
/sys for the functions of `timeline.topology`, so the real `pcie` source reads it with
`sysfs: root`:

    root/devices/pci0000:10/0000:10:01.1/                      root port
    root/devices/pci0000:10/0000:10:01.1/0000:11:00.0/         switch upstream port
    root/devices/pci0000:10/0000:10:01.1/0000:11:00.0/0000:12:00.0/               downstream port
    root/devices/pci0000:10/0000:10:01.1/0000:11:00.0/0000:12:00.0/0000:13:00.0/  GPU
    root/bus/pci/devices/0000:13:00.0 -> ../../../devices/pci0000:10/0000:10:01.1/...

Each function directory holds `vendor`, `device`, `subsystem_vendor`,
`subsystem_device`, `class`, `current_link_speed`, `max_link_speed`,
`current_link_width`, `max_link_width`, `numa_node`, `local_cpulist`, `local_cpus`,
`uevent` and `aer_dev_correctable` / `aer_dev_nonfatal` / `aer_dev_fatal`, byte for byte
in the formats of drivers/pci/pci-sysfs.c and drivers/pci/pcie/aer.c (newline-terminated,
"16.0 GT/s PCIe", "TOTAL_ERR_COR 0", ...). Bridge ids are representative: root ports
are Intel 8086:1bbc (as in a captured H100 node), switch ports PLX 10b5:8796
(Broadcom 1000:c030 PEX890xx for Gen5 GPUs).

Link model (the rule `bridges:` in a phase follows)
----------------------------------------------------
A PCIe link has two ends and both report the same current speed and width; each end
reports its own `max_link_*` (its LnkCap). The link a function reports on is:

* a GPU (endpoint) or a switch upstream port: the link above it, to its parent;
* a root port or a switch downstream port: the link below it, to its (only) child.

So a GPU shares its link with its parent downstream port (or, in the `direct`
topology, its root port), and a switch upstream port shares its link with its root
port. A link trains to the lowest of what both ends ask for and support:

    current = min(max of either end, wanted by either end)

where a GPU wants its `pcie_gen`/`pcie_width` from `Timeline.state` and a bridge wants
its `bridges:` entry (default: its maximum). Hence `bridges: {sw1-up: {gen: 3}}` and
`bridges: {rp1: {gen: 3}}` both put the rp1 <-> sw1-up link at Gen3, and
`bridges: {sw1-dp1: {width: 8}}` puts GPU 3's link at x8, exactly as `pcie_width: 8`
on GPU 3 would. `link_states()` applies the rule; the fake NVML can use it to report
the same current link for a GPU as sysfs does.

A GPU that is `lost` (fell off the bus) has no link: the GPU reads "Unknown" and width
0, and the port above it reads a trained-down "2.5 GT/s PCIe" at width 0, as `lspci`
shows a port with the link down ("Speed 2.5GT/s (downgraded), Width x0").

AER counters are zero unless a GPU's values carry `aer_correctable_total`,
`aer_nonfatal_total` or `aer_fatal_total` (written into the GPU's own files).

Writes are cheap and safe to read concurrently: the content of every file is cached and
only a changed file is written, each through a temporary file and `os.replace`, so a
reader sees the old bytes or the new ones, never a half-written file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import PciFunction, Timeline, Topology

NVIDIA_VENDOR = 0x10DE
BRIDGE_CLASS = 0x060400
MELLANOX_VENDOR, CONNECTX7 = 0x15B3, 0x1021
INFINIBAND_CLASS, ETHERNET_CLASS = 0x020700, 0x020000
ROOT_PORT_ID = (0x8086, 0x1BBC)
SWITCH_ID = (0x10B5, 0x8796)
SWITCH_ID_GEN5 = (0x1000, 0xC030)

# pci_speed_string() in drivers/pci/probe.c, by generation
SPEED_STRINGS = {
    1: "2.5 GT/s PCIe",
    2: "5.0 GT/s PCIe",
    3: "8.0 GT/s PCIe",
    4: "16.0 GT/s PCIe",
    5: "32.0 GT/s PCIe",
    6: "64.0 GT/s PCIe",
}
UNKNOWN_SPEED = "Unknown"

# aer_correctable_error_string / aer_uncorrectable_error_string in drivers/pci/pcie/aer.c,
# in the order the kernel prints them (as in the node_exporter fixtures)
AER_CORRECTABLE = (
    "RxErr",
    "BadTLP",
    "BadDLLP",
    "Rollover",
    "Timeout",
    "NonFatalErr",
    "CorrIntErr",
    "HeaderOF",
)
AER_UNCORRECTABLE = (
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
)
# (file, breakdown names, the line a simulated count goes to, TOTAL_ suffix, GPU value key)
AER_FILES = (
    ("aer_dev_correctable", AER_CORRECTABLE, "BadTLP", "ERR_COR", "aer_correctable_total"),
    ("aer_dev_nonfatal", AER_UNCORRECTABLE, "CmpltTO", "ERR_NONFATAL", "aer_nonfatal_total"),
    ("aer_dev_fatal", AER_UNCORRECTABLE, "DLP", "ERR_FATAL", "aer_fatal_total"),
)

DYNAMIC_FILES = ("current_link_speed", "current_link_width", *(f[0] for f in AER_FILES))

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]$")
_ROOT = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")

Link = tuple[int | None, int | None]  # (generation, width); None: unknown / link down


def speed_string(gen: int | None) -> str:
    return SPEED_STRINGS.get(gen, UNKNOWN_SPEED) if gen is not None else UNKNOWN_SPEED


def aer_text(names: tuple[str, ...], total_name: str, counts: Mapping[str, int]) -> str:
    """An aer_dev_* file: one "<name> <count>" line per error type, then TOTAL_<total_name>."""
    lines = [f"{name} {int(counts.get(name, 0))}" for name in names]
    lines.append(f"TOTAL_{total_name} {sum(int(counts.get(n, 0)) for n in names)}")
    return "\n".join(lines) + "\n"


def cpulist(cpus: list[int]) -> str:
    """The kernel's cpulist format ("0-63,128-191") for sorted CPU numbers."""
    parts: list[str] = []
    start = prev = None
    for cpu in cpus:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
        start = prev = cpu
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)


def cpumask(cpus: list[int], nr_cpus: int) -> str:
    """The kernel's cpumask format (`local_cpus`): 32-bit hex groups, most significant first,
    the first one only as wide as nr_cpus needs ("ffff" for 16 CPUs)."""
    bits = 0
    for cpu in cpus:
        bits |= 1 << cpu
    groups = max(1, -(-nr_cpus // 32))
    out = []
    for g in range(groups - 1, -1, -1):
        word = (bits >> (32 * g)) & 0xFFFFFFFF
        if g == groups - 1:
            top_bits = nr_cpus - 32 * g
            out.append(f"{word:0{max(1, -(-top_bits // 4))}x}")
        else:
            out.append(f"{word:08x}")
    return ",".join(out)


def numa_cpus(node: int, nr_cpus: int, numa_nodes: int) -> list[int]:
    """CPUs of a NUMA node: contiguous equal blocks, the last node taking any remainder."""
    if node < 0:
        return list(range(nr_cpus))
    per = max(1, nr_cpus // numa_nodes)
    first = min(node * per, nr_cpus)
    last = nr_cpus if node >= numa_nodes - 1 else min(nr_cpus, first + per)
    return list(range(first, last))


# where a function sits in the link model
ENDPOINT, ROOT_PORT, UPSTREAM, DOWNSTREAM = "endpoint", "root", "upstream", "downstream"


def port_kinds(topology: Topology) -> dict[str, str]:
    """Function name -> endpoint | root | upstream | downstream.

    GPUs are endpoints; a bridge without a parent is a root port; below a root or
    downstream port sits an upstream port, below an upstream port downstream ports.
    """
    kinds: dict[str, str] = {}
    gpus = topology.endpoints()

    def kind(name: str) -> str:
        if name in kinds:
            return kinds[name]
        fn = topology.functions[name]
        if name in gpus:
            k = ENDPOINT
        elif fn.parent is None:
            k = ROOT_PORT
        elif kind(fn.parent) == UPSTREAM:
            k = DOWNSTREAM
        else:
            k = UPSTREAM
        kinds[name] = k
        return k

    for name in topology.functions:
        kind(name)
    return kinds


class LinkModel:
    """The link rule of this module's docstring for one topology (built once, used per tick)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.kinds = port_kinds(topology)
        children: dict[str, list[str]] = {}
        for fn in topology.functions.values():
            if fn.parent is not None:
                children.setdefault(fn.parent, []).append(fn.name)
        # function -> (lower end of the link it reports, whether it is that lower end);
        # None for a port with nothing below it (it reports what it is set to)
        self._reports: dict[str, tuple[str, bool] | None] = {}
        for name, kind in self.kinds.items():
            if kind in (ENDPOINT, UPSTREAM):
                self._reports[name] = (name, True)
            elif children.get(name):
                self._reports[name] = (children[name][0], False)
            else:
                self._reports[name] = None

    def states(
        self, gpus: list[dict[str, Any]], bridges: Mapping[str, Mapping[str, int]]
    ) -> dict[str, Link]:
        """The current (generation, width) every function reports."""
        functions = self.topology.functions
        gpu_values = dict(zip(self.topology.gpu_names, gpus, strict=True))

        def wanted(name: str) -> tuple[int, int]:
            fn = functions[name]
            values: Mapping[str, Any]
            if name in gpu_values:
                values = gpu_values[name]
                gen, width = values.get("pcie_gen"), values.get("pcie_width")
            else:
                values = bridges.get(name, {})
                gen, width = values.get("gen"), values.get("width")
            gen = fn.max_gen if gen is None else int(round(gen))
            width = fn.max_width if width is None else int(round(width))
            return max(1, min(gen, fn.max_gen)), max(1, min(width, fn.max_width))

        links: dict[str, tuple[Link, Link]] = {}

        def link(lower: str) -> tuple[Link, Link]:
            """(what the lower end reports, what the upper end reports) for lower's uplink."""
            if lower in links:
                return links[lower]
            upper = functions[lower].parent
            if gpu_values.get(lower, {}).get("lost"):
                ends: tuple[Link, Link] = ((None, None), (1, None))
            else:
                gen, width = wanted(lower)
                if upper is not None:
                    ugen, uwidth = wanted(upper)
                    gen, width = min(gen, ugen), min(width, uwidth)
                ends = ((gen, width), (gen, width))
            links[lower] = ends
            return ends

        states: dict[str, Link] = {}
        for name, reports in self._reports.items():
            if reports is None:
                states[name] = wanted(name)
            else:
                lower, is_lower = reports
                states[name] = link(lower)[0 if is_lower else 1]
        return states


def link_states(
    topology: Topology,
    gpus: list[dict[str, Any]],
    bridges: Mapping[str, Mapping[str, int]],
) -> dict[str, Link]:
    """The current (generation, width) every function reports, from `Timeline.state`'s
    values, by the link model in this module's docstring."""
    return LinkModel(topology).states(gpus, bridges)


class SysfsWriter:
    """Writes and updates the sysfs tree of `timeline`'s node under `root`."""

    def __init__(self, root: Path, timeline: Timeline) -> None:
        self.root = Path(root)
        self.timeline = timeline
        self.topology = timeline.topology
        node = timeline.scenario.node
        self._model = node.model()
        self._nr_cpus = node.cpus
        self._numa_nodes = node.numa_nodes
        for fn in self.topology.functions.values():
            if not _BDF.match(fn.bdf) or not _ROOT.match(fn.domain_root):
                raise ValueError(
                    f"simulated PCI function {fn.name} has address {fn.bdf} under "
                    f"{fn.domain_root}: not a valid PCI address (bus numbers stop at ff)"
                )
        self._dirs: dict[str, Path] = {}
        self._links: dict[str, str] = {}  # bus/pci/devices/<bdf> -> relative target
        for name, fn in self.topology.functions.items():
            rel = self.topology.sysfs_path(name)
            self._dirs[name] = self.root / "devices" / rel
            self._links[fn.bdf] = "../../../devices/" + rel
        self._nics = {name: device for device, name in self.topology.nic_names.items()}
        self._link_layers = {p.device: p.link_layer for p in node.host.ib_ports}
        self._links_model = LinkModel(self.topology)
        self._kinds = self._links_model.kinds
        # per function: its dynamic files, as plain strings (cheap to key and open)
        self._dynamic = {
            name: tuple(os.path.join(d, f) for f in DYNAMIC_FILES) for name, d in self._dirs.items()
        }
        self._aer_texts: dict[tuple[int, int], str] = {}
        self.files = Files()
        self._laid_out = False

    @property
    def writes(self) -> int:
        """Files written so far (changed content only)."""
        return self.files.writes

    def device_dir(self, name: str) -> Path:
        """The (resolved) directory of a function, by topology name ("gpu3", "sw1-up")."""
        return self._dirs[name]

    def write(self, t: float) -> int:
        """Bring the tree to the node's state at time t; returns how many files changed."""
        before = self.writes
        if not self._laid_out:
            self._lay_out()
        gpus, bridges = self.timeline.state(t)
        links = self._links_model.states(gpus, bridges)
        gpu_values = dict(zip(self.topology.gpu_names, gpus, strict=True))
        put = self.files.put
        for name, (speed, width_file, *aer_files) in self._dynamic.items():
            gen, width = links[name]
            put(speed, speed_string(gen) + "\n")
            put(width_file, f"{width or 0}\n")
            values = gpu_values.get(name, {})
            for i, path in enumerate(aer_files):
                put(path, self._aer(i, max(0, int(values.get(AER_FILES[i][4]) or 0))))
        return self.writes - before

    def _aer(self, index: int, count: int) -> str:
        text = self._aer_texts.get((index, count))
        if text is None:
            _, names, line, total, _ = AER_FILES[index]
            text = aer_text(names, total, {line: count})
            if count == 0:  # the common case; a rising counter is not worth keeping
                self._aer_texts[(index, count)] = text
        return text

    # -- layout and static attributes -------------------------------------------------

    def _lay_out(self) -> None:
        for name, fn in self.topology.functions.items():
            d = self._dirs[name]
            d.mkdir(parents=True, exist_ok=True)
            for file, content in self._static(fn).items():
                self.files.put(os.path.join(d, file), content)
        links_dir = self.root / "bus" / "pci" / "devices"
        links_dir.mkdir(parents=True, exist_ok=True)
        for bdf, target in self._links.items():
            link = links_dir / bdf
            try:
                if os.readlink(link) == target:
                    continue
            except OSError:
                pass
            tmp = links_dir / f".{bdf}.tmp"
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            os.symlink(target, tmp)
            os.replace(tmp, link)
        node = self.timeline.scenario.node
        for n in range(node.numa_nodes):  # which cores each NUMA node has
            cpus = cpulist(numa_cpus(n, node.cpus, node.numa_nodes))
            path = self.root / "devices/system/node" / f"node{n}" / "cpulist"
            self.files.put(str(path), cpus + "\n")
        self._laid_out = True

    def _static(self, fn: PciFunction) -> dict[str, str]:
        kind = self._kinds[fn.name]
        device_name = self._nics.get(fn.name)
        if device_name is not None:  # a ConnectX-7 (15b3:1021): InfiniBand or Ethernet
            ethernet = self._link_layers[device_name] == "Ethernet"
            vendor, device, driver = MELLANOX_VENDOR, CONNECTX7, "mlx5_core"
            pci_class = ETHERNET_CLASS if ethernet else INFINIBAND_CLASS
        elif kind == ENDPOINT:
            vendor, device, pci_class, driver = (
                NVIDIA_VENDOR,
                self._model.pci_device_id,
                self._model.pci_class,
                "nvidia",
            )
        elif kind == ROOT_PORT:
            (vendor, device), pci_class, driver = ROOT_PORT_ID, BRIDGE_CLASS, "pcieport"
        else:
            ids = SWITCH_ID_GEN5 if fn.max_gen >= 5 else SWITCH_ID
            (vendor, device), pci_class, driver = ids, BRIDGE_CLASS, "pcieport"
        cpus = numa_cpus(fn.numa_node, self._nr_cpus, self._numa_nodes)
        return {
            "vendor": f"0x{vendor:04x}\n",
            "device": f"0x{device:04x}\n",
            "subsystem_vendor": f"0x{vendor:04x}\n",
            "subsystem_device": f"0x{device:04x}\n",
            "class": f"0x{pci_class:06x}\n",
            "max_link_speed": speed_string(fn.max_gen) + "\n",
            "max_link_width": f"{fn.max_width}\n",
            "numa_node": f"{fn.numa_node}\n",
            "local_cpulist": cpulist(cpus) + "\n",
            "local_cpus": cpumask(cpus, self._nr_cpus) + "\n",
            "uevent": (
                f"DRIVER={driver}\nPCI_CLASS={pci_class:X}\nPCI_ID={vendor:04X}:{device:04X}\n"
                f"PCI_SUBSYS_ID={vendor:04X}:{device:04X}\nPCI_SLOT_NAME={fn.bdf}\n"
                f"MODALIAS=pci:v{vendor:08X}d{device:08X}sv{vendor:08X}sd{device:08X}"
                f"bc{pci_class >> 16:02X}sc{(pci_class >> 8) & 0xFF:02X}i{pci_class & 0xFF:02X}\n"
            ),
        }


__all__ = [
    "SPEED_STRINGS",
    "LinkModel",
    "SysfsWriter",
    "aer_text",
    "cpulist",
    "cpumask",
    "link_states",
    "numa_cpus",
    "port_kinds",
    "speed_string",
]
