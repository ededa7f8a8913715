"""Benchmark: gpuwatchd next to nvitop-exporter on the same simulated node (issue 14).

    python bench/bench_vs_peer.py [--rounds 4] [--seconds 30] [--sizes 1,16,64]

Run by hand (not a test); prints Markdown for docs/performance.md. The first run
installs nvitop-exporter (PEER, pinned) into a virtualenv of its own under
~/.cache/gpuwatchd-bench (from PyPI, with its own pinned nvidia-ml-py).

Both exporters run as processes on the same simulated 8-GPU node (healthy-8gpu, looped)
with realistic NVML costs: the fake libnvidia-ml under each one's real pynvml spends a
real driver's CPU per call and blocks 20 ms in nvmlDeviceGetPcieThroughput
(gpuwatchd.sim.fake_nvml.DRIVER_COSTS): gpuwatchd as `gpuwatchd run --simulate`, the
production path with the default configuration; nvitop-exporter through
bench/peer_on_sim.py, its own CLI with the default 1 s interval; and the floor, a bare
loop making only the NVML reads a diagnosis needs (bench/floor_on_sim.py). They run one
after the other, in turn (A B C A B C ...), each round warming up then measured for
`--seconds`, all scraped every 15 s meanwhile as Prometheus would.

Measured from /proc for the process and its children: CPU (schedstat, ns) per second of
the window, RSS at its end, and the NVML calls per second the fake counted
(GPUWATCHD_SIM_NVML_STATS). Left out of the CPU and shown apart, the simulator's own
work: gpuwatchd's thread `gpuwatchd-sim`, which writes the simulated node's /proc and
/sys files (the kernel's work on a real node), gpuwatchd's simulated DCGM host engine's
answers (nv-hostengine's process on a real node; counted by the fake libdcgm,
GPUWATCHD_SIM_DCGM_STATS: the fake client library's own work stays gpuwatchd's), and, for
both, what the fake NVML's Python spent beyond the driver cost it plays (its
`overshoot`, counted by the fake itself).
Both processes carry the simulator's code (fake NVML; for gpuwatchd also the node's
writers and the fake DCGM host engine): its memory is measured in processes of their own
and shown apart. Then gpuwatchd alone at other sizes (`--sizes`) for the CPU
per GPU, at 8 GPUs with values that change every second, and at 64 GPUs it checks that
every GPU is exported with no source timeout or error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import yaml

from gpuwatchd.sim.scenario import load_scenario

PEER = "nvitop-exporter==1.7.2"
ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpuwatchd-bench"
SIM_THREAD = "gpuwatchd-sim"  # comm of the simulated node's writer thread
SCRAPE_EVERY = 15.0


# -- the peer's virtualenv --------------------------------------------------------------


def peer_python() -> Path:
    """The peer's virtualenv's python, made (once) with PEER from PyPI."""
    venv = CACHE / PEER.replace("==", "-")
    python = venv / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", PEER], check=True)
    return python


def peer_version(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    versions = {p["name"].lower(): p["version"] for p in json.loads(out.stdout)}
    return (
        f"nvitop-exporter {versions.get('nvitop-exporter')} (nvitop {versions.get('nvitop')}, "
        f"nvidia-ml-py {versions.get('nvidia-ml-py')})"
    )


# -- scenarios --------------------------------------------------------------------------


def scenario_file(directory: Path, gpus: int, changing: bool = False) -> Path:
    """healthy-8gpu with `gpus` GPUs; `changing`: every value it sets changes every second
    (one-second phases, looped), the worst case for what is rendered or evaluated again."""
    data = load_scenario("healthy-8gpu").model_dump(mode="json", exclude_defaults=True)
    data["name"] = f"bench-{gpus}gpu" + ("-changing" if changing else "")
    data["node"]["gpu_count"] = gpus
    if changing:
        base = data["phases"][0]
        phases = []
        for i in range(60):
            wobble = (i % 7) - 3  # -3 .. 3
            values = dict(base["set"])
            values.update(
                utilization_gpu=92 + wobble,
                utilization_memory=42 + wobble,
                power_w=335 + 5 * wobble,
                sm_clock_mhz=1410 - 15 * abs(wobble),
                pcie_tx_mb_s=1800 + 40 * wobble,
                pcie_rx_mb_s=9500 + 100 * wobble,
                temperature_c=62 + wobble,
            )
            phases.append({"name": f"p{i}", "duration": 1, "set": values})
        data["phases"] = phases
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# -- /proc ------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def threads(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (comm, CPU ns so far) of every thread of these processes."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                comm = Path(f"{base}/comm").read_text().strip()
                ns = int(Path(f"{base}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            out[(pid, int(tid))] = (comm, ns)
    return out


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        total += int(match.group(1)) if match else 0
    return total / 1024


def calls_so_far(path: Path) -> tuple[float, int, float, float] | None:
    """What the fake wrote: (its monotonic time, NVML calls so far, its overshoot so far,
    its own Python so far; the fake DCGM library writes no Python column: 0)."""
    try:
        at, calls, overshoot, *python = path.read_text().split()
    except (OSError, ValueError):
        return None
    return float(at), int(calls), float(overshoot), float(python[0]) if python else 0.0


# -- one run ----------------------------------------------------------------------------


@dataclass
class Run:
    who: str
    cpu: float  # ms per second on a real driver's terms: the simulator's own work left out
    rss: float  # MiB
    calls: float  # NVML calls per second
    sim_cpu: float = 0.0  # ms/s of the simulator's writer thread (left out of cpu)
    overshoot: float = 0.0  # ms/s the fake NVML's work took beyond a driver's (left out)
    fake_python: float = 0.0  # ms/s of the fake NVML's own Python, within a driver's or not
    hostengine: float = 0.0  # ms/s the simulated nv-hostengine spent in-process (left out)
    by_thread: dict[str, float] = field(default_factory=dict)  # ms/s per thread name
    checks: dict[str, Any] = field(default_factory=dict)
    scrape_ms: list[float] = field(default_factory=list)  # each scrape in the window
    series: int = 0  # series in the last scrape
    body: int = 0  # its bytes

    @property
    def with_fake(self) -> float:
        """ms/s with the fake NVML's Python in, as measured (its overshoot counted)."""
        return self.cpu + self.overshoot


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def run(who: str, command: list[str], port: int, warmup: float, seconds: float) -> Run:
    stats = Path(tempfile.mkdtemp(prefix="gpuwatchd-bench-")) / "calls"
    dcgm = stats.with_name("dcgm")
    env = dict(
        os.environ,
        GPUWATCHD_SIM_NVML_STATS=str(stats),
        GPUWATCHD_SIM_DCGM_STATS=str(dcgm),
        PYTHONUNBUFFERED="1",
    )
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                scrape(port)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{who} did not serve on port {port}") from None
                time.sleep(0.5)
        time.sleep(warmup)
        pids = descendants(process.pid)
        before, calls_before, t0 = threads(pids), calls_so_far(stats), time.monotonic()
        engine_before = calls_so_far(dcgm)
        next_scrape, scrapes = t0, []
        while (left := t0 + seconds - time.monotonic()) > 0:
            if time.monotonic() >= next_scrape:
                asked = time.perf_counter()
                scrape(port)
                scrapes.append((time.perf_counter() - asked) * 1e3)
                next_scrape += SCRAPE_EVERY
            time.sleep(min(left, max(0.0, next_scrape - time.monotonic())))
        after, calls_after, t1 = threads(pids), calls_so_far(stats), time.monotonic()
        engine_after = calls_so_far(dcgm)
        elapsed = t1 - t0
        text = scrape(port)
        rss = rss_mib(pids)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    by_thread: dict[str, float] = {}
    for key, (comm, ns) in after.items():
        spent = (ns - before.get(key, (comm, 0))[1]) / 1e6 / elapsed
        by_thread[comm] = by_thread.get(comm, 0.0) + spent
    sim = by_thread.pop(SIM_THREAD, 0.0)
    calls = overshoot = fake_python = 0.0
    if calls_before and calls_after and calls_after[0] > calls_before[0]:
        span = calls_after[0] - calls_before[0]
        calls = (calls_after[1] - calls_before[1]) / span
        overshoot = (calls_after[2] - calls_before[2]) * 1e3 / span
        fake_python = (calls_after[3] - calls_before[3]) * 1e3 / span
    hostengine = 0.0
    if engine_before and engine_after and engine_after[0] > engine_before[0]:
        span = engine_after[0] - engine_before[0]
        hostengine = (engine_after[2] - engine_before[2]) * 1e3 / span
    cpu = sum(by_thread.values()) - overshoot - hostengine
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return Run(
        who, cpu, rss, calls, sim, overshoot, fake_python, hostengine, by_thread, checks(text),
        scrapes, series, len(text.encode()),
    )  # fmt: skip


