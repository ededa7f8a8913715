"""InfiniBand and RoCE ports: state, rate against the port's best, traffic, waits, errors.

Read from `<sysfs>/class/infiniband/<device>/ports/<port>/` (`context.sysfs`), in the
formats of drivers/infiniband/core/sysfs.c:

    state        "4: ACTIVE"               (0 NOP, 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE,
                                            5 ACTIVE_DEFER)
    phys_state   "5: LinkUp"               (1 Sleep, 2 Polling, 3 Disabled,
                                            4 PortConfigurationTraining, 5 LinkUp,
                                            6 LinkErrorRecovery, 7 Phy Test; 0 "<unknown>",
                                            which Hyper-V's IPoIB reports for an active port)
    rate         "400 Gb/sec (4X NDR)"     ("10 Gb/sec (4X)" before kernels named SDR,
                                            "2.5 Gb/sec (1X SDR)")
    link_layer   "InfiniBand" | "Ethernet" (RoCE)
    counters/*   PMA counters, "%u" / "%llu", or "N/A (no PMA)" (iWARP devices)
    counters_ext/*_64  mlx4's 64-bit data counters

and, per device, `hca_type` and `fw_ver` (for the info series). Files may lack the
trailing newline (as in gpud's captured tree); whitespace around a value is ignored.

Data: `port_rcv_data` / `port_xmit_data` count 4-byte words (×4 for bytes). The 64-bit
`counters_ext/port_*_data_64` is used where it exists; otherwise `counters/port_*_data`,
which the kernel fills from PortCountersExtended (64 bits) when the HCA has it and
from PortCounters (32 bits) when not. IB PMA counters saturate instead of wrapping, so a
value of exactly 2^32 - 1 in a counter that may be 32 bits wide (`counters/*`) is
saturated: it gives no rate until someone clears it. A counter that goes down was
cleared (perfquery -R, a driver reload): that interval gives no rate for it.

Transmit wait: `port_xmit_wait` counts ticks during which the port had data to send
but sent nothing (no credits or no arbitration). A tick is implementation defined;
NVIDIA's ibdiagnet manual ("Congestion Assessment on InfiniBand Links") gives its
switches as one tick per 8 bytes of port time, i.e. lost bytes = ticks × 8. So

    transmit_wait_ratio = Δticks × xmit_wait_bytes_per_tick / (rate_bits / 8 × Δt)

capped at 1, with `xmit_wait_bytes_per_tick` configurable (default 8). The raw
`transmit_wait_ticks_per_second` is exported too, independent of that assumption.

Best rate: sysfs shows only the active rate, not what the HCA, the cable and the peer
could do (LinkWidthSupported / LinkSpeedSupported need MADs and root), and a device id
does not fix a port's rate either (ConnectX SKUs sharing an id ship at different
speeds). So the best rate of a port is the `expected_rates` entry that matches
"<device>/<port>" (fnmatch patterns, e.g. {"mlx5_*/1": 400}, in Gb/s) when one does,
else the highest rate the port has reported while ACTIVE since the source started;
never below the current rate. A port already degraded when the daemon starts is seen
only with `expected_rates`.

Which ports serve which GPU: NCCL sends a GPU's traffic through the RDMA ports nearest it
on PCIe, so errors and congestion are judged on those. The kernel shows where an HCA
sits: `class/infiniband/<device>/device` links to its PCI function, whose path names
the bridges above it, the root complex (`pci0000:30`) and `numa_node`; the GPUs' are
under `bus/pci/devices` (as the pcie source finds them). A port's distance to a GPU is
0 when they share a PCIe bridge (a switch: NCCL's PIX/PXB), 1 the same root complex
(PHB), 2 the same NUMA node (NODE), 3 otherwise (SYS); each GPU is served by the ports
at its smallest distance (`ib_port_gpu_distance`, one series per GPU and such port).
An HCA without a PCI function (soft-RoCE) serves no GPU; where no port has one, the
rules read every port.

A device or port directory that vanishes drops its series; a missing or garbled file
drops only the series it feeds and is logged once (until it parses again). Only a
missing `<sysfs>/class` fails the poll (sysfs not mounted there); no
`class/infiniband` directory means no RDMA devices: no series.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from gpuwatchd.config import InfinibandConfig, SourceConfig
from gpuwatchd.metrics import Sample, counter, gauge
from gpuwatchd.sources import register
from gpuwatchd.sources.base import (
    Context,
    Source,
    SourceError,
    not_mounted,
    read_small,
    settings_of,
)
from gpuwatchd.sources.pcie import BDF, GpuPaths, PciFunction, parse_numa_node, walk_to_root

log = logging.getLogger(__name__)

U32_MAX = (1 << 32) - 1
U64 = 1 << 64
DEFAULT_XMIT_WAIT_BYTES_PER_TICK = InfinibandConfig().xmit_wait_bytes_per_tick

PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATES = {
    0: "<unknown>",
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "Phy Test",
}
ACTIVE_STATES = frozenset({4, 5})
LINK_UP = 5
# per-lane rate in Gb/s by the speed name rate_show prints ("" for SDR on older kernels)
LANE_GBPS = {
    "SDR": 2.5,
    "": 2.5,
    "DDR": 5.0,
    "QDR": 10.0,
    "FDR10": 10.0,
    "FDR": 14.0,
    "EDR": 25.0,
    "HDR": 50.0,
    "NDR": 100.0,
    "XDR": 200.0,
}
WIDTHS = (1, 2, 4, 8, 12)

# PMA error counters (name, width in bits) as drivers/infiniband/core/sysfs.c defines them
ERROR_COUNTERS = (
    ("symbol_error", 16),
    ("link_error_recovery", 8),
    ("link_downed", 8),
    ("port_rcv_errors", 16),
    ("port_rcv_remote_physical_errors", 16),
    ("port_rcv_switch_relay_errors", 16),
    ("port_xmit_discards", 16),
    ("port_xmit_constraint_errors", 8),
    ("port_rcv_constraint_errors", 8),
    ("local_link_integrity_errors", 4),
    ("excessive_buffer_overrun_errors", 4),
    ("VL15_dropped", 16),
)
ERROR_COUNTER_NAMES = tuple(name for name, _ in ERROR_COUNTERS)
# rate counters: key -> (64-bit counters_ext file, counters file, multiplier to base units)
RATE_COUNTERS = {
    "rcv_bytes": ("port_rcv_data_64", "port_rcv_data", 4),
    "xmit_bytes": ("port_xmit_data_64", "port_xmit_data", 4),
    "xmit_wait": (None, "port_xmit_wait", 1),
}

_STATE = re.compile(r"([0-9]{1,3})(?::[ \t]*([^\n]{0,64}))?")
_RATE = re.compile(
    r"([0-9]{1,5}(?:\.[0-9]{1,3})?) Gb/sec(?: \(([0-9]{1,2})X(?: ?([A-Z0-9]{1,8}))?\))?"
)
_COUNTER = re.compile(r"[0-9]{1,20}")


# -- parsers (pure; None for anything unexpected) ----------------------------------------


def parse_state(text: str) -> int | None:
    """A `state` or `phys_state` file ("4: ACTIVE", "0: <unknown>") -> its number."""
    match = _STATE.fullmatch(text.strip())
    return None if match is None else int(match.group(1))


class IbRate(NamedTuple):
    gbps: float
    width: int | None  # lanes (1X, 4X, ...); None when the file does not say
    speed: str | None  # "NDR", "" (SDR on old kernels); None when the file does not say

    @property
    def bits_per_second(self) -> float:
        return self.gbps * 1e9


def parse_rate(text: str) -> IbRate | None:
    """A `rate` file ("400 Gb/sec (4X NDR)", "10 Gb/sec (4X)", "2.5 Gb/sec (1X SDR)")."""
    match = _RATE.fullmatch(text.strip())
    if match is None:
        return None
    gbps = float(match.group(1))
    width = int(match.group(2)) if match.group(2) else None
    if width is not None and width not in WIDTHS:
        return None
    speed = match.group(3) if match.group(3) is not None else ("" if width else None)
    return IbRate(gbps, width, speed)


def parse_counter(text: str) -> int | None:
    """A PMA counter file ("4631917", "N/A (no PMA)") -> its value; None if not a count."""
    match = _COUNTER.fullmatch(text.strip())
    if match is None:
        return None
    value = int(match.group(0))
    return value if value < U64 else None


def parse_link_layer(text: str) -> str | None:
    value = text.strip()
    return value if value in ("InfiniBand", "Ethernet", "Unknown") else None


def parse_label(text: str) -> str | None:
    """`hca_type`, `fw_ver`: a short printable token, else None."""
    value = text.strip()
    if 0 < len(value) <= 64 and value.isascii() and value.isprintable():
        return value
    return None


def counter_rate(prev: int, cur: int, seconds: float, may_be_32bit: bool) -> float | None:
    """Per-second increase; None when the counter went down (cleared), is saturated at
    2^32 - 1 (when it may be a 32-bit PMA counter), or no time passed."""
    if not seconds > 0 or cur < prev:
        return None
    if may_be_32bit and cur == U32_MAX:
        return None
    return (cur - prev) / seconds


# -- reading ----------------------------------------------------------------------------


def _read(path: str) -> str | None:
    """A small sysfs file's text, None if it cannot be read (os.open: 3x cheaper than open)."""
    try:
        return read_small(path, 4096).decode("ascii", "replace")
    except (OSError, ValueError):
        return None


