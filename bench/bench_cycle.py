"""Benchmark: CPU per source poll and per evaluation cycle, scrape latency, RSS.

Run by hand: `python bench/bench_cycle.py`. Prints Markdown tables; results are
recorded in docs/performance.md. Not a test: numbers depend on the machine.

A simulated node is driven second by second as the daemon drives a real one: each
source polled on its own interval (NVML 1 s, PCIe 10 s, the others 5 s), then the
rules evaluated every second, and the exposition rendered as a scrape every 15 s would
ask for it; each is timed alone (CPU time). The "render" column is per second too (a
scrape's render / 15); "cycle" is the mean CPU per second of all of it. The NVML and DCGM
numbers include the *fake* libraries (the simulator computing the scenario's state and
the ctypes marshalling) that a real driver replaces; the simulator's file writers are
not counted.
"""

from __future__ import annotations

import http.client
import statistics
import tempfile
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import yaml
from bench_scrape import spawned_daemon

from gpuwatchd import store as store_module
from gpuwatchd.config import Config
from gpuwatchd.exporter import Exporter, MetricsServer
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.sources import BUILTIN

SECONDS = 100
SCRAPES = 2000
SCRAPE_EVERY = 15  # simulated seconds between two scrapes, as Prometheus' default


def healthy(gpus: int) -> dict[str, Any]:
    data = load_scenario("healthy-8gpu").model_dump(mode="json", exclude_defaults=True)
    data["name"] = f"healthy-{gpus}gpu"
    data["node"]["gpu_count"] = gpus
    return data


def big_host() -> dict[str, Any]:
    """Issue 4's host: 128 CPUs, 24 NVMe disks, 8 NICs with IB ports, 8 GPUs, busy."""
    data = healthy(8)
    data["name"] = "big-host-8gpu"
    nics = [
        {"name": f"mlx5_{i}", "queues": 16, "bus_id": f"0000:{0x1A + i:02x}:00.0"} for i in range(8)
    ]
    data["node"]["host"] = {
        "disks": [{"name": f"nvme{i}n1", "queues": 8} for i in range(24)],
        "nics": nics,
        "ib_ports": [{"device": f"mlx5_{i}", "port": 1, "rate_gbps": 400} for i in range(8)],
        "processes": [{"pid": 4242, "name": "python", "cudart": "12.1"}],
    }
    busy = {
        "cpu_busy_percent": 40,
        "disks": {
            f"nvme{i}n1": {"read_iops": 4000, "read_mb_s": 900, "util_percent": 60, "await_ms": 2}
            for i in range(24)
        },
        "ib_ports": {f"mlx5_{i}/1": {"rx_mb_s": 20000, "tx_mb_s": 20000} for i in range(8)},
        "interrupts": {"mlx5_comp0": {"rate": 4000}},
        "processes": {4242: {"threads": 48, "workers": 8, "worker_cpu_percent": 90}},
    }
    data["phases"][0]["host"] = busy
    return data


def write(data: dict[str, Any], directory: Path) -> Path:
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bench_node(scenario: Path) -> dict[str, Any]:
    """SECONDS simulated seconds as the daemon spends them: each source polled on its own
    interval, then the rules evaluated every second and the exposition rendered for a
    scrape every SCRAPE_EVERY seconds."""
    sim = Simulation(load_scenario(scenario), Config())
    pipeline = sim.pipeline
    spent: dict[str, float] = defaultdict(float)
    polls: dict[str, int] = defaultdict(int)
    try:
        for _ in range(5):  # warm: handles, caches, identity reads, first rates
            sim.step()
            sim.node.clock.advance(1)
        for second in range(SECONDS):
            sim.node.clock.advance(1)
            sim.node.tick()
            for poller in pipeline.pollers:
                if second % round(poller.interval) == 0:
                    spent[poller.name] += timed(poller.poll)
                    polls[poller.name] += 1
            spent["rules"] += timed(pipeline.evaluate_rules)
            spent["rules"] += timed(pipeline.exporter.refresh)  # the rules' families
            if second % SCRAPE_EVERY == 0:
                spent["render"] += timed(pipeline.exporter.latest)
        per_poll = {name: spent[name] / polls[name] * 1000 for name in polls}
        return {
            "polls": per_poll,
            "intervals": {p.name: p.interval for p in pipeline.pollers},
            "rules": spent["rules"] / SECONDS * 1000,
            "render": spent["render"] / SECONDS * 1000,
            "cycle": sum(spent.values()) / SECONDS * 1000,
            "series": pipeline.store.series_count(),
            "bytes": len(pipeline.exporter.current.text),
            "down": [p.name for p in pipeline.pollers if not p.health.up],
            **bench_scrape(pipeline.exporter),
        }
    finally:
        sim.close()


