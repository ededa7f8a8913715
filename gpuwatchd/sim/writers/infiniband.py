"""The simulator's /sys/class/infiniband: the node's IB/RoCE ports in the kernel's formats.

`InfinibandWriter(root, timeline).write(t)` lays out, under `root` (the sysfs root),
for every port of `node.host.ib_ports`, what drivers/infiniband/core/sysfs.c shows:

    class/infiniband/<dev>/{hca_type,fw_ver,board_id,node_type}
    class/infiniband/<dev>/device -> ../../../devices/pci.../<bdf>  (a placed HCA's
                                       PCI function, written by sysfs.py)
    class/infiniband/<dev>/ports/<n>/state        "4: ACTIVE"
    class/infiniband/<dev>/ports/<n>/phys_state   "5: LinkUp"
    class/infiniband/<dev>/ports/<n>/rate         "400 Gb/sec (4X NDR)"
    class/infiniband/<dev>/ports/<n>/link_layer   "InfiniBand" | "Ethernet"
    class/infiniband/<dev>/ports/<n>/counters/*   the PMA counters, "%u\\n" / "%llu\\n"

as an mlx5 HCA on a current kernel has them (ConnectX-7 `MT4129` for a 400 Gb/s port,
ConnectX-6 `MT4123` for 200, ConnectX-5 `MT4119` below, ConnectX-8 `MT4131` from 800):
`counters/port_{rcv,xmit}_{data,packets}` are the 64-bit PortCountersExtended values
(data in 4-byte words), so there is no `counters_ext/` (mlx4 only).

Values come from `timeline.host_state(t)["ib_ports"]["<dev>/<port>"]`:

* `state` (default ACTIVE) and `phys_state` (default LinkUp for ACTIVE, ACTIVE_DEFER,
  ARMED and INIT, Polling for DOWN), printed with their numbers.
* `rate_gbps` (default: the port's best, `IbPort.rate_gbps`) printed as rate_show
  does, "%d%s Gb/sec (%dX%s)" from a lane speed and a width: the best rate keeps 4X
  when it can; a lower rate keeps the best's lane speed (fewer lanes) when it can, else
  its width (a lower speed), else the largest rate not above it. A port whose physical
  link is not up shows "10 Gb/sec (4X SDR)".
* `rx_mb_s`, `tx_mb_s` (10^6 bytes/s) integrate into port_rcv_data / port_xmit_data
  (÷4: words) and port_{rcv,xmit}_packets (4096-byte packets; the unicast_* and
  multicast_* packet counters mlx5 also has are left out: every file that moves is a
  write per tick, and nothing reads those); `xmit_wait_ratio` into
  port_xmit_wait: ratio × (current rate in bytes/s) / `xmit_wait_bytes_per_tick` ticks
  per second, the inverse of the infiniband source's conversion. All three are 0 while
  the port is not ACTIVE.
* `symbol_error_total`, `link_downed_total`, `link_error_recovery_total`,
  `port_rcv_errors_total`, `local_link_integrity_errors_total` and
  `port_xmit_discards_total` are written as they are (ramp them to make them rise),
  saturating at their PMA width (255 for the 8-bit link_downed, 15 for the 4-bit
  local_link_integrity_errors) as the hardware's do.

One deliberate difference from real hardware: port_xmit_wait is a saturating 32-bit
PMA counter, which a congested fast port fills within seconds; here it is written
unsaturated, so congested scenarios stay observable (the source treats a value of
exactly 2^32 - 1 as saturated, which real fixtures exercise).

Only a changed file is written, through a temporary file and `os.replace`.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

from gpuwatchd.sim.counters import Integrator
from gpuwatchd.sim.files import Files
from gpuwatchd.sim.scenario import Timeline
from gpuwatchd.sources.infiniband import DEFAULT_XMIT_WAIT_BYTES_PER_TICK, ERROR_COUNTERS

STATE_NUMBERS = {"DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4, "ACTIVE_DEFER": 5}
PHYS_NUMBERS = {
    "Sleep": 1,
    "Polling": 2,
    "Disabled": 3,
    "PortConfigurationTraining": 4,
    "LinkUp": 5,
    "LinkErrorRecovery": 6,
}
ACTIVE = ("ACTIVE", "ACTIVE_DEFER")
# rate_show's lane speeds in deci-Gb/s, in the kernel's order (FDR10 left out: it prints
# the same rate as QDR)
LANE_DECI = (
    ("SDR", 25),
    ("DDR", 50),
    ("QDR", 100),
    ("FDR", 140),
    ("EDR", 250),
    ("HDR", 500),
    ("NDR", 1000),
    ("XDR", 2000),
)
WIDTHS = (4, 1, 2, 8, 12)  # 4X first: what a port is built for
PACKET_BYTES = 4096
DOWN_RATE = "10 Gb/sec (4X SDR)"
# scenario value -> PMA counter it sets
ERROR_VALUES = {
    "symbol_error_total": "symbol_error",
    "link_downed_total": "link_downed",
    "link_error_recovery_total": "link_error_recovery",
    "port_rcv_errors_total": "port_rcv_errors",
    "local_link_integrity_errors_total": "local_link_integrity_errors",
    "port_xmit_discards_total": "port_xmit_discards",
}
ERROR_KEYS = {counter: key for key, counter in ERROR_VALUES.items()}
ERROR_MAX = {name: (1 << bits) - 1 for name, bits in ERROR_COUNTERS}


def rate_string(deci: int, width: int, speed: str) -> str:
    """rate_show's "%d%s Gb/sec (%dX%s)" for a rate in deci-Gb/s."""
    return f"{deci // 10}{'.5' if deci % 10 else ''} Gb/sec ({width}X {speed})"


