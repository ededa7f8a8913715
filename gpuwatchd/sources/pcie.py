"""PCIe link state of every NVIDIA GPU and of each bridge above it, read from sysfs.

No root, no lspci, no NVML: only world-readable files under `<sysfs>/bus/pci/devices`
(`context.sysfs`, like node_exporter's --path.sysfs). Every poll lists that directory;
a function is a GPU when its `vendor` is 0x10de and its `class` is 0x03xxxx (VGA or 3D
controller; NVSwitches, 0x0680xx, are not). For a GPU seen for the first time the
symlink is resolved (`../../../devices/pci0000:30/0000:30:01.1/0000:31:00.0/...`) and
the parent directories whose names are PCI addresses are the bridges on its path, up to
the root port; that walk is cached until the GPU leaves the listing.

Per function (the GPU, role "gpu", and each bridge, role "bridge"), per poll:
`current_link_speed`, `max_link_speed` ("16.0 GT/s PCIe", older kernels "8 GT/s" or
"2.5 GT/s", "Unknown" / "Unknown speed"), `current_link_width`, `max_link_width`
("16"; "0" while the link is down), and `aer_dev_{correctable,nonfatal,fatal}` where
the kernel has AER stats (their `TOTAL_ERR_*` lines); per GPU `numa_node` (-1: none).
A bridge shared by several GPUs is read once per poll and reported under each GPU, so
every series can be joined to a GPU by `gpu_bus_id` alone.

A link has two ends and trains to the lower of their capabilities (each end's
`max_link_*` is its own LnkCap), so a link is degraded only below the lower of both
ends' maxima: an x8 card in an x16 slot, a Gen4 GPU under a Gen5 port or a Gen5 GPU in
a Gen4 host are links at their best. The ends pair up along the path: a GPU (endpoint)
and a switch upstream port report the link to the function above them, a downstream or
root port the link to the one below, so the path (GPU, port, upstream port, port, ...,
root port) is links (path[0], path[1]), (path[2], path[3]), ... A function without a
partner on the path (a GPU on the root bus) or whose partner's maximum is unreadable is
judged against its own maximum.

A missing or garbled file drops only the series it feeds; one bad device never fails
the poll. Only a missing `bus/pci/devices` directory fails it (SourceError).

Every poll reads each function's five polled files (a link retrains, an AER total moves
at any time); where they read as at the last poll, the function's reading and samples
are the last poll's, not parsed and made again, and where every file of the poll does
(and every maximum and NUMA node is known) so is the whole poll's list. A listing of
`bus/pci/devices` as the last one, every entry in it told a GPU or not, is not looked
through again.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from gpuwatchd.config import SourceConfig
from gpuwatchd.metrics import Sample, counter, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import (
    Context,
    Source,
    SourceError,
    not_mounted,
    read_each,
    read_small,
)

NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASS = 0x03  # PCI base class: display controller (0x0300 VGA, 0x0302 3D)

# Link speed (GT/s, x10 to compare exactly) -> PCIe generation
_GENERATIONS = {25: 1, 50: 2, 80: 3, 160: 4, 320: 5, 640: 6}
# Link widths the PCIe spec defines; anything else (0: link down, 63: all-ones read of
# a device gone from the bus) is unknown
_WIDTHS = frozenset({1, 2, 4, 8, 12, 16, 32})
_AER_FILES = (
    ("aer_dev_correctable", "TOTAL_ERR_COR", "correctable"),
    ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL", "nonfatal"),
    ("aer_dev_fatal", "TOTAL_ERR_FATAL", "fatal"),
)

_SPEED = re.compile(r"([0-9]{1,3}(?:\.[0-9]{1,3})?) ?GT/s(?: PCIe)?")
_WIDTH = re.compile(r"x?([0-9]{1,3})")
_AER_LINE = re.compile(r"(\S+) ([0-9]{1,20})")
_NUMA = re.compile(r"-?[0-9]{1,6}")
_HEX = re.compile(r"(?:0x)?([0-9a-fA-F]{1,8})")
# domain (4 hex digits, more under Intel VMD), bus, device, function
BDF = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]")


def parse_link_speed(text: str) -> float | None:
    """GT/s from a `*_link_speed` file ("16.0 GT/s PCIe\\n", "8 GT/s"); None if unknown."""
    match = _SPEED.fullmatch(text.strip())
    if match is None:
        return None
    value = float(match.group(1))
    return value if value > 0 and math.isfinite(value) else None


def link_generation(gt_per_s: float | None) -> int | None:
    """PCIe generation of a link speed in GT/s (2.5 -> 1 ... 64 -> 6); None if not one."""
    if gt_per_s is None:
        return None
    return _GENERATIONS.get(round(gt_per_s * 10))


def parse_link_width(text: str) -> int | None:
    """Lanes from a `*_link_width` file ("16\\n"); None for 0 (link down) or garbage."""
    match = _WIDTH.fullmatch(text.strip())
    if match is None:
        return None
    width = int(match.group(1))
    return width if width in _WIDTHS else None


def parse_aer(text: str) -> dict[str, int]:
    """Every "<name> <count>" line of an `aer_dev_*` file ("RxErr 0", "TOTAL_ERR_COR 2").

    Lines that are not a name and a decimal count are skipped; garbage gives {}.
    """
    counts: dict[str, int] = {}
    for line in text.splitlines():
        match = _AER_LINE.fullmatch(line.strip())
        if match is not None:
            counts[match.group(1)] = int(match.group(2))
    return counts


def aer_total(text: str, name: str) -> int | None:
    """`parse_aer(text).get(name)`, parsing only the lines that mention `name` (the
    files have a line per error kind; the poll wants the totals)."""
    for line in reversed(text.splitlines()):
        if name in line:
            match = _AER_LINE.fullmatch(line.strip())
            if match is not None and match.group(1) == name:
                return int(match.group(2))
    return None


def parse_numa_node(text: str) -> int | None:
    """A `numa_node` file: the node, -1 for none (any negative), None if garbled."""
    match = _NUMA.fullmatch(text.strip())
    if match is None:
        return None
    return max(-1, int(match.group(0)))


def parse_hex(text: str) -> int | None:
    """A `vendor` / `device` / `class` file ("0x10de\\n")."""
    match = _HEX.fullmatch(text.strip())
    return None if match is None else int(match.group(1), 16)


def _read(path: str) -> str | None:
    try:
        return read_small(path, 8192).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class PciFunction:
    bdf: str  # lowercase 0000:34:00.0
    path: str  # its resolved directory under <sysfs>/devices
    role: str  # "gpu" | "bridge"


@dataclass
class LinkReading:
    """What one function's files said this poll; None where a file was missing or garbled."""

    speed: float | None = None
    speed_max: float | None = None
    width: int | None = None
    width_max: int | None = None
    aer: dict[str, int] = field(default_factory=dict)  # severity -> TOTAL_ERR_* count
    present: bool = True  # its current_link_speed could be read (not gone from the bus)

    @property
    def generation(self) -> int | None:
        return link_generation(self.speed)

    @property
    def generation_max(self) -> int | None:
        return link_generation(self.speed_max)

    def attainable(self, other: LinkReading | None) -> tuple[int | None, int | None]:
        """(generation, width) the link can train to: the lower of this end's maximum and
        the other end's (`other`, None when unknown); this end's alone where the other's
        cannot be read."""
        gen, width = self.generation_max, self.width_max
        if other is not None:
            other_gen, other_width = other.generation_max, other.width_max
            if gen is not None and other_gen is not None:
                gen = min(gen, other_gen)
            if width is not None and other_width is not None:
                width = min(width, other_width)
        return gen, width

    def degraded(self, other: LinkReading | None = None) -> bool | None:
        """Generation or width below what the link can attain (`attainable`: the lower of
        both ends' maxima); None when that cannot be told."""
        top_gen, top_width = self.attainable(other)
        pairs = ((self.generation, top_gen), (self.width, top_width))
        known = [(cur, top) for cur, top in pairs if cur is not None and top is not None]
        if any(cur < top for cur, top in known):
            return True
        return False if len(known) == len(pairs) else None


