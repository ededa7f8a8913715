"""Benchmark: CPU per poll cycle, scrape latency, time to first full scrape, RSS.

Run by hand: `python bench/bench_cycle.py`. Prints a Markdown table; results are
recorded in docs/performance.md. Not a test: numbers depend on the machine.

A "cycle" is one poll of every enabled source plus one render of the exposition, all
on a simulated node. The NVML source's number includes the fake driver (the simulator
computing the scenario's state and ctypes marshalling), which a real driver replaces.
"""

from __future__ import annotations

import http.client
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from gpuwatchd.config import Config
from gpuwatchd.exporter import MetricsServer
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation

CYCLES = 200
SCRAPES = 2000


def scenario_file(gpus: int, directory: Path) -> Path:
    data = load_scenario("healthy-8gpu").model_dump(mode="json", exclude_defaults=True)
    data["name"] = f"healthy-{gpus}gpu"
    data["node"]["gpu_count"] = gpus
    path = directory / f"healthy-{gpus}gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cpu_ms(fn, repeat: int) -> float:
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) / repeat * 1000


def bench_cycle(gpus: int, directory: Path) -> dict[str, float]:
    sim = Simulation(load_scenario(scenario_file(gpus, directory)), Config())
    pipeline = sim.pipeline
    try:
        for _ in range(5):  # warm: handles, caches, identity reads
            sim.step()
            sim.node.clock.advance(1)
        row = {poller.name: cpu_ms(poller.poll, CYCLES) for poller in pipeline.pollers}
        row["render"] = cpu_ms(pipeline.exporter.render, CYCLES)
        row["cycle"] = sum(row.values())
        row["sim sysfs write"] = cpu_ms(sim.node.tick, CYCLES)
        row["series"] = pipeline.store.series_count()
        row["bytes"] = len(pipeline.exporter.current.text)
        row.update(bench_scrape(pipeline.exporter))
        return row
    finally:
        sim.close()


def bench_scrape(exporter) -> dict[str, float]:
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
    """Spawn the real daemon; time to the first scrape with every GPU's NVML and PCIe data."""
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
    url = line.rsplit(" on ", 1)[1].strip()
    host_port = url.split("/")[2]
    try:
        while True:
            connection = http.client.HTTPConnection(host_port)
            connection.request("GET", "/metrics")
            body = connection.getresponse().read()
            if b'gpuwatchd_source_up{source="pcie"} 1.0' in body and b'source="nvml"} 1.0' in body:
                break
            time.sleep(0.05)
        first_scrape = time.monotonic() - started
        process = psutil.Process(proc.pid)
        cpu_before, window_start = process.cpu_times(), time.monotonic()
        time.sleep(20)  # steady state: several NVML and PCIe polls, renders every second
        cpu = process.cpu_times()
        window = time.monotonic() - window_start
        rss = process.memory_info().rss / 2**20
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        "first full scrape s": first_scrape,
        "RSS MiB": rss,
        "steady CPU %": (cpu.user + cpu.system - cpu_before.user - cpu_before.system)
        / window
        * 100,
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        rows = {gpus: bench_cycle(gpus, directory) for gpus in (1, 8, 64)}
        daemon = {gpus: bench_daemon(scenario_file(gpus, directory)) for gpus in (8, 64)}
    columns = list(rows[1])
    print(f"cycle CPU in ms per call ({CYCLES} calls), scrape over {SCRAPES} keep-alive requests\n")
    print("| GPUs | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for gpus, row in rows.items():
        print(f"| {gpus} | " + " | ".join(f"{row[c]:.3g}" for c in columns) + " |")
    print("\nthe daemon as a process (`gpuwatchd run --simulate`, defaults)\n")
    dcols = list(daemon[8])
    print("| GPUs | " + " | ".join(dcols) + " |")
    print("|---" * (len(dcols) + 1) + "|")
    for gpus, row in daemon.items():
        print(f"| {gpus} | " + " | ".join(f"{row[c]:.3g}" for c in dcols) + " |")


if __name__ == "__main__":
    main()
