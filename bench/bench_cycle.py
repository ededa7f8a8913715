"""Benchmark: CPU per source poll and per evaluation cycle, scrape latency, RSS.

Run by hand: `python bench/bench_cycle.py`. Prints Markdown tables; results are
recorded in docs/performance.md. Not a test: numbers depend on the machine.

Each source is polled once per simulated second (the node's files and fake libraries
move between polls, as they would) and its CPU time is measured alone. A source runs
every `interval`, so the steady cost of one evaluation cycle (1 s) is the sum over
sources of poll cost / interval, plus one render of both expositions. The NVML and
DCGM numbers include the *fake* libraries (the simulator computing the scenario's
state and the ctypes marshalling) that a real driver replaces.
"""

from __future__ import annotations

import http.client
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import yaml

from gpuwatchd import store as store_module
from gpuwatchd.config import Config
from gpuwatchd.exporter import Exporter, MetricsServer
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation

POLLS = 100
SCRAPES = 2000


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
    sim = Simulation(load_scenario(scenario), Config())
    pipeline = sim.pipeline
    spent: dict[str, float] = defaultdict(float)
    try:
        for _ in range(5):  # warm: handles, caches, identity reads, first rates
            sim.step()
            sim.node.clock.advance(1)
        for _ in range(POLLS):
            sim.node.clock.advance(1)
            sim.node.tick()
            for poller in pipeline.pollers:
                start = time.process_time()
                poller.poll()
                spent[poller.name] += time.process_time() - start
        polls = {name: seconds / POLLS * 1000 for name, seconds in spent.items()}
        render = cpu_ms(pipeline.exporter.render, POLLS)
        per_cycle = render + sum(
            polls[p.name] / max(p.interval, pipeline.config.evaluation_interval)
            for p in pipeline.pollers
        )
        down = [p.name for p in pipeline.pollers if not p.health.up]
        return {
            "polls": polls,
            "intervals": {p.name: p.interval for p in pipeline.pollers},
            "render": render,
            "cycle": per_cycle,
            "all at once": render + sum(polls.values()),
            "series": pipeline.store.series_count(),
            "bytes": len(pipeline.exporter.current.text),
            "down": down,
            **bench_scrape(pipeline.exporter),
        }
    finally:
        sim.close()


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
        points = sum(len(series.history) for series in store._series.values())
        store_bytes = sum(stat.size for stat in snapshot.statistics("filename"))
        return {
            "series": store.series_count(),
            "history points": points,
            "store MiB": store_bytes / 2**20,
        }
    finally:
        tracemalloc.stop()
        sim.close()


def cpu_ms(fn, repeat: int) -> float:
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) / repeat * 1000


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
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "run",
            "--simulate",
            str(scenario),
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = next(line for line in proc.stderr if "gpuwatchd: serving" in line)
    host_port = line.rsplit(" on ", 1)[1].strip().split("/")[2]
    try:
        while True:
            connection = http.client.HTTPConnection(host_port)
            connection.request("GET", "/metrics")
            body = connection.getresponse().read()
            if b"gpuwatchd_source_up" in body and b"} 0.0\n" not in _up_lines(body):
                break
            time.sleep(0.05)
        first_scrape = time.monotonic() - started
        process = psutil.Process(proc.pid)
        before, window_start = process.cpu_times(), time.monotonic()
        time.sleep(30)  # steady state: every source polled several times
        after = process.cpu_times()
        window = time.monotonic() - window_start
        rss = process.memory_info().rss / 2**20
    finally:
        proc.terminate()
        proc.wait(10)
    busy = after.user + after.system - before.user - before.system
    return {
        "first full scrape s": first_scrape,
        "RSS MiB": rss,
        "steady CPU %": busy / window * 100,
    }


def _up_lines(body: bytes) -> bytes:
    return b"".join(
        line + b"\n" for line in body.splitlines() if line.startswith(b"gpuwatchd_source_up{")
    )


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
    print(f"CPU ms per poll of each source (mean of {POLLS}), and per 1 s evaluation cycle\n")
    table(
        {
            name: {
                **{f"{s} ({r['intervals'][s]:g}s)": r["polls"][s] for s in sources},
                "render": r["render"],
                "cycle (steady)": r["cycle"],
                "all sources at once": r["all at once"],
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