# what a poll reads of each function: its link now, then its AER totals
_POLLED_FILES = ("current_link_speed", "current_link_width", *(f for f, _, _ in _AER_FILES))


def read_link(path: str, caps: tuple[float | None, int | None] | None = None) -> LinkReading:
    """One function's link files; `caps`: its (max speed, max width) known already."""
    return link_reading(path, tuple(_read(f"{path}/{name}") for name in _POLLED_FILES), caps)


def link_reading(
    path: str, polled: tuple[str | None, ...], caps: tuple[float | None, int | None] | None
) -> LinkReading:
    """What `read_link` makes of the `_POLLED_FILES`' texts (None: unreadable), reading the
    maxima unless `caps` has them."""
    current, width = polled[0], polled[1]
    if caps is None or current is None:  # not known, or the function is gone: read them
        caps = (
            parse_link_speed(_read(f"{path}/max_link_speed") or ""),
            parse_link_width(_read(f"{path}/max_link_width") or ""),
        )
    reading = LinkReading(
        speed=parse_link_speed(current or ""),
        speed_max=caps[0],
        width=parse_link_width(width or ""),
        width_max=caps[1],
        present=current is not None,
    )
    for content, (_, total, severity) in zip(polled[2:], _AER_FILES, strict=True):
        if content is not None:
            value = aer_total(content, total)
            if value is not None:
                reading.aer[severity] = value
    return reading