def timed(fn: Any) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def bench_history(scenario: Path) -> dict[str, float]:
    """The store's memory once the history window is full (11 simulated minutes)."""
    tracemalloc.start()
    sim = Simulation(load_scenario(scenario), Config())
    try:
        sim.run(until=sim.config.history + 60)
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, store_module.__file__)]
        )
        store = sim.pipeline.store
        points = sum(len(s.history) for s in store._series.values() if s.history is not None)
        store_bytes = sum(stat.size for stat in snapshot.statistics("filename"))
        return {
            "series": store.series_count(),
            "history points": points,
            "store MiB": store_bytes / 2**20,
        }
    finally:
        tracemalloc.stop()
        sim.close()


def bench_scrape(exporter: Exporter) -> dict[str, float]:
    server = MetricsServer(exporter, "127.0.0.1", 0)
    server.start()
    try:
        connection = http.client.HTTPConnection(*server.address)
        latencies = []
        for _ in range(SCRAPES):
            start = time.perf_counter()
            connection.request("GET", "/metrics")
            connection.getresponse().read()
            latencies.append(time.perf_counter() - start)
        connection.close()
    finally:
        server.stop()
    quantiles = statistics.quantiles(latencies, n=100)
    return {"scrape p50 ms": quantiles[49] * 1000, "scrape p99 ms": quantiles[98] * 1000}


def bench_daemon(scenario: Path) -> dict[str, float]:
    """Spawn the real daemon; time to the first scrape with every source up; RSS; CPU."""
    started = time.monotonic()
    with spawned_daemon(str(scenario)) as (url, pid):
        host_port = url.split("/")[2]
        while True:
            connection = http.client.HTTPConnection(host_port)
            connection.request("GET", "/metrics")
            body = connection.getresponse().read()
            up = [line for line in body.splitlines() if line.startswith(b"gpuwatchd_source_up{")]
            if len(up) == len(BUILTIN) and all(line.endswith(b" 1.0") for line in up):
                break
            time.sleep(0.05)
        first_scrape = time.monotonic() - started
        process = psutil.Process(pid)
        before, window_start = process.cpu_times(), time.monotonic()
        time.sleep(30)  # steady state: every source polled several times
        after = process.cpu_times()
        window = time.monotonic() - window_start
        rss = process.memory_info().rss / 2**20
    busy = after.user + after.system - before.user - before.system
    return {
        "first full scrape s": first_scrape,
        "RSS MiB": rss,
        "steady CPU %": busy / window * 100,
    }


def table(rows: dict[str, dict[str, float]]) -> None:
    columns = list(next(iter(rows.values())))
    print("| node | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3g}" for c in columns) + " |")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        nodes = {
            "1 GPU": write(healthy(1), directory),
            "8 GPUs": write(healthy(8), directory),
            "8 GPUs, big host": write(big_host(), directory),
            "64 GPUs": write(healthy(64), directory),
        }
        results = {name: bench_node(path) for name, path in nodes.items()}
        daemons = {name: bench_daemon(nodes[name]) for name in ("8 GPUs", "8 GPUs, big host")}
        history = {name: bench_history(nodes[name]) for name in ("8 GPUs", "8 GPUs, big host")}
    sources = list(next(iter(results.values()))["intervals"])
    print(
        f"CPU ms per poll of each source, and per 1 s evaluation cycle (mean over {SECONDS} "
        "simulated seconds: sources on their intervals, rules every second, a scrape's "
        f"render every {SCRAPE_EVERY} s)\n"
    )
    table(
        {
            name: {
                **{f"{s} ({r['intervals'][s]:g}s)": r["polls"][s] for s in sources},
                "rules": r["rules"],
                "render": r["render"],
                "cycle": r["cycle"],
                "series": r["series"],
                "bytes": r["bytes"],
            }
            for name, r in results.items()
        }
    )
    print(f"\nscrape latency, ms, {SCRAPES} keep-alive GETs of /metrics\n")
    table(
        {name: {k: r[k] for k in ("scrape p50 ms", "scrape p99 ms")} for name, r in results.items()}
    )
    print("\nthe daemon as a process (`gpuwatchd run --simulate`, default config)\n")
    table(daemons)
    print("\nwith the 10-minute history window full (simulated in-process)\n")
    table(history)
    for name, r in results.items():
        if r["down"]:
            print(f"\nwarning: {name}: sources down during the run: {', '.join(r['down'])}")


if __name__ == "__main__":
    main()