@dataclass
class PortReading:
    """One port's files this poll; None where a file was missing or garbled."""

    state: int | None = None
    phys_state: int | None = None
    rate: IbRate | None = None
    link_layer: str | None = None
    # RATE_COUNTERS key -> (value, may be a saturating 32-bit counter)
    rate_counters: dict[str, tuple[int, bool]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # ERROR_COUNTERS name -> value
    garbled: list[str] = field(default_factory=list)  # files present but not parseable
    missing_counter: bool = False  # a counter file listed before could not be read


class _PortFiles:
    """Paths of one port's files, worked out once (which counters exist, 64-bit or not)."""

    def __init__(self, port_dir: str) -> None:
        self.dir = port_dir
        self.state = os.path.join(port_dir, "state")
        self.phys_state = os.path.join(port_dir, "phys_state")
        self.rate = os.path.join(port_dir, "rate")
        self.link_layer = os.path.join(port_dir, "link_layer")
        self.link_layer_value: str | None = None
        counters = os.path.join(port_dir, "counters")
        ext = os.path.join(port_dir, "counters_ext")
        present = _listdir(counters)
        present_ext = _listdir(ext)
        self.rate_counters: list[tuple[str, str, bool]] = []  # (key, path, may be 32-bit)
        for key, (ext_name, name, _) in RATE_COUNTERS.items():
            if ext_name is not None and ext_name in present_ext:
                self.rate_counters.append((key, os.path.join(ext, ext_name), False))
            elif name in present:
                self.rate_counters.append((key, os.path.join(counters, name), True))
        self.errors = [
            (name, os.path.join(counters, name)) for name in ERROR_COUNTER_NAMES if name in present
        ]

    @property
    def has_counters(self) -> bool:
        return bool(self.rate_counters or self.errors)


def _listdir(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def read_port(files: _PortFiles) -> PortReading:
    reading = PortReading()

    def get(path: str, parse: Callable[[str], object], counter: bool = False) -> object:
        text = _read(path)
        if text is None:
            reading.missing_counter = reading.missing_counter or counter
            return None
        value = parse(text)
        if value is None and "N/A" not in text:
            reading.garbled.append(path)
        return value

    reading.state = get(files.state, parse_state)  # type: ignore[assignment]
    reading.phys_state = get(files.phys_state, parse_state)  # type: ignore[assignment]
    reading.rate = get(files.rate, parse_rate)  # type: ignore[assignment]
    if files.link_layer_value is None:  # it does not change: read until it parses
        files.link_layer_value = get(files.link_layer, parse_link_layer)  # type: ignore[assignment]
    reading.link_layer = files.link_layer_value
    for key, path, may_be_32bit in files.rate_counters:
        value = get(path, parse_counter, counter=True)
        if isinstance(value, int):
            reading.rate_counters[key] = (value, may_be_32bit and value <= U32_MAX)
    for name, path in files.errors:
        value = get(path, parse_counter, counter=True)
        if isinstance(value, int):
            reading.errors[name] = value
    return reading


# -- the source -------------------------------------------------------------------------

_LABELS = ("device", "port")


@dataclass
class _PortState:
    files: _PortFiles
    last_time: float | None = None
    last_counters: dict[str, tuple[int, bool]] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)  # last computed, per RATE_COUNTERS key
    needs_listing: bool = False


@register
class InfinibandSource(Source):
    name = "infiniband"
    metrics = (
        gauge(
            "ib_port_info",
            "1 per InfiniBand/RoCE port, with its link layer, HCA type and firmware.",
            ("device", "port", "link_layer", "hca_type", "fw_ver"),
        ),
        gauge(
            "ib_port_state",
            "Logical port state: 0 NOP, 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.",
            _LABELS,
        ),
        gauge(
            "ib_port_active",
            "1 if the port is ACTIVE (or ACTIVE_DEFER), else 0.",
            _LABELS,
            export="detail",
        ),
        gauge(
            "ib_port_physical_state",
            "Physical port state: 1 Sleep, 2 Polling, 3 Disabled, 4 PortConfigurationTraining, "
            "5 LinkUp, 6 LinkErrorRecovery, 7 Phy Test, 0 unknown.",
            _LABELS,
            export="detail",
        ),
        gauge(
            "ib_port_physical_up",
            "1 if the physical link is up (LinkUp), else 0; absent when the state is unknown.",
            _LABELS,
            export="detail",
        ),
        gauge("ib_port_rate_bits_per_second", "Current (active) port rate.", _LABELS),
        gauge(
            "ib_port_rate_max_bits_per_second",
            "Best rate of the port: the configured expected rate, else the highest seen "
            "while active since start.",
            _LABELS,
        ),
        gauge(
            "ib_port_rate_degraded",
            "1 if the active port runs below its best rate, else 0.",
            _LABELS,
            export="nonzero",
        ),
        gauge("ib_port_receive_bytes_per_second", "Bytes received per second.", _LABELS),
        gauge("ib_port_transmit_bytes_per_second", "Bytes transmitted per second.", _LABELS),
        gauge(
            "ib_port_transmit_wait_ticks_per_second",
            "port_xmit_wait ticks per second: ticks with data to send but none sent.",
            _LABELS,
            export="detail",
        ),
        gauge(
            "ib_port_transmit_wait_ratio",
            "Share of the port's time spent waiting to transmit (xmit_wait ticks x "
            "bytes per tick / bytes the rate allows), capped at 1.",
            _LABELS,
        ),
        counter(
            "ib_port_errors_total",
            "PMA error counters of the port (saturating, as the hardware keeps them).",
            ("device", "port", "counter"),
            export="nonzero",
        ),
        gauge(
            "ib_port_gpu_distance",
            "PCIe distance from a GPU to each port nearest it (the ports its NCCL traffic "
            "takes): 0 the same PCIe switch, 1 the same root complex, 2 the same NUMA "
            "node, 3 another NUMA node.",
            ("gpu_bus_id", "device", "port"),
            export="detail",
        ),
    )

    def __init__(self, config: SourceConfig, context: Context) -> None:
        super().__init__(config, context)
        cfg = settings_of(config, InfinibandConfig)
        self._include = re.compile(cfg.include) if cfg.include else None
        self._exclude = re.compile(cfg.exclude) if cfg.exclude else None
        self._expected = list(cfg.expected_rates.items())
        self._bytes_per_tick = cfg.xmit_wait_bytes_per_tick
        self.class_dir = os.path.join(os.fspath(context.sysfs), "class")
        self.ib_dir = os.path.join(self.class_dir, "infiniband")
        self._clock: Callable[[], float] = context.extras.get("clock", time.monotonic)
        self._ports: dict[tuple[str, str], _PortState] = {}
        self._best: dict[tuple[str, str], float] = {}  # highest Gb/s seen while active
        self._device_info: dict[str, tuple[str, str]] = {}  # device -> (hca_type, fw_ver)
        self._garbled: set[str] = set()  # files already logged as garbled
        self._gpus = GpuPaths(os.path.join(os.fspath(context.sysfs), "bus", "pci", "devices"))
        self._places: dict[str, Place | None] = {}  # device or GPU path -> where it sits

    def collect(self) -> list[Sample]:
        now = self._clock()
        try:
            devices = sorted(os.listdir(self.ib_dir))
        except FileNotFoundError as e:
            if os.path.isdir(self.class_dir):
                self._ports.clear()
                return []  # no RDMA device on this node
            raise not_mounted(self.class_dir, "sysfs", self.context.sysfs) from e
        except OSError as e:
            raise SourceError(f"cannot list {self.ib_dir}: {e.strerror or e}") from e

        samples: list[Sample] = []
        seen: set[tuple[str, str]] = set()
        garbled: set[str] = set()
        for device in devices:
            if not self._wanted(device):
                continue
            device_dir = os.path.join(self.ib_dir, device)
            try:
                ports = sorted(os.listdir(os.path.join(device_dir, "ports")), key=_port_order)
            except OSError:
                self._device_info.pop(device, None)
                continue
            info = self._device_info.get(device)
            if info is None or not all(info):  # read until both are there
                info = self._device_info[device] = (
                    parse_label(_read(os.path.join(device_dir, "hca_type")) or "") or "",
                    parse_label(_read(os.path.join(device_dir, "fw_ver")) or "") or "",
                )
            for port in ports:
                key = (device, port)
                state = self._ports.get(key)
                if state is None:
                    state = self._ports[key] = _PortState(
                        _PortFiles(os.path.join(device_dir, "ports", port))
                    )
                elif not state.files.has_counters or state.needs_listing:
                    # counters that were not there may have appeared (driver still
                    # loading), or a listed one went away: list the port again
                    state.files = _PortFiles(state.files.dir)
                    state.needs_listing = False
                reading = read_port(state.files)
                if reading.state is None and not os.path.isdir(state.files.dir):
                    continue  # vanished between the listing and the read
                state.needs_listing = reading.missing_counter
                seen.add(key)
                garbled.update(reading.garbled)
                self._samples(samples, key, info, state, reading, now)
        for gone in [key for key in self._ports if key not in seen]:
            del self._ports[gone]
        for device in [d for d in self._device_info if d not in devices]:
            del self._device_info[device]
            self._places.pop(f"{self.ib_dir}/{device}/device", None)
        self._log_garbled(garbled)
        samples += self._affinity(sorted(seen))
        return samples

    def _affinity(self, ports: list[tuple[str, str]]) -> list[Sample]:
        """`ib_port_gpu_distance` for every GPU and the ports nearest it."""
        placed = [(key, self._place(f"{self.ib_dir}/{key[0]}/device")) for key in ports]
        nics = [(key, place) for key, place in placed if place is not None]
        if not nics:
            return []
        try:
            if self._gpus.refresh(os.listdir(self._gpus.devices_dir)):
                self._places.clear()  # a function left the bus: look at every place anew
        except OSError:
            return []
        samples = []
        for path in self._gpus.paths():
            gpu = self._place(path[0].path, path)
            if gpu is None:
                continue
            distances = [(gpu.distance(place), key) for key, place in nics]
            nearest = min(d for d, _ in distances)
            samples += [
                Sample("gpuwatchd_ib_port_gpu_distance", (path[0].bdf, *key), float(d))
                for d, key in distances
                if d == nearest
            ]
        return samples

    def _place(self, link: str, path: tuple[PciFunction, ...] | None = None) -> Place | None:
        """Where the PCI function at `link` sits (cached); None where it is no PCI
        function (a soft-RoCE device) or cannot be read."""
        if link in self._places:
            return self._places[link]
        if len(self._places) >= 1024:
            self._places.clear()  # a bound for nodes whose devices churn
        resolved = os.path.realpath(link)
        place = None
        if BDF.fullmatch(os.path.basename(resolved).lower()) and os.path.isdir(resolved):
            path = path or walk_to_root(resolved)
            numa = parse_numa_node(_read(os.path.join(resolved, "numa_node")) or "")
            root = os.path.basename(os.path.dirname(path[-1].path))
            place = Place(frozenset(fn.bdf for fn in path[1:]), root, numa)
        self._places[link] = place
        return place

    def _samples(
        self,
        samples: list[Sample],
        key: tuple[str, str],
        info: tuple[str, str],
        state: _PortState,
        reading: PortReading,
        now: float,
    ) -> None:
        labels = key
        add = samples.append
        add(
            Sample(
                "gpuwatchd_ib_port_info",
                (*key, reading.link_layer or "", info[0], info[1]),
                1.0,
            )
        )
        active: bool | None = None
        if reading.state is not None:
            active = reading.state in ACTIVE_STATES
            add(Sample("gpuwatchd_ib_port_state", labels, float(reading.state)))
            add(Sample("gpuwatchd_ib_port_active", labels, float(active)))
        if reading.phys_state is not None:
            add(Sample("gpuwatchd_ib_port_physical_state", labels, float(reading.phys_state)))
            if reading.phys_state != 0:
                up = reading.phys_state == LINK_UP
                add(Sample("gpuwatchd_ib_port_physical_up", labels, float(up)))

        rate = reading.rate
        if rate is not None:
            add(Sample("gpuwatchd_ib_port_rate_bits_per_second", labels, rate.bits_per_second))
            if active:
                seen = self._best.get(key, 0.0)
                if rate.gbps > seen:
                    if len(self._best) >= 4096 and key not in self._best:
                        self._best.clear()  # a bound for nodes whose device names churn
                    self._best[key] = rate.gbps
        best = self._best_rate(key, rate.gbps if rate is not None and active else 0.0)
        if best is not None:
            add(Sample("gpuwatchd_ib_port_rate_max_bits_per_second", labels, best * 1e9))
            if active and rate is not None:
                add(Sample("gpuwatchd_ib_port_rate_degraded", labels, float(rate.gbps < best)))

        # rates from counter deltas
        counters = reading.rate_counters
        if state.last_time is not None:
            seconds = now - state.last_time
            if seconds > 0:
                state.rates = {}
                for name, (cur, may_be_32bit) in counters.items():
                    previous = state.last_counters.get(name)
                    if previous is None:
                        continue
                    per_second = counter_rate(previous[0], cur, seconds, may_be_32bit)
                    if per_second is not None:
                        state.rates[name] = per_second * RATE_COUNTERS[name][2]
        if state.last_time is None or now > state.last_time:
            state.last_time = now
            state.last_counters = counters
        rates = state.rates
        if "rcv_bytes" in rates:
            add(Sample("gpuwatchd_ib_port_receive_bytes_per_second", labels, rates["rcv_bytes"]))
        if "xmit_bytes" in rates:
            add(Sample("gpuwatchd_ib_port_transmit_bytes_per_second", labels, rates["xmit_bytes"]))
        ticks = rates.get("xmit_wait")
        if ticks is not None:
            add(Sample("gpuwatchd_ib_port_transmit_wait_ticks_per_second", labels, ticks))
            if rate is not None and rate.gbps > 0:
                ratio = ticks * self._bytes_per_tick / (rate.bits_per_second / 8)
                add(Sample("gpuwatchd_ib_port_transmit_wait_ratio", labels, min(1.0, ratio)))
        for name, value in reading.errors.items():
            add(Sample("gpuwatchd_ib_port_errors_total", (*key, name), float(value)))

    def _best_rate(self, key: tuple[str, str], current: float) -> float | None:
        port = f"{key[0]}/{key[1]}"
        for pattern, gbps in self._expected:
            if fnmatch.fnmatchcase(port, pattern):
                return max(gbps, current)
        seen = self._best.get(key)
        return None if seen is None else max(seen, current)

    def _wanted(self, device: str) -> bool:
        if self._include is not None and not self._include.search(device):
            return False
        return not (self._exclude is not None and self._exclude.search(device))

    def _log_garbled(self, garbled: set[str]) -> None:
        for path in sorted(garbled - self._garbled):
            log.warning("source infiniband: %s: unexpected content, its series are left out", path)
        self._garbled = garbled


class Place(NamedTuple):
    """Where a PCI function sits: the bridges above it, its root complex, its NUMA node."""

    bridges: frozenset[str]
    root_complex: str  # "pci0000:30"
    numa_node: int | None  # None or -1: unknown

    def distance(self, other: Place) -> int:
        """0 a shared PCIe bridge, 1 the same root complex, 2 the same NUMA node, 3 else."""
        if self.bridges & other.bridges:
            return 0
        if self.root_complex == other.root_complex:
            return 1
        numa = self.numa_node
        return 2 if numa is not None and numa >= 0 and numa == other.numa_node else 3


def _port_order(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() and len(name) < 6 else (1 << 30, name)


__all__ = [
    "ERROR_COUNTERS",
    "IbRate",
    "InfinibandConfig",
    "InfinibandSource",
    "PortReading",
    "counter_rate",
    "parse_counter",
    "parse_label",
    "parse_link_layer",
    "parse_rate",
    "parse_state",
    "read_port",
]
