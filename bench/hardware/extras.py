"""Session 8's questions for a real GPU, in one read-only run of ~4 minutes.

    OUT=/some/dir bash bench/hardware/extras.sh [--dry-run]

Nothing here changes a GPU setting (no MIG mode, clocks or limits). Each step runs in
its own process under a time cap and writes one JSON file to $OUT:

- memory.json: a Python process's RSS at each stage of NVML use, and the mappings that
  hold it (why the daemon read 91-96 MiB on the H200 and 63-65 here; issue 24).
- mig.json: how the driver answers the MIG calls on a GPU with MIG off, and every
  GPU-instance profile with its placements (the fake NVML's MIG model; issue 26).
- spin.json: utilization, power, clocks, PCIe bytes and GPM's SM/tensor/DRAM activity of
  a kernel spinning on 1, 32 and 64 blocks (a hung NCCL kernel keeps one block per
  channel resident) beside a matmul loop and a launch-bound loop (issue 22's physics).
- daemon.json: `gpuwatchd run` on real NVML and on --simulate, same machine: RSS, its
  biggest mappings, threads, and its CPU over a minute beside the bare NVML loop of
  bench/floor_on_sim.py (issue 24's floor).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from experiment import describe, free_port  # noqa: E402

DRY = os.environ.get("DRY_RUN") == "1"
SCENARIO = "healthy-at-power-cap-h200"  # the dry run's stand-in node


@functools.cache
def nvml() -> Any:
    """pynvml, initialised: the real library, or in the dry run the fake on a scenario."""
    import pynvml

    if DRY:
        from gpuwatchd.sim.clock import SimClock
        from gpuwatchd.sim.fake_nvml import DRIVER_COSTS, FakeNvmlLib
        from gpuwatchd.sim.scenario import Timeline, load_scenario

        timeline = Timeline(load_scenario(SCENARIO), loop=True)
        pynvml.nvmlLib = FakeNvmlLib(pynvml, timeline, SimClock(virtual=False), costs=DRIVER_COSTS)
    pynvml.nvmlInit()
    return pynvml


def attempt(function: Any, *args: Any) -> Any:
    """A call's value as JSON, or its error's name."""
    import pynvml

    try:
        return describe(function(*args))
    except pynvml.NVMLError as e:
        names = {getattr(pynvml, n): n for n in dir(pynvml) if n.startswith("NVML_ERROR_")}
        return {"error": names.get(e.value, f"code {e.value}")}
    except Exception as e:  # a binding's own failure (missing symbol, ctypes)
        return {"error": f"{type(e).__name__}: {e}"}


# -- memory -------------------------------------------------------------------------------


def rss_kib(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def mappings(pid: int | str = "self", top: int = 15) -> list[dict[str, Any]]:
    """The biggest resident mappings, summed by file ([anon] for anonymous memory)."""
    sizes: dict[str, int] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping's header
            name = parts[5] if len(parts) > 5 else "[anon]"
        elif parts and parts[0] == "Rss:":
            sizes[name] = sizes.get(name, 0) + int(parts[1])
    ranked = sorted(sizes.items(), key=lambda item: -item[1])
    return [{"mapping": n, "rss_kib": kib} for n, kib in ranked[:top]]


def step_memory() -> dict[str, Any]:
    stages = [("python", rss_kib())]
    import pynvml  # noqa: F401

    stages.append(("import pynvml", rss_kib()))
    nv = nvml()
    stages.append(("nvmlInit", rss_kib()))
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    for handle in handles:
        nv.nvmlDeviceGetUtilizationRates(handle)
        nv.nvmlDeviceGetMemoryInfo(handle)
        nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES])
        nv.nvmlDeviceGetComputeRunningProcesses(handle)
    stages.append(("one read of each GPU", rss_kib()))
    import gpuwatchd.daemon  # noqa: F401  the daemon's whole import graph

    stages.append(("import gpuwatchd.daemon", rss_kib()))
    return {"stages_kib": stages, "mappings": mappings()}


# -- MIG, with MIG off ---------------------------------------------------------------------


def placements(nv: Any, handle: Any, profile_id: int) -> Any:
    import ctypes

    count = ctypes.c_uint(0)
    array = (nv.c_nvmlGpuInstancePlacement_t * 16)()
    count.value = 16
    try:
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, array, ctypes.byref(count)
        )
    except nv.NVMLError as e:
        return {"error": str(e)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return [[array[i].start, array[i].size] for i in range(count.value)]


def gpu_instances(nv: Any, handle: Any, profile_id: int) -> Any:
    import ctypes

    count = ctypes.c_uint(0)
    array = (nv.c_nvmlGpuInstance_t * 8)()
    try:
        nv.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
    except nv.NVMLError as e:
        return {"error": str(e)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"count": count.value}


def step_mig() -> dict[str, Any]:
    nv = nvml()
    gpus = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        gpu: dict[str, Any] = {
            "name": attempt(nv.nvmlDeviceGetName, h),
            "mig_mode": attempt(nv.nvmlDeviceGetMigMode, h),
            "max_mig_devices": attempt(nv.nvmlDeviceGetMaxMigDeviceCount, h),
            "is_mig_handle": attempt(nv.nvmlDeviceIsMigDeviceHandle, h),
            "mig_handle_0": attempt(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, 0),
            "gpu_instance_id": attempt(nv.nvmlDeviceGetGpuInstanceId, h),
            "compute_instance_id": attempt(nv.nvmlDeviceGetComputeInstanceId, h),
            "parent_of_handle": attempt(nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, h),
            "attributes": attempt(nv.nvmlDeviceGetAttributes_v2, h),
            "gpu_instance_by_id_1": attempt(nv.nvmlDeviceGetGpuInstanceById, h, 1),
            "gpm_support": attempt(nv.nvmlGpmQueryDeviceSupport, h),
            "gpm_streaming": attempt(nv.nvmlGpmQueryIfStreamingEnabled, h),
            "memory_v2": attempt(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2),
            "profiles": [],
        }
        for profile in range(nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            info = attempt(nv.nvmlDeviceGetGpuInstanceProfileInfo, h, profile, 2)
            row: dict[str, Any] = {"profile": profile, "info_v2": info}
            if isinstance(info, dict) and "id" in info:
                row["placements"] = placements(nv, h, info["id"])
                remaining = nv.nvmlDeviceGetGpuInstanceRemainingCapacity
                row["remaining"] = attempt(remaining, h, info["id"])
                row["instances"] = gpu_instances(nv, h, info["id"])
            gpu["profiles"].append(row)
        gpus.append(gpu)
    return {"gpus": gpus}


# -- spin: what a hung collective's kernel looks like -------------------------------------

LOAD = r"""
import json, sys, time, torch
def mark(name): print(json.dumps({"phase": name, "t": time.time()}), flush=True)
dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cpu":
    mark("no-cuda"); sys.exit(0)