def checks(text: str) -> dict[str, Any]:
    """What gpuwatchd's exposition says at the end: GPUs exported, sources up, errors."""
    gpus = set(re.findall(r'^gpuwatchd_gpu_info\{[^}]*\bgpu="(\d+)"', text, re.M))
    down = re.findall(r'^gpuwatchd_source_up\{source="(\w+)"\} 0', text, re.M)
    counted = re.findall(r'^gpuwatchd_source_errors_total\{source="(\w+)"\} (\S+)', text, re.M)
    errors = {source: float(n) for source, n in counted if float(n)}
    return {"gpus": len(gpus), "down": down, "errors": errors}


def gpuwatchd(scenario: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "gpuwatchd", "run", "--simulate", str(scenario),
        "--listen", f"127.0.0.1:{port}",
    ]  # fmt: skip


def peer(python: Path, scenario: Path, port: int) -> list[str]:
    site = sysconfig.get_paths()["purelib"]  # gpuwatchd's dependencies, for the simulator
    return [
        str(python), str(ROOT / "bench" / "peer_on_sim.py"), str(scenario), site,
        "--bind-address", "127.0.0.1", "--port", str(port), "--interval", "1",
    ]  # fmt: skip


def floor(scenario: Path, port: int) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "floor_on_sim.py"), str(scenario), str(port)]


