"""Soak: 24 simulated hours at 1 s evaluation on 8 GPUs, resources sampled every hour.

Run by hand: `python bench/soak.py [--hours 24] [--tracemalloc 0|N]`. Prints Markdown;
the result is recorded in docs/soak.md. Not a test: the numbers depend on the machine.

The real pipeline runs in virtual time, as `gpuwatchd simulate` runs it (sources on their
own intervals, store, rules engine), plus what `run` adds each cycle: the stuck-poll and
staleness check and the exposition render; the real web front (h11 on asyncio, in this process)
is scraped over loopback every 15 simulated seconds (`/metrics`, `/healthz`) and the
status page every 5 minutes, as Prometheus and a curious operator would.

The scenario is not a flat one: every simulated hour a new 8-rank job starts with new
pids (each rank with 4 DataLoader workers and an in-process probe), trains, meets a
fault (GPU lost, DCGM host engine stopped, a disk unplugged, an IB port down, Xid with
NVLinks down, thermal throttling; one per hour in turn), checkpoints, and exits; the
GPUs idle until the next job. Per-pid state is where leaks hide: 24 jobs leave 192
ranks and 768 workers behind them, none of which may still cost memory.

Every simulated hour: RSS (VmRSS), open fds, threads (both from /proc/self), live
Python objects, the store's series and history points, and with --tracemalloc the
traced heap and its largest growth by line since hour 1 (tracemalloc slows the replay
about twofold and costs memory of its own: RSS is measured without it by default).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import http.client
import os
import platform
import re
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.web import MetricsServer

HOUR = 3600
GPUS = 8
WORKERS = 4
SCRAPE_EVERY = 15  # simulated seconds, Prometheus' default scrape interval
PAGE_EVERY = 300

TRAINING: dict[str, Any] = dict(
    pstate=0,
    clock_event_reasons=[],
    utilization_gpu=95,
    utilization_memory=42,
    memory_used_mib=71680,
    power_w=335,
    temperature_c=62,
    sm_clock_mhz=1410,
    pcie_tx_mb_s=1800,
    pcie_rx_mb_s=9500,
    gr_engine_active=0.93,
    sm_active=0.8,
    sm_occupancy=0.45,
    tensor_active=0.45,
    dram_active=0.5,
    nvlink_tx_mb_s=42000,
    nvlink_rx_mb_s=42000,
    nvlink_down=[],
    lost=False,
)
IDLE: dict[str, Any] = dict(
    TRAINING,
    pstate=8,
    clock_event_reasons=["gpu_idle"],
    utilization_gpu=0,
    utilization_memory=0,
    memory_used_mib=0,
    power_w=60,
    temperature_c=35,
    sm_clock_mhz=210,
    pcie_tx_mb_s=0,
    pcie_rx_mb_s=0,
    gr_engine_active=0.0,
    sm_active=0.0,
    sm_occupancy=0.0,
    tensor_active=0.0,
    dram_active=0.0,
    nvlink_tx_mb_s=0,
    nvlink_rx_mb_s=0,
    processes=[],
)
HOST_OK: dict[str, Any] = dict(
    dcgm_hostengine_up=True,
    cpu_busy_percent=30,
    disks={"nvme1n1": {"present": True, "write_mb_s": 5}},
    ib_ports={"mlx5_0/1": {"state": "ACTIVE", "phys_state": "LinkUp", "rx_mb_s": 20000}},
)


def fault(hour: int, gpus: int = GPUS) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """The fault of this hour: (name, host values, GPU changes), one kind per hour in turn."""
    gpu = hour % gpus
    kinds: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
        ("gpu-lost", {}, [{"gpus": [gpu], "set": {"lost": True}}]),
        ("dcgm-stopped", {"dcgm_hostengine_up": False}, []),
        ("disk-unplugged", {"disks": {"nvme1n1": {"present": False}}}, []),
        ("ib-down", {"ib_ports": {"mlx5_0/1": {"state": "DOWN", "phys_state": "Polling"}}}, []),
        ("xid-nvlink", {}, [{"gpus": [gpu], "set": {"xid": [74], "nvlink_down": [0, 1]}}]),
        (
            "throttled",
            {},
            [{"gpus": [gpu], "set": {"clock_event_reasons": ["hw_thermal_slowdown"]}}],
        ),
    ]
    return kinds[hour % len(kinds)]


def job_pid(hour: int, rank: int) -> int:
    return 20_000 + 16 * hour + rank  # new pids every job, as a restart gets


def soak_scenario(hours: int, gpus: int = GPUS, cycle: int = HOUR) -> Scenario:
    """`hours` jobs on `gpus` GPUs, one every `cycle` seconds (a shorter cycle churns
    faster: bench/soak.py --cycle 600 to look for a leak in less time)."""
    phases: list[dict[str, Any]] = []
    train, faulty, checkpoint, exited = (cycle * 40 // 60, cycle // 6, cycle // 12, cycle // 12)
    for h in range(hours):
        ranks = [job_pid(h, r) for r in range(gpus)]
        per_gpu = [
            {"gpus": [g], "set": {"processes": [{"pid": pid, "gpu_memory_mib": 71680}]}}
            for g, pid in enumerate(ranks)
        ]
        running = {
            pid: {"running": True, "workers": WORKERS, "worker_cpu_percent": 40} for pid in ranks
        }
        probing = {pid: {"reporting": True, "cuda_device": g} for g, pid in enumerate(ranks)}
        name, host, changes = fault(h, gpus)
        phases += [
            {
                "name": f"h{h:02d}-train",
                "duration": train,
                "set": TRAINING,
                "changes": per_gpu,
                "host": {**HOST_OK, "processes": running, "probe": probing},
            },
            {
                "name": f"h{h:02d}-{name}",
                "duration": faulty,
                "set": TRAINING,
                "changes": per_gpu + changes,
                "host": {**HOST_OK, **host},
            },
            {
                "name": f"h{h:02d}-checkpoint",
                "duration": checkpoint,
                "set": dict(TRAINING, utilization_gpu=20, sm_active=0.1, tensor_active=0.0),
                "changes": per_gpu,
                "host": {**HOST_OK, "disks": {"nvme1n1": {"present": True, "write_mb_s": 3000}}},
            },
            {
                "name": f"h{h:02d}-exited",
                "duration": exited,
                "set": IDLE,
                "host": {
                    **HOST_OK,
                    "processes": {pid: {"running": False} for pid in ranks},
                    "probe": {pid: {"reporting": False} for pid in ranks},
                },
            },
        ]
    node = {
        "hostname": "sim-soak",
        "gpu_count": gpus,
        "pcie_topology": "switched",
        "cpus": 128,
        "numa_nodes": 2,
        "host": {
            "disks": [{"name": "nvme0n1"}, {"name": "nvme1n1"}],
            "nics": [{"name": "mlx5_0", "bus_id": "0000:1a:00.0"}],
            "ib_ports": [{"device": "mlx5_0", "port": 1}],
        },
    }
    return Scenario.model_validate({"name": "soak", "node": node, "phases": phases})


# -- sampling ------------------------------------------------------------------------------


def proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


@dataclass
class Sample:
    hour: int
    wall: float  # seconds of wall time since the replay started
    rss_kib: int
    fds: int
    threads: int
    objects: int
    series: int
    points: int
    traced_kib: int | None
    top: str


def history_points(sim: Simulation) -> int:
    store = sim.pipeline.store
    with store._lock:  # a benchmark may look inside
        return sum(len(s.history) for s in store._series.values() if s.history is not None)


class Scraper:
    """Prometheus' side: one keep-alive connection, as a scraper holds one."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.connection = http.client.HTTPConnection(*address, timeout=10)
        self.failures = 0
        self.scrapes = 0
        self.bytes = 0

    def get(self, path: str) -> bytes:
        self.connection.request("GET", path)
        response = self.connection.getresponse()
        body = response.read()
        self.scrapes += 1
        if response.status != 200:
            self.failures += 1
        return body