def rate_text(gbps: float, best_gbps: float) -> str:
    """The `rate` file for a port running at `gbps` whose best is `best_gbps`."""
    # (width, speed, deci-Gb/s), most likely first: 4X, then narrower; faster lanes first
    combos = sorted(
        ((width, speed, lane * width) for speed, lane in LANE_DECI for width in WIDTHS),
        key=lambda c: (WIDTHS.index(c[0]), -c[2]),
    )
    best_deci = round(best_gbps * 10)
    best = next((c for c in combos if c[2] == best_deci), None)
    if best is None:
        below_best = [c for c in combos if c[2] <= best_deci and c[0] <= 4]
        best = max(below_best, key=lambda c: c[2], default=(4, "SDR", 100))
    # no wider than the best port: 8X/12X only where the best already is
    combos = [c for c in combos if c[0] <= max(4, best[0])]
    deci = round(gbps * 10)
    if deci == best[2]:
        return rate_string(deci, best[0], best[1])
    exact = [c for c in combos if c[2] == deci]
    for pick in (
        [c for c in exact if c[1] == best[1]],  # same lane speed, fewer lanes
        [c for c in exact if c[0] == best[0]],  # same width, slower lanes
        exact,
    ):
        if pick:
            width, speed, _ = pick[0]
            return rate_string(deci, width, speed)
    below = [c for c in combos if c[2] <= deci]
    if not below:
        return rate_string(25, 1, "SDR")
    top = max(c[2] for c in below)
    same_speed = [c for c in below if c[2] == top and c[1] == best[1]]
    width, speed, value = (same_speed or [c for c in below if c[2] == top])[0]
    return rate_string(value, width, speed)


def hca_type(best_gbps: float) -> str:
    if best_gbps >= 800:
        return "MT4131"
    if best_gbps >= 400:
        return "MT4129"
    if best_gbps >= 200:
        return "MT4123"
    return "MT4119"