def simulator_rss(
    python: Path, scenario: Path, whole_node: bool, exporter: str | None = None
) -> float:
    """MiB the simulator adds to a process that has loaded the exporter itself (the
    peer, or the `exporter` imports given): the fake NVML (and, `whole_node`, the
    simulated node gpuwatchd runs on), measured in processes of their own."""
    site = sysconfig.get_paths()["purelib"]
    if whole_node:
        exporter = (
            "import gpuwatchd.daemon, gpuwatchd.cli; "
            "from gpuwatchd.sources import load_builtin_sources; load_builtin_sources()"
        )
        simulator = "from gpuwatchd.sim.node import SimNode; SimNode(load_scenario(s), False)"
    else:
        exporter = exporter or "import nvitop, nvitop_exporter.cli, nvitop_exporter.exporter"
        simulator = (
            "import pynvml; from gpuwatchd.sim.clock import SimClock; "
            "from gpuwatchd.sim.fake_nvml import FakeNvmlLib; from gpuwatchd.sim.scenario "
            "import Timeline; FakeNvmlLib(pynvml, Timeline(load_scenario(s)), SimClock(False))"
        )
    setup = f"import sys; sys.path.extend([{str(ROOT)!r}, {site!r}]); s = {str(scenario)!r}"
    load = "from gpuwatchd.sim.scenario import load_scenario"
    measure = (
        "import re; print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1])"
    )

    def kib(*lines: str) -> int:
        code = "\n".join([setup, *lines, measure])
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
        return int(out.stdout.split()[-1])

    return (kib(exporter, load, simulator) - kib(exporter)) / 1024