class Churn:
    """Series the exposition shows for the first time, by family, per job cycle: what
    each job start, fault and its end cost a Prometheus in new series (issue 24)."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.new: Counter[str] = Counter()
        self.cycles: list[Counter[str]] = []

    def scrape(self, body: bytes) -> None:
        for line in body.split(b"\n"):
            if line and not line.startswith(b"#"):
                series = line.rpartition(b" ")[0]
                if series not in self.seen:
                    self.seen.add(series)
                    self.new[series.partition(b"{")[0].decode()] += 1

    def end_cycle(self) -> None:
        self.cycles.append(self.new)
        self.new = Counter()

    def report(self, gpus: int) -> list[str]:
        steady = self.cycles[1:]  # the first cycle creates the node's series
        if not steady:
            return []
        total: Counter[str] = sum(steady, Counter())
        per_cycle = sum(total.values()) / len(steady)
        top = ", ".join(f"{name.removeprefix('gpuwatchd_')} {n / len(steady):.1f}"
                        for name, n in total.most_common(8))  # fmt: skip
        return [
            f"- series churn: {per_cycle:.1f} new series per job cycle after the first "
            f"({per_cycle / gpus:.2f} per GPU; a job start, a fault and its end each cycle); "
            f"by family, per cycle: {top}"
        ]


TELLING = re.compile(
    rb"^gpuwatchd_(source_up|gpu_lost|dcgm_state|starvation_active|ib_port_state)"
    rb"\{([^}]*)\} (\S+)$",
    re.M,
)


def telling(metrics: bytes) -> str:
    """What the exposition says that is not the usual: sources down, GPUs lost, DCGM's
    state, causes firing."""
    said = []
    for name, labels, value in TELLING.findall(metrics):
        n, lab, v = name.decode(), labels.decode(), float(value)
        if n == "source_up" and v == 0 or n == "ib_port_state" and v != 4:  # 4: ACTIVE
            said.append(f"{n}{{{lab}}} {v:g}")
        elif n in ("gpu_lost", "starvation_active") and v == 1:
            short = ",".join(x for x in lab.split(",") if not x.startswith(("uuid=", "severity=")))
            said.append(f"{n}{{{short}}} 1")
        elif n == "dcgm_state" and v == 1 and 'state="connected"' not in lab:
            said.append(f"dcgm_state{{{lab}}} 1")
    return "; ".join(said) or "nothing unusual"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=int, default=24, help="jobs (one per --cycle)")
    parser.add_argument("--gpus", type=int, default=GPUS)
    parser.add_argument(
        "--cycle", type=int, default=HOUR, help="seconds per job, and between samples"
    )
    parser.add_argument(
        "--types",
        action="store_true",
        help="at the end: growth of live objects by type since the second sample, and the "
        "size of every container the sources and the rules engine hold",
    )
    parser.add_argument(
        "--tracemalloc", type=int, default=0, metavar="FRAMES", help="0: off (default)"
    )
    args = parser.parse_args()

    cycle = args.cycle
    scenario = soak_scenario(args.hours, args.gpus, cycle)
    sim = Simulation(scenario, Config())
    pipeline = sim.pipeline
    server = MetricsServer(pipeline.exporter, "127.0.0.1", 0)
    server.start()
    scraper = Scraper(server.address)
    if args.tracemalloc:
        tracemalloc.start(args.tracemalloc)
    baseline = last = None
    samples: list[Sample] = []
    started = time.perf_counter()
    cpu0 = time.process_time()
    clock = sim.node.clock
    fault_log: list[str] = []
    types: list[Counter[str]] = []
    churn = Churn()
    try:
        end = args.hours * cycle
        while clock.elapsed() < end:
            sim.step()
            sim.transitions.clear()  # kept by `simulate` for its report; the daemon keeps none
            now = pipeline.now()
            for poller in pipeline.pollers:  # what run's loop does before the rules
                poller.check_hung(now)
            pipeline.exporter.refresh()  # the loop's share; scrapes render the rest
            t = int(clock.elapsed())
            mid_fault = t % cycle == cycle * 50 // 60 - 30  # 30 s before the fault ends
            if t % SCRAPE_EVERY == 0 or mid_fault:
                body = scraper.get("/metrics")
                scraper.bytes += len(body)
                churn.scrape(body)
                scraper.get("/healthz")
                if mid_fault:  # what the daemon says of the fault
                    job = t // cycle
                    at = f"{job:02d}:{t % cycle // 60:02d}:{t % 60:02d}"  # hh:mm:ss at 1 h
                    fault_log.append(f"{at} {fault(job, args.gpus)[0]}: {telling(body)}")
            if t % PAGE_EVERY == 0:
                scraper.get("/")
            if t % cycle == cycle - 1:
                churn.end_cycle()
                gc.collect()
                traced, top = None, ""
                if args.tracemalloc:
                    snapshot = last = tracemalloc.take_snapshot()
                    traced = tracemalloc.get_traced_memory()[0] // 1024
                    if baseline is None:
                        baseline = snapshot
                    else:
                        stat = snapshot.compare_to(baseline, "lineno")[0]
                        frame = stat.traceback[0]
                        top = (
                            f"{os.path.relpath(frame.filename)}:{frame.lineno} "
                            f"{stat.size_diff / 1024:+.0f} KiB"
                        )
                samples.append(
                    Sample(
                        hour=t // cycle + 1,
                        wall=time.perf_counter() - started,
                        rss_kib=proc_status("VmRSS"),
                        fds=len(os.listdir("/proc/self/fd")),
                        threads=proc_status("Threads"),
                        objects=len(gc.get_objects()),
                        series=pipeline.store.series_count(),
                        points=history_points(sim),
                        traced_kib=traced,
                        top=top,
                    )
                )
                print(format_row(samples[-1]), file=sys.stderr, flush=True)
                if args.types:
                    types.append(Counter(type(o).__qualname__ for o in gc.get_objects()))
            clock.advance(Config().evaluation_interval)
    finally:
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        server.stop()
        sim.close()
    print(report(args, samples, wall, cpu, scraper, fault_log))
    print("\n".join(churn.report(args.gpus)))
    if args.tracemalloc and baseline is not None and last is not None:
        print("\nlargest growth of traced memory by line, the last sample against the first:")
        for stat in last.compare_to(baseline, "lineno")[:10]:
            frame = stat.traceback[0]
            print(
                f"- {os.path.relpath(frame.filename)}:{frame.lineno} "
                f"{stat.size_diff / 1024:+.1f} KiB ({stat.count_diff:+d} blocks)"
            )
    if args.types and len(types) >= 2:
        print(growth(types[1], types[-1], sim))


def growth(first: Counter[str], last: Counter[str], sim: Simulation) -> str:
    """Live objects by type, last sample against the second; the daemon's containers."""
    lines = ["", "growth of live objects by type (the last sample against the second):"]
    diff = {k: last[k] - first[k] for k in first.keys() | last.keys() if last[k] != first[k]}
    for name, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:15]:
        lines.append(f"- {n:+d} {name}")
    lines += ["", "containers held by the sources and the rules engine (size at the end):"]
    for owner, name in [
        *((s, s.name) for s in sim.pipeline.sources),
        (sim.pipeline.engine, "rules"),
    ]:
        sizes = [
            f"{attr} {len(value)}"
            for attr, value in vars(owner).items()
            if isinstance(value, dict | set | list)
        ]
        lines.append(f"- {name}: {', '.join(sizes)}")
    return "\n".join(lines)