torch.ones(1, device=dev); torch.cuda.synchronize()
hz = float(sys.argv[1]) * 1e6
def spin(blocks, seconds):
    streams = [torch.cuda.Stream() for _ in range(blocks)]
    mark(f"spin{blocks}")
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(seconds * hz))
    torch.cuda.synchronize(); mark("end")
mark("idle"); time.sleep(6); mark("end")
spin(1, 10); time.sleep(2)
spin(32, 10); time.sleep(2)
spin(64, 10); time.sleep(2)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = a.clone()
mark("matmul"); end = time.time() + 10
while time.time() < end:
    for _ in range(20): c = a @ b
    torch.cuda.synchronize()
mark("end"); time.sleep(2)
x = torch.zeros(1024, device=dev)
mark("small-kernels"); end = time.time() + 10
while time.time() < end:
    for _ in range(100): x.add_(1)
    torch.cuda.synchronize()
mark("end")
"""

QUEUE = r"""
import json, os, sys, time, torch
def mark(name): print(json.dumps({"phase": name, "t": time.time()}), flush=True)
if not torch.cuda.is_available():
    mark("no-cuda"); sys.exit(0)
torch.ones(1, device="cuda"); torch.cuda.synchronize()
hz, tag = float(sys.argv[1]) * 1e6, sys.argv[2]
cycles = int(8 * hz)
def phase(name, streams, queued, waiter):
    # `streams` kernels spin (one block each); `queued` more go behind them on the same
    # streams; `waiter`: another stream waits on an event recorded after each spin and
    # has a kernel queued behind it (a compute stream waiting on a hung collective)
    pool = [torch.cuda.Stream() for _ in range(streams)]
    other = torch.cuda.Stream()
    mark(f"{tag}{name}")
    for s in pool:
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles)
            for _ in range(queued):
                torch.cuda._sleep(1000)
        if waiter:
            event = torch.cuda.Event(); event.record(s); other.wait_event(event)
    if waiter:
        with torch.cuda.stream(other):
            torch.cuda._sleep(1000)
    torch.cuda.synchronize(); mark("end"); time.sleep(1.5)