class InfinibandWriter:
    """Writes and updates `<root>/class/infiniband` for `timeline`'s node."""

    def __init__(
        self,
        root: Path,
        timeline: Timeline,
        *,
        xmit_wait_bytes_per_tick: float = DEFAULT_XMIT_WAIT_BYTES_PER_TICK,
    ) -> None:
        self.root = Path(root)
        self.timeline = timeline
        self.ports = list(timeline.scenario.node.host.ib_ports)
        self._bytes_per_tick = xmit_wait_bytes_per_tick
        self._integrator = Integrator()
        self.files = Files()
        self._dirs = {
            f"{p.device}/{p.port}": os.path.join(
                os.fspath(self.root), "class", "infiniband", p.device, "ports", str(p.port)
            )
            for p in self.ports
        }
        self._laid_out = False

    @property
    def writes(self) -> int:
        """Files written so far (changed content only)."""
        return self.files.writes

    def port_dir(self, key: str) -> str:
        """The directory of a port, by "<device>/<port>"."""
        return self._dirs[key]

    def write(self, t: float) -> int:
        """Bring the tree to the node's state at time t; returns how many files changed."""
        before = self.writes
        if not self._laid_out:
            self._lay_out()
        values: Mapping[str, Mapping[str, Any]] = self.timeline.host_state(t).get("ib_ports") or {}
        states = {}
        rates: dict[Hashable, float] = {}  # (port, rx | tx | wait) -> per second
        for port in self.ports:
            key = f"{port.device}/{port.port}"
            v = values.get(key) or {}
            state = v.get("state") or "ACTIVE"
            phys = v.get("phys_state") or ("Polling" if state == "DOWN" else "LinkUp")
            gbps = v.get("rate_gbps")
            gbps = float(port.rate_gbps if gbps is None else gbps)
            states[key] = (state, phys, gbps, v)
            if state in ACTIVE:
                rx = float(v.get("rx_mb_s") or 0.0) * 1e6
                tx = float(v.get("tx_mb_s") or 0.0) * 1e6
                wait = float(v.get("xmit_wait_ratio") or 0.0)
                rates[(key, "rx")] = rx
                rates[(key, "tx")] = tx
                rates[(key, "wait")] = wait * gbps * 1e9 / 8 / self._bytes_per_tick
        totals = self._integrator.advance(t, rates)
        put = self.files.put
        for port in self.ports:
            key = f"{port.device}/{port.port}"
            d = self._dirs[key]
            state, phys, gbps, v = states[key]
            put(os.path.join(d, "state"), f"{STATE_NUMBERS[state]}: {state}\n")
            put(os.path.join(d, "phys_state"), f"{PHYS_NUMBERS[phys]}: {phys}\n")
            rate = rate_text(gbps, port.rate_gbps) if phys == "LinkUp" else DOWN_RATE
            put(os.path.join(d, "rate"), rate + "\n")
            rx = int(totals.get((key, "rx"), 0.0))
            tx = int(totals.get((key, "tx"), 0.0))
            counts = {
                "port_rcv_data": rx // 4,
                "port_xmit_data": tx // 4,
                "port_rcv_packets": rx // PACKET_BYTES,
                "port_xmit_packets": tx // PACKET_BYTES,
                "port_xmit_wait": int(totals.get((key, "wait"), 0.0)),
            }
            for name, value in counts.items():
                put(os.path.join(d, "counters", name), f"{value}\n")
            for name in ERROR_MAX:
                put(os.path.join(d, "counters", name), f"{self._error(name, v)}\n")
        return self.writes - before

    @staticmethod
    def _error(name: str, values: Mapping[str, Any]) -> int:
        value_key = ERROR_KEYS.get(name)
        total = values.get(value_key) if value_key is not None else None
        return min(ERROR_MAX[name], max(0, int(total or 0)))

    def _lay_out(self) -> None:
        # /sys/class exists on every system; class/infiniband only with RDMA devices
        os.makedirs(os.path.join(os.fspath(self.root), "class"), exist_ok=True)
        devices: dict[str, float] = {}
        for port in self.ports:
            devices[port.device] = max(devices.get(port.device, 0.0), port.rate_gbps)
            d = self._dirs[f"{port.device}/{port.port}"]
            os.makedirs(os.path.join(d, "counters"), exist_ok=True)
            self.files.put(os.path.join(d, "link_layer"), f"{port.link_layer}\n")
        topology = self.timeline.topology
        for device, best in devices.items():
            d = os.path.join(os.fspath(self.root), "class", "infiniband", device)
            function = topology.nic_names.get(device)
            if function is not None:  # where the HCA sits: its PCI function (sysfs.py)
                _symlink(
                    os.path.join(d, "device"), "../../../devices/" + topology.sysfs_path(function)
                )
            for name, content in (
                ("hca_type", f"{hca_type(best)}\n"),
                ("fw_ver", "28.39.1002\n"),
                ("board_id", "MT_0000000838\n"),
                ("node_type", "1: CA\n"),
            ):
                self.files.put(os.path.join(d, name), content)
        self._laid_out = True


def _symlink(link: str, target: str) -> None:
    if os.path.islink(link) and os.readlink(link) == target:
        return
    tmp = link + ".tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


__all__ = ["InfinibandWriter", "hca_type", "rate_string", "rate_text"]