def format_row(s: Sample) -> str:
    traced = "-" if s.traced_kib is None else f"{s.traced_kib / 1024:.1f}"
    return (
        f"| {s.hour:>2} | {s.wall:6.0f} | {s.rss_kib / 1024:6.1f} | {s.fds:>3} | {s.threads:>2} "
        f"| {s.objects:>7} | {s.series:>5} | {s.points:>6} | {traced} | {s.top} |"
    )


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def report(
    args: argparse.Namespace,
    samples: list[Sample],
    wall: float,
    cpu: float,
    scraper: Scraper,
    fault_log: list[str],
) -> str:
    simulated = args.hours * args.cycle
    lines = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        f", {platform.system()} {platform.release()}",
        f"simulated {simulated} s ({args.hours} jobs of {args.cycle} s, {simulated} cycles, "
        f"{args.gpus} GPUs) in "
        f"{wall:.0f} s wall, {cpu:.0f} s CPU: {1000 * wall / simulated:.2f} ms wall and "
        f"{1000 * cpu / simulated:.2f} ms CPU per simulated second; tracemalloc "
        + (f"on ({args.tracemalloc} frame(s))" if args.tracemalloc else "off"),
        f"web front: {scraper.scrapes} requests, {scraper.failures} not 200, "
        f"{scraper.bytes / 1e9:.2f} GB of /metrics",
        "",
        "| hour | wall s | RSS MiB | fds | threads | objects | series | points "
        "| traced MiB | largest growth since hour 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *(format_row(s) for s in samples),
        "",
    ]
    steady = [s for s in samples if s.hour >= 2]  # hour 1: caches and first jobs fill
    if len(steady) >= 2:
        hours = [float(s.hour) for s in steady]
        for what, values, unit in (
            ("RSS", [s.rss_kib / 1024 for s in steady], "MiB"),
            ("fds", [float(s.fds) for s in steady], ""),
            ("threads", [float(s.threads) for s in steady], ""),
            ("objects", [float(s.objects) for s in steady], ""),
            ("series", [float(s.series) for s in steady], ""),
            ("history points", [float(s.points) for s in steady], ""),
        ):
            lines.append(
                f"- {what}: {values[0]:g} → {values[-1]:g} {unit} (hours {steady[0].hour}–"
                f"{steady[-1].hour}), slope {slope(hours, values):+.3g} {unit}/h, "
                f"range {min(values):g}–{max(values):g}"
            )
    lines += ["", "what /metrics says 30 s before each fault ends:"]
    lines += [f"- {entry}" for entry in fault_log]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