# -- report ---------------------------------------------------------------------------------


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError, IndexError):
        cpu = re.findall(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())[0]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, Linux {platform.release()}, "
        f"Python {platform.python_version()}; load average {os.getloadavg()[0]:.2f} at the start"
    )


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def mean(runs: list[Run], value: str) -> float:
    return statistics.mean(getattr(r, value) for r in runs)


def spread(runs: list[Run], value: str, digits: int = 2) -> str:
    """Mean (min–max) over the runs."""
    values = [getattr(r, value) for r in runs]
    low, high = min(values), max(values)
    return f"{statistics.mean(values):.{digits}f} ({low:.{digits}f}–{high:.{digits}f})"


def slope(by_size: dict[int, float]) -> tuple[float, float]:
    """Least squares: (ms/s per GPU, ms/s at no GPU)."""
    xs = sorted(by_size)
    ys = [by_size[x] for x in xs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    per_gpu = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return per_gpu, my - per_gpu * mx


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--sizes", default="1,16,64", help="gpuwatchd alone at these sizes")
    args = parser.parse_args()
    python = peer_python()
    work = Path(tempfile.mkdtemp(prefix="gpuwatchd-bench-"))
    node = scenario_file(work, 8)
    print(f"# gpuwatchd vs {peer_version(python)}, {date.today()}\n")
    print(f"Machine: {machine()}.\n")

    runs: dict[str, list[Run]] = {"gpuwatchd": [], "peer": [], "floor": []}
    commands = {"gpuwatchd": gpuwatchd, "peer": lambda n, p: peer(python, n, p), "floor": floor}
    for i in range(args.rounds):  # A B C A B C ...
        for who in runs:
            port = free_port()
            command = commands[who](node, port)
            result = run(who, command, port, args.warmup, args.seconds)
            runs[who].append(result)
            print(f"<!-- round {i + 1} {who}: {result} -->", flush=True)
    ours, theirs, bare = runs["gpuwatchd"], runs["peer"], runs["floor"]
    simulators = {
        "gpuwatchd": simulator_rss(Path(sys.executable), node, whole_node=True),
        "peer": simulator_rss(python, node, whole_node=False),
    }
    simulators["floor"] = simulator_rss(Path(sys.executable), node, False, "import pynvml")
    print(
        f"\n8 GPUs, {args.rounds} rounds of {args.seconds:g} s each, alternating; "
        "mean (min–max) over the rounds\n"
    )
    exporters = (
        ("gpuwatchd", "gpuwatchd", ours),
        ("peer", "nvitop-exporter", theirs),
        ("floor", "bare NVML loop (bench/floor_on_sim.py)", bare),
    )
    rows = [
        [
            name,
            spread(r, "cpu"),
            spread(r, "with_fake"),
            f"{mean(r, 'fake_python'):.2f}",
            spread(r, "rss", 1),
            f"{simulators[who]:.1f}",
            f"{mean(r, 'rss') - simulators[who]:.1f}",
            spread(r, "calls", 0),
            f"{r[-1].series} ({r[-1].series / 8:.0f})" if who != "floor" else "-",
            f"{r[-1].body / 1e3:.1f}" if who != "floor" else "-",
            scrape_times(r),
        ]
        for who, name, r in exporters
    ]
    header = ["exporter", "CPU ms/s, a real driver's terms", "with the fake NVML's Python in",
              "the fake NVML's own Python, ms/s", "RSS MiB", "of which the simulator, MiB",
              "RSS less the simulator, MiB", "NVML calls/s", "series (per GPU)",
              "KB a scrape", "scrape ms, median (max)"]  # fmt: skip
    print(table(header, rows))
    ratio = mean(theirs, "cpu") / mean(ours, "cpu")
    print(
        f"\nCPU, nvitop-exporter / gpuwatchd: **{ratio:.1f}×**. Left out of the CPU (a real "
        "driver's terms): what the fake NVML's Python took beyond the driver cost it plays "
        f"(its overshoot), gpuwatchd {mean(ours, 'overshoot'):.2f} ms/s, nvitop-exporter "
        f"{mean(theirs, 'overshoot'):.2f} ms/s, the floor {mean(bare, 'overshoot'):.2f} ms/s "
        "(the rest of the fake's Python runs within the driver cost it plays); gpuwatchd's "
        f"simulated node's writer thread, {mean(ours, 'sim_cpu'):.2f} ms/s, and its simulated "
        f"DCGM host engine (a process of its own on a node), {mean(ours, 'hostengine'):.2f} "
        "ms/s (in `source-dcgm` below).\n"
    )
    print(
        "**Side by side** (issue 46): gpuwatchd / the floor "
        f"**{mean(ours, 'cpu') / mean(bare, 'cpu'):.2f}×** on a real driver's terms "
        f"({mean(ours, 'with_fake') / mean(bare, 'with_fake'):.2f}× with the fake's Python "
        f"in); RSS **{mean(ours, 'rss'):.1f} MiB** "
        f"({mean(ours, 'rss') - simulators['gpuwatchd']:.1f} less the simulator); "
        f"**{ours[-1].series} series** ({ours[-1].series / 8:.0f} per GPU, "
        f"{ours[-1].body / 1e3:.1f} KB a scrape) against nvitop-exporter's {theirs[-1].series}.\n"
    )
    names = sorted({n for r in ours for n in r.by_thread}, key=lambda n: -mean_thread(ours, n))
    print("gpuwatchd per thread, ms/s (mean over the rounds)\n")
    print(table(names, [[f"{mean_thread(ours, n):.2f}" for n in names]]))

    print("\ngpuwatchd alone, by node size (2 runs each)\n")
    by_size = {8: mean(ours, "cpu")}
    rows = []
    for gpus, changing in [(int(n), False) for n in args.sizes.split(",") if n] + [(8, True)]:
        path = scenario_file(work, gpus, changing)
        alone = [
            run("gpuwatchd", gpuwatchd(path, port := free_port()), port, args.warmup, args.seconds)
            for _ in range(2)
        ]
        if not changing:
            by_size[gpus] = mean(alone, "cpu")
        end = alone[-1].checks
        rows.append([
            f"{gpus} GPUs" + (", values changing every second" if changing else ""),
            spread(alone, "cpu"), f"{mean(alone, 'sim_cpu'):.2f}", spread(alone, "rss", 1),
            f"{mean(alone, 'calls'):.0f}", end["gpus"], ", ".join(end["down"]) or "none",
            end["errors"] or "none",
        ])  # fmt: skip
        print(f"<!-- {rows[-1]} -->", flush=True)
    header = ["node", "CPU ms/s", "sim writer ms/s", "RSS MiB", "NVML calls/s",
              "GPUs exported", "sources down", "source errors"]  # fmt: skip
    print(table(header, rows))
    if len(by_size) < 2:  # a slope needs two node sizes
        return 0
    per_gpu, at_none = slope(by_size)
    print(
        f"\nCPU per GPU (least squares over {sorted(by_size)} GPUs): **{per_gpu:.3f} ms/s "
        f"per GPU**, {at_none:.2f} ms/s with none."
    )
    return 0


def scrape_times(runs: list[Run]) -> str:
    """Scrapes every SCRAPE_EVERY s as Prometheus would: each the client's wall time."""
    times = [t for r in runs for t in r.scrape_ms]
    return f"{statistics.median(times):.1f} ({max(times):.1f})" if times else "-"


def mean_thread(runs: list[Run], name: str) -> float:
    return statistics.mean(r.by_thread.get(name, 0.0) for r in runs)


if __name__ == "__main__":
    sys.exit(main())