phase("1-stream-alone", 1, 0, False)
phase("1-stream-queued", 1, 1, False)
phase("1-stream-waiter", 1, 0, True)
phase("8-streams-queued", 8, 1, False)
phase("32-streams-alone", 32, 0, False)
phase("32-streams-queued", 32, 1, False)
phase("32-streams-waiter", 32, 0, True)
"""

GPM = {
    "graphics_util": 1, "sm_util": 2, "sm_occupancy": 3, "any_tensor_util": 5,
    "dram_bw_util": 10, "pcie_tx_mib_s": 20, "pcie_rx_mib_s": 21,
}  # fmt: skip


def gpm_reader(nv: Any, handle: Any) -> Any:
    """A function returning GPM's metrics since its last call, or None without GPM."""
    try:
        if not nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
            return None
        samples = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
        nv.nvmlGpmSampleGet(handle, samples[0])
    except Exception:
        return None
    turn = [0]

    def read() -> dict[str, float]:
        old, new = samples[turn[0]], samples[1 - turn[0]]
        nv.nvmlGpmSampleGet(handle, new)
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM)
        request.sample1, request.sample2 = old, new
        for i, metric in enumerate(GPM.values()):
            request.metrics[i].metricId = metric
        nv.nvmlGpmMetricsGet(request)
        turn[0] = 1 - turn[0]
        return {
            name: round(request.metrics[i].value, 2)
            for i, name in enumerate(GPM)
            if request.metrics[i].nvmlReturn == nv.NVML_SUCCESS
        }

    return read


def sample(nv: Any, handle: Any, gpm: Any, counters: dict[str, int]) -> dict[str, Any]:
    row: dict[str, Any] = {"t": time.time()}
    row["util"] = nv.nvmlDeviceGetUtilizationRates(handle).gpu
    row["power_w"] = nv.nvmlDeviceGetPowerUsage(handle) / 1000
    row["sm_mhz"] = nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)
    row["reasons"] = nv.nvmlDeviceGetCurrentClocksEventReasons(handle)
    fields = nv.nvmlDeviceGetFieldValues(
        handle, [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
    )
    for name, field in zip(("pcie_tx", "pcie_rx"), fields, strict=True):
        if field.nvmlReturn == nv.NVML_SUCCESS:
            value = int(field.value.ullVal)
            if name in counters:
                row[f"{name}_bytes_s"] = value - counters[name]
            counters[name] = value
    if gpm is not None:
        with contextlib.suppress(Exception):
            row["gpm"] = gpm()
    return row


def step_spin(script: str = "", env: dict[str, str] | None = None) -> dict[str, Any]:
    nv = nvml()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    max_mhz = nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM)
    gpm = gpm_reader(nv, handle)
    command = [sys.executable, "-c", script or LOAD, str(max_mhz)]
    load = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    marks: list[dict[str, Any]] = []
    reader = threading.Thread(
        target=lambda: marks.extend(json.loads(line) for line in load.stdout or [] if line.strip())
    )
    reader.start()
    rows, counters = [], {}
    next_at = time.monotonic()
    while load.poll() is None:
        rows.append(sample(nv, handle, gpm, counters))
        next_at += 1.0
        time.sleep(max(0.0, next_at - time.monotonic()))
    reader.join()
    return {"max_sm_mhz": max_mhz, "gpm": gpm is not None, "marks": marks,
            "phases": summarize(rows, marks), "samples": rows}  # fmt: skip