_LINK_LABELS = ("gpu_bus_id", "device", "role")


@register
class PcieSource(Source):
    name = "pcie"
    # a function's link detail (8 families x 4 functions a GPU, constant on a healthy
    # node) is the rules' evidence: which function is degraded shows by default, the
    # cause's summary says how
    metrics = (
        gauge(
            "pcie_link_generation",
            "Current PCIe link generation (1-6) of the function.",
            _LINK_LABELS,
            export="detail",
        ),
        gauge(
            "pcie_link_generation_max",
            "Maximum PCIe link generation the function supports.",
            _LINK_LABELS,
            export="detail",
        ),
        gauge(
            "pcie_link_speed_transfers_per_second",
            "Current PCIe link speed, transfers per second per lane.",
            _LINK_LABELS,
            export="detail",
        ),
        gauge(
            "pcie_link_speed_max_transfers_per_second",
            "Maximum PCIe link speed the function supports, transfers per second per lane.",
            _LINK_LABELS,
            export="detail",
        ),
        gauge("pcie_link_width", "Current PCIe link width, lanes.", _LINK_LABELS, export="detail"),
        gauge(
            "pcie_link_width_max",
            "Maximum PCIe link width the function supports, lanes.",
            _LINK_LABELS,
            export="detail",
        ),
        gauge(
            "pcie_link_generation_attainable",
            "Highest PCIe generation the function's link can train to: the lower of the"
            " maxima of its two ends.",
            _LINK_LABELS,
            export="detail",
        ),
        gauge(
            "pcie_link_width_attainable",
            "Widest the function's link can train to, lanes: the lower of the maxima of its"
            " two ends.",
            _LINK_LABELS,
            export="detail",
        ),
        gauge(
            "pcie_link_degraded",
            "1 if the function's link runs below the generation or width it can attain"
            " (the lower of its two ends' maxima).",
            _LINK_LABELS,
            export="nonzero",
            budget=2,
        ),
        counter(
            "pcie_aer_errors_total",
            "PCIe AER errors the function reported (kernel aer_dev_* TOTAL_ERR_*).",
            ("gpu_bus_id", "device", "severity"),
            export="nonzero",
        ),
        gauge(
            "pcie_gpu_numa_node",
            "NUMA node of the GPU's PCIe attachment, -1 for none.",
            ("gpu_bus_id",),
            export="detail",
        ),
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        self.devices_dir = os.path.join(os.fspath(context.sysfs), "bus", "pci", "devices")
        self._gpus = GpuPaths(self.devices_dir)
        # what does not change while a function is on the bus, read once: a function's
        # (max speed, max width), its LnkCap; a GPU's NUMA node
        self._caps: dict[str, tuple[float | None, int | None]] = {}
        self._numa: dict[str, int] = {}
        # most polls find every file as it was: per function, its last files' bytes and
        # the reading made of them; per (GPU, function), its last samples
        self._polled: dict[str, tuple[tuple[bytes | None, ...], LinkReading]] = {}
        self._samples: dict[tuple[str, str], tuple[LinkReading, LinkReading | None, list[Sample]]]
        self._samples = {}
        # for the GPUs' paths as listed: the functions to read, each once, and their files
        self._layout: tuple[object, list[str], list[str]] | None = None
        # the last poll: its files' bytes and its samples, where a poll that reads the same
        # bytes makes the same samples (every function's maxima known, every GPU's NUMA node)
        self._last: tuple[list[bytes | None], list[Sample]] | None = None

    def gpus(self) -> list[tuple[PciFunction, ...]]:
        """The path of every GPU found by the last poll: the GPU first, the root port last."""
        return self._gpus.paths()

    def collect(self) -> list[Sample]:
        try:
            entries = os.listdir(self.devices_dir)
        except FileNotFoundError as e:
            raise not_mounted(self.devices_dir, "sysfs", self.context.sysfs) from e
        except OSError as e:
            raise SourceError(f"cannot list {self.devices_dir}: {e.strerror or e}") from e
        if self._gpus.refresh(entries):  # a function left the bus: read what is back anew
            for known in (self._caps, self._numa, self._polled, self._samples):
                known.clear()
            self._last = None
        gpus = self._gpus.listed()
        layout = self._layout
        if layout is None or layout[0] is not gpus:
            functions = list(dict.fromkeys(fn.path for path in gpus for fn in path))
            files = [f"{fn}/{name}" for fn in functions for name in _POLLED_FILES]
            layout = self._layout = (gpus, functions, files)
            self._last = None
        raw = read_each(layout[2], 8192)
        last = self._last
        if last is not None and last[0] == raw:
            return last[1][:]  # what the same bytes made last time
        samples = self._poll(gpus, layout[1], raw)
        settled = all(path in self._caps for path in layout[1]) and all(
            path[0].path in self._numa for path in gpus
        )
        self._last = (raw, samples[:]) if settled else None
        return samples

    def _poll(
        self,
        gpus: tuple[tuple[PciFunction, ...], ...],
        functions: list[str],
        raw: list[bytes | None],
    ) -> list[Sample]:
        """The samples of the files' `raw` bytes (each function's, in `functions`' order)."""
        width = len(_POLLED_FILES)
        readings = {  # a shared bridge is read once per poll
            fn: self._read_link(fn, tuple(raw[i * width : (i + 1) * width]))
            for i, fn in enumerate(functions)
        }
        samples: list[Sample] = []
        for path in gpus:
            gpu = path[0]
            for i, fn in enumerate(path):
                other = link_partner(path, i)
                partner = None if other is None else readings[other.path]
                reading, key = readings[fn.path], (gpu.bdf, fn.path)
                last = self._samples.get(key)
                if last is None or last[0] is not reading or last[1] is not partner:
                    made: list[Sample] = []
                    self._link_samples(made, gpu.bdf, fn, reading, partner)
                    last = self._samples[key] = (reading, partner, made)
                samples += last[2]
            listed = readings[gpu.path].present or os.path.isdir(gpu.path)  # not gone
            numa = self._numa_node(gpu.path) if listed else None
            if numa is not None:
                samples.append(Sample("gpuwatchd_pcie_gpu_numa_node", (gpu.bdf,), float(numa)))
        return samples

    def _read_link(self, path: str, raw: tuple[bytes | None, ...]) -> LinkReading:
        """The function's link from its polled files' `raw` bytes; its maxima from the
        first poll that read both. The last poll's reading (the same object) where its
        files read the same."""
        caps = self._caps.get(path)
        last = self._polled.get(path)
        if last is not None and last[0] == raw and caps is not None and raw[0] is not None:
            return last[1]
        polled = tuple(None if data is None else data.decode("utf-8", "replace") for data in raw)
        reading = link_reading(path, polled, caps)
        self._polled[path] = (raw, reading)
        if not reading.present:
            self._caps.pop(path, None)
        elif reading.speed_max is not None and reading.width_max is not None:
            self._caps[path] = (reading.speed_max, reading.width_max)
        return reading

    def _numa_node(self, path: str) -> int | None:
        numa = self._numa.get(path)
        if numa is None:
            text = _read(os.path.join(path, "numa_node"))
            numa = None if text is None else parse_numa_node(text)
            if numa is not None:
                self._numa[path] = numa
        return numa

    @staticmethod
    def _link_samples(
        samples: list[Sample],
        gpu_bus_id: str,
        fn: PciFunction,
        reading: LinkReading,
        partner: LinkReading | None,
    ) -> None:
        labels = (gpu_bus_id, fn.bdf, fn.role)
        top_gen, top_width = reading.attainable(partner)
        values = (
            ("gpuwatchd_pcie_link_generation", reading.generation),
            ("gpuwatchd_pcie_link_generation_max", reading.generation_max),
            (
                "gpuwatchd_pcie_link_speed_transfers_per_second",
                None if reading.speed is None else reading.speed * 1e9,
            ),
            (
                "gpuwatchd_pcie_link_speed_max_transfers_per_second",
                None if reading.speed_max is None else reading.speed_max * 1e9,
            ),
            ("gpuwatchd_pcie_link_width", reading.width),
            ("gpuwatchd_pcie_link_width_max", reading.width_max),
            ("gpuwatchd_pcie_link_generation_attainable", top_gen),
            ("gpuwatchd_pcie_link_width_attainable", top_width),
        )
        for metric, value in values:
            if value is not None:
                samples.append(Sample(metric, labels, float(value)))
        degraded = reading.degraded(partner)
        if degraded is not None:
            samples.append(Sample("gpuwatchd_pcie_link_degraded", labels, float(degraded)))
        for severity, count in reading.aer.items():
            samples.append(
                Sample(
                    "gpuwatchd_pcie_aer_errors_total", (gpu_bus_id, fn.bdf, severity), float(count)
                )
            )


class GpuPaths:
    """The NVIDIA GPUs listed in a `bus/pci/devices` directory and the PCIe path of each.

    A function is walked once, when it first appears in the listing, and forgotten when
    it leaves it; a function that is not a GPU is remembered as such."""

    def __init__(self, devices_dir: str) -> None:
        self.devices_dir = devices_dir
        # entry name -> its path (GPU first, root port last), or None: not a GPU
        self._paths: dict[str, tuple[PciFunction, ...] | None] = {}
        # the last listing, where every entry in it was told a GPU or not (None: one was
        # unreadable, to be looked at again): the same listing again has nothing new
        self._listing: list[str] | None = None
        self._listed: tuple[tuple[PciFunction, ...], ...] = ()

    def path(self, name: str) -> tuple[PciFunction, ...] | None:
        return self._paths.get(name)

    def paths(self) -> list[tuple[PciFunction, ...]]:
        return [path for path in self._paths.values() if path is not None]

    def listed(self) -> tuple[tuple[PciFunction, ...], ...]:
        """Every GPU's path in the order of the GPUs' entry names; the same object until
        a GPU comes or goes."""
        return self._listed

    def refresh(self, entries: list[str]) -> bool:
        """Walk the functions new to `entries`; forget the ones that left (True if any)."""
        if entries == self._listing:
            return False
        present = set(entries)
        gone = [name for name in self._paths if name not in present]
        for name in gone:
            del self._paths[name]
        told = True
        for name in entries:
            if name in self._paths:
                continue
            entry = os.path.join(self.devices_dir, name)
            vendor = parse_hex(_read(os.path.join(entry, "vendor")) or "")
            pci_class = parse_hex(_read(os.path.join(entry, "class")) or "")
            if vendor is None or pci_class is None:
                told = False
                continue  # unreadable now: look again next poll
            if vendor != NVIDIA_VENDOR or pci_class >> 16 != DISPLAY_CLASS:
                self._paths[name] = None
                continue
            resolved = os.path.realpath(entry)
            if not os.path.isdir(resolved):
                told = False
                continue
            self._paths[name] = walk_to_root(resolved)
        self._listing = list(entries) if told else None
        listed = tuple(path for _, path in sorted(self._paths.items()) if path is not None)
        if listed != self._listed:
            self._listed = listed
        return bool(gone)


def link_partner(path: tuple[PciFunction, ...], index: int) -> PciFunction | None:
    """The other end of the link `path[index]` reports on: the GPU and its port share a
    link, the port's switch upstream port and the port above it the next, and so on
    (see the module's docstring); None for a function alone at the top of the path."""
    other = index + 1 if index % 2 == 0 else index - 1
    return path[other] if other < len(path) else None


def walk_to_root(resolved: str) -> tuple[PciFunction, ...]:
    """The GPU at `resolved` and every bridge above it whose directory is a PCI address."""
    gpu = PciFunction(os.path.basename(resolved).lower(), resolved, "gpu")
    path = [gpu]
    parent = os.path.dirname(resolved)
    while BDF.fullmatch(os.path.basename(parent).lower()):
        path.append(PciFunction(os.path.basename(parent).lower(), parent, "bridge"))
        parent = os.path.dirname(parent)
    return tuple(path)


__all__ = [
    "BDF",
    "GpuPaths",
    "aer_total",
    "LinkReading",
    "PciFunction",
    "PcieSource",
    "link_generation",
    "link_partner",
    "parse_aer",
    "parse_hex",
    "parse_link_speed",
    "parse_link_width",
    "parse_numa_node",
    "read_link",
    "walk_to_root",
]