def summarize(rows: list[dict[str, Any]], marks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the median of each reading over the samples wholly inside it."""
    phases: dict[str, Any] = {}
    for start, end in zip(marks, marks[1:], strict=False):
        if start["phase"] == "end":
            continue
        inside = [r for r in rows if start["t"] + 1.5 <= r["t"] <= end["t"]]
        flat = [{**{k: v for k, v in r.items() if k != "gpm"}, **r.get("gpm", {})} for r in inside]
        keys = sorted({k for r in flat for k in r} - {"t", "reasons"})
        phases[start["phase"]] = {
            "seconds": round(end["t"] - start["t"], 1),
            "samples": len(flat),
            **{k: statistics.median(r[k] for r in flat if k in r) for k in keys},
            "reasons": sorted({hex(r["reasons"]) for r in flat}),
        }
    return phases


# -- the daemon, and the floor -------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def measure(command: list[str], url: str | None, warm: float, seconds: float) -> dict[str, Any]:
    """Start `command`, wait until it answers (if url), let it warm, then its CPU over
    `seconds`, its RSS and its biggest mappings."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while url and time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    break
            time.sleep(0.2)
        time.sleep(warm)
        start, cpu0 = time.monotonic(), cpu_seconds(process.pid)
        rss = []
        while time.monotonic() - start < seconds and process.poll() is None:
            time.sleep(1.0)
            rss.append(rss_kib(process.pid))
        cpu = cpu_seconds(process.pid) - cpu0
        elapsed = time.monotonic() - start
        return {
            "command": command[2:], "cpu_ms_per_s": round(cpu / elapsed * 1000, 2),
            "seconds": round(elapsed, 1), "rss_kib_min_max": [min(rss), max(rss)],
            "threads": threads(process.pid), "mappings": mappings(process.pid),
        }  # fmt: skip
    finally:
        process.terminate()
        try:
            _, err = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        if process.returncode not in (0, -15):
            print(err.decode(errors="replace")[-2000:], file=sys.stderr)


FLOOR = (
    "import sys; sys.path.insert(0, sys.argv[1]); from floor_on_sim import read_forever;"
    "import pynvml; pynvml.nvmlInit(); read_forever(pynvml, {})"
)


def step_daemon(seconds: float) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    daemon = [sys.executable, "-m", "gpuwatchd", "run", "--listen", f"127.0.0.1:{port}"]
    simulated = daemon + ["--simulate", SCENARIO]
    runs = {"simulated": measure(simulated, url, 10, seconds / 2)}
    if DRY:
        return runs
    runs["real"] = measure(daemon, url, 10, seconds)
    runs["floor"] = measure([sys.executable, "-c", FLOOR, str(HERE.parent)], None, 5, seconds)
    return runs


def step_queue() -> dict[str, Any]:
    """What waits behind a spinning kernel on PCIe: the same phases with CUDA's default 8
    hardware queues and with 32 (CUDA_DEVICE_MAX_CONNECTIONS), and the PCIe counters'
    value type (the driver says they may wrap)."""
    nv = nvml()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    fields = nv.nvmlDeviceGetFieldValues(
        handle, [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
    )
    result: dict[str, Any] = {"pcie_counters": [describe(f) for f in fields]}
    for tag, connections in (("c8-", "8"), ("c32-", "32")):
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": connections}
        run = step_spin(QUEUE.replace("sys.argv[2]", repr(tag)), env)
        result[tag.rstrip("-")] = {k: v for k, v in run.items() if k != "samples"}
        result[tag + "samples"] = run["samples"]
    return result


STEPS = {"memory": step_memory, "mig": step_mig, "spin": step_spin, "queue": step_queue}


def main() -> int:
    name, out = sys.argv[1], Path(sys.argv[2])
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    started = time.monotonic()
    result = step_daemon(seconds) if name == "daemon" else STEPS[name]()
    result["step_seconds"] = round(time.monotonic() - started, 1)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
