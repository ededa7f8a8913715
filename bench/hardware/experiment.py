"""The Python side of bench/hardware/validate.sh (issue 17): gpuwatchd on a real GPU.

Subcommands, each writing into the results folder RESULTS (validate.sh time-boxes each):

  facts RESULTS [--simulate SCENARIO]
      nvml.json: driver and CUDA versions and, per GPU, the latency of every NVML call
      the daemon's sources make (the value each returned, or its error), with
      nvmlDeviceGetPcieThroughput's blocking time; pcie.json and lspci.txt: the PCIe
      path of each GPU (sysfs, and `lspci -vv` LnkCap/LnkSta/LnkCtl2 where lspci runs).
  setup RESULTS --socket PATH [--dry-run --lead S --phase-seconds S]
      rules.yaml (the default rules, `for:` and `keep_firing_for:` shortened; in a dry
      run the windows too), config.yaml, and in a dry run scenario.yaml, a simulated
      H200 whose timeline follows the training's phases.
  run RESULTS --config FILE [--simulate SCENARIO] ...
      `gpuwatchd run` plus bench/hardware/train.py: /metrics scraped every second into
      scrapes.txt.gz, the daemon's CPU and RSS from /proc every second into
      resources.csv, events into experiment.jsonl; both processes stopped at the end.
  analyze RESULTS
      per phase: the causes that fired (and when), the probe's wait/compute, GPU use,
      the daemon's cost; expected vs observed: summary.json and summary.txt.
  pins WHEEL / check-wheels DIR
      (prepare.sh) the dependencies to carry, at the versions installed here; that the
      wheels in DIR plus the lent machine's packages cover them all.

With --simulate (a dry run) the NVML binding and /sys are the simulator's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PHASES = ("a-healthy", "b-starved", "c-healthy")
EXPECTED_IN_B = ("input_pipeline_stall", "dataloader_single_process")
SCRAPE_MARK = "# gpuwatchd-hw scrape "


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


# -- facts: NVML --------------------------------------------------------------------------


def describe(value: Any, depth: int = 0) -> Any:
    """An NVML return value as JSON: ctypes structures field by field, bytes decoded."""
    if depth > 3:
        return repr(value)[:80]
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple, ctypes.Array)):
        return [describe(v, depth + 1) for v in value[:8]]
    fields = getattr(value, "_fields_", None)
    if fields:
        return {f[0]: describe(getattr(value, f[0], None), depth + 1) for f in fields}
    if hasattr(value, "value"):  # a ctypes scalar
        return describe(value.value, depth + 1)
    return repr(value)[:200]


class Timer:
    """Times NVML calls: each call `reps` times (fewer past `budget` seconds)."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.codes = {getattr(nv, n): n for n in dir(nv) if n.startswith("NVML_ERROR_")}

    def measure(
        self, label: str, name: str, args: tuple[Any, ...], reps: int = 30, budget: float = 3.0
    ) -> dict[str, Any]:
        row: dict[str, Any] = {"call": label, "function": name}
        function = getattr(self.nv, name, None)
        if function is None:
            row["error"] = "not in this pynvml"
            return row
        times: list[float] = []
        cpu: list[float] = []  # this thread's CPU: a call that blocks spends less than its time
        for i in range(reps):
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                value = function(*args)
            except self.nv.NVMLError as e:
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
                row["error"] = self.codes.get(e.value, f"code {e.value}")
                break
            except Exception as e:  # a binding's own bug (wrong arity, ctypes): recorded
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
                row["error"] = f"{type(e).__name__}: {e}"
                break
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
            if i == 0:
                row["value"] = describe(value)
            if sum(times) > budget:
                break
        times.sort()
        row.update(
            calls=len(times),
            min_us=round(times[0] * 1e6, 1),
            median_us=round(statistics.median(times) * 1e6, 1),
            p90_us=round(times[int(0.9 * (len(times) - 1))] * 1e6, 1),
            max_us=round(times[-1] * 1e6, 1),
            cpu_median_us=round(statistics.median(cpu) * 1e6, 1),
        )
        return row


def nvml_calls(nv: Any, handle: Any) -> Iterator[tuple[str, str, tuple[Any, ...], int]]:
    """(label, function, args, repetitions) for every per-GPU call the sources make."""
    from gpuwatchd.sources.nvml.reads import POWER_READ, READS

    calls: list[tuple[str, str, tuple[Any, ...], int]] = []
    for read in (*READS, POWER_READ):  # the nvml source's table (and its power fallback)
        args = tuple(getattr(nv, a) for a in read.args)
        for name in read.functions:
            label = name + "".join(f"({a})" for a in read.args)
            calls.append((label, name, (handle, *args), 30))
    # never called by the sources (it samples the link for ~20 ms per call): measured to
    # show what the byte-counter fields save; fewer of them
    for direction in ("NVML_PCIE_UTIL_TX_BYTES", "NVML_PCIE_UTIL_RX_BYTES"):
        name = "nvmlDeviceGetPcieThroughput"
        calls.append((f"{name}({direction})", name, (handle, getattr(nv, direction)), 8))
    for name in ("nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo_v3"):
        calls.append((name, name, (handle,), 10))  # identity, read once per GPU
    fields = "nvmlDeviceGetFieldValues"
    calls.append((f"{fields}(FIELDS)", fields, (handle, batch(nv, handle)), 30))
    calls.append(("nvmlDeviceGetNvLinkState(0)", "nvmlDeviceGetNvLinkState", (handle, 0), 30))
    calls.append(
        ("nvmlDeviceGetSupportedEventTypes", "nvmlDeviceGetSupportedEventTypes", (handle,), 10)
    )
    # the processes source (v3, then v2; compute and graphics) and the probe source
    for name in (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    ):
        calls.append((name, name, (handle,), 30))
    # MIG (issue 26) and the SM count (issue 22's NCCL bound): how the real driver answers
    # on a GPU with MIG off; never called by the sources yet
    for name in (
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceIsMigDeviceHandle",
        "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetNumGpuCores",
    ):
        calls.append((name, name, (handle,), 5))
    calls.append(
        ("nvmlDeviceGetMigDeviceHandleByIndex(0)", "nvmlDeviceGetMigDeviceHandleByIndex",
         (handle, 0), 3)
    )
    profile = getattr(nv, "NVML_GPU_INSTANCE_PROFILE_1_SLICE", 0)
    calls.append(
        ("nvmlDeviceGetGpuInstanceProfileInfo(1_SLICE)", "nvmlDeviceGetGpuInstanceProfileInfo",
         (handle, profile), 3)
    )
    seen: set[str] = set()
    for call in calls:
        if call[0] not in seen:
            seen.add(call[0])
            yield call


def nvml_facts(nv: Any, path: Path) -> dict[str, Any]:
    """Versions and per-call latencies, written to `path` after every GPU (partial runs
    still leave what they measured)."""
    from gpuwatchd.sources.nvmlapi import cuda_version_string, sysfs_bus_id

    facts: dict[str, Any] = {"binding": getattr(nv, "__file__", nv.__name__), "gpus": []}
    try:
        from importlib.metadata import version

        facts["nvidia_ml_py"] = version("nvidia-ml-py")
    except Exception as e:
        facts["nvidia_ml_py"] = f"unknown: {e}"
    timer = Timer(nv)
    start = time.perf_counter()
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        facts["init_error"] = timer.codes.get(e.value, str(e))
        write_json(path, facts)
        return facts
    facts["init_seconds"] = round(time.perf_counter() - start, 4)
    try:
        system = [
            timer.measure(n, n, (), reps=10)
            for n in (
                "nvmlSystemGetDriverVersion",
                "nvmlSystemGetCudaDriverVersion",
                "nvmlSystemGetNVMLVersion",
                "nvmlDeviceGetCount",
            )
        ]
        facts["system_calls"] = system
        values = {r["function"]: r.get("value") for r in system}
        facts["driver_version"] = values.get("nvmlSystemGetDriverVersion")
        cuda = values.get("nvmlSystemGetCudaDriverVersion")
        facts["cuda_driver_version"] = cuda_version_string(cuda) if cuda else None
        facts["nvml_version"] = values.get("nvmlSystemGetNVMLVersion")
        count = values.get("nvmlDeviceGetCount") or 0
        for index in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                pci_info = getattr(nv, "nvmlDeviceGetPciInfo_v3", None) or nv.nvmlDeviceGetPciInfo
                gpu: dict[str, Any] = {
                    "index": index,
                    "uuid": describe(nv.nvmlDeviceGetUUID(handle)),
                    "name": describe(nv.nvmlDeviceGetName(handle)),
                    "pci_bus_id": sysfs_bus_id(describe(pci_info(handle).busId)),
                    "calls": [],
                }
            except nv.NVMLError as e:  # a GPU that cannot be identified: say so, go on
                facts.setdefault("gpu_errors", {})[index] = timer.codes.get(e.value, str(e))
                continue
            facts["gpus"].append(gpu)
            for label, name, args, reps in nvml_calls(nv, handle):
                gpu["calls"].append(timer.measure(label, name, args, reps))
                write_json(path, facts)
            gpu["calls"] += event_calls(nv, handle, timer)
            gpu["fields_alone"] = [  # which fields make the batch cost what it does
                timer.measure(f"nvmlDeviceGetFieldValues([{fid}, scope {scope}])",
                              "nvmlDeviceGetFieldValues", (handle, [(fid, scope)]), reps=10)
                for fid, scope in batch(nv, handle)
            ]  # fmt: skip
            gpu["nvlinks"] = count_nvlinks(nv, handle)
            gpu["pcie_throughput_blocking_ms"] = [
                round(r["median_us"] / 1000, 2)
                for r in gpu["calls"]
                if r["function"] == "nvmlDeviceGetPcieThroughput" and "median_us" in r
            ]
            gpu["poll_estimate_ms"] = poll_estimate_ms(gpu)
            write_json(path, facts)
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()
    write_json(path, facts)
    return facts


def event_calls(nv: Any, handle: Any, timer: Timer) -> list[dict[str, Any]]:
    """The Xid event set as the nvml source uses it: created and registered once, then
    drained with a 0 ms wait every poll (NVML_ERROR_TIMEOUT: nothing pending)."""
    rows = [timer.measure("nvmlEventSetCreate", "nvmlEventSetCreate", (), reps=1)]
    try:
        event_set = nv.nvmlEventSetCreate()
    except nv.NVMLError:
        return rows
    try:
        xid = nv.nvmlEventTypeXidCriticalError
        rows.append(timer.measure("nvmlDeviceRegisterEvents(Xid)", "nvmlDeviceRegisterEvents",
                                  (handle, xid, event_set), reps=1))  # fmt: skip
        wait = "nvmlEventSetWait_v2" if hasattr(nv, "nvmlEventSetWait_v2") else "nvmlEventSetWait"
        times, answers = [], set()
        for _ in range(30):
            start = time.perf_counter()
            try:
                getattr(nv, wait)(event_set, 0)
                answers.add("event")
            except nv.NVMLError as e:
                answers.add(timer.codes.get(e.value, str(e.value)))
            times.append(time.perf_counter() - start)
        times.sort()
        rows.append({"call": f"{wait}(0 ms)", "function": wait, "answers": sorted(answers),
                     "calls": len(times), "min_us": round(times[0] * 1e6, 1),
                     "median_us": round(statistics.median(times) * 1e6, 1),
                     "max_us": round(times[-1] * 1e6, 1)})  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlEventSetFree(event_set)
    return rows


def batch(nv: Any, handle: Any) -> list[tuple[int, int]]:
    """The nvml source's field-values request for this GPU: FIELDS, and each NVLink's
    state (as many links as NVML_FI_DEV_NVLINK_LINK_COUNT says)."""
    from gpuwatchd.sources.nvml.reads import FIELDS, NVLINK_COUNT, NVLINK_STATE

    ids = [(getattr(nv, f.constant), 0) for f in FIELDS if hasattr(nv, f.constant)]
    links = 0
    with contextlib.suppress(Exception):
        (count,) = nv.nvmlDeviceGetFieldValues(handle, [getattr(nv, NVLINK_COUNT)])
        links = int(count.value.ullVal) if count.nvmlReturn == 0 else 0
    state = getattr(nv, NVLINK_STATE.constant, None)
    return ids + ([(state, link) for link in range(links)] if state is not None else [])


def count_nvlinks(nv: Any, handle: Any) -> int | str:
    """Links 0..N-1 answer nvmlDeviceGetNvLinkState, as the nvml source counts them."""
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            nv.nvmlDeviceGetNvLinkState(handle, link)
        except nv.NVMLError as e:
            return link if link else f"none ({e})"
    return int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))


def poll_estimate_ms(gpu: dict[str, Any]) -> float:
    """What one nvml-source poll of this GPU costs: the median of each call it makes,
    a slow read's share (1 / its cadence), the field values and the event drain."""
    from gpuwatchd.sources.nvml.reads import READS

    rows = {r["call"]: r for r in gpu["calls"]}
    total = 0.0
    for read in READS:
        if not read.every:  # read once
            continue
        for name in read.functions:
            row = rows.get(name + "".join(f"({a})" for a in read.args))
            if row and "median_us" in row and row.get("error") != "NVML_ERROR_FUNCTION_NOT_FOUND":
                total += row["median_us"] / read.every
                break
    fields = rows.get("nvmlDeviceGetFieldValues(FIELDS)", {})
    total += fields.get("median_us", 0.0)
    for label, row in rows.items():
        if label.startswith("nvmlEventSetWait"):
            total += row.get("median_us", 0.0)
    return round(total / 1000, 2)


# -- facts: PCIe ---------------------------------------------------------------------------

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_SYSFS_LINK = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
_LSPCI_KEYS = ("LnkCap:", "LnkSta:", "LnkCap2:", "LnkSta2:", "LnkCtl2:")


def pcie_facts(bus_ids: list[str], sysfs: Path, results: Path) -> dict[str, Any]:
    """Each GPU's path to its root port: sysfs link attributes and lspci's Lnk* lines."""
    lspci = shutil.which("lspci")
    out: dict[str, Any] = {"lspci": lspci or "absent", "gpus": {}}
    texts: list[str] = []
    for bus_id in bus_ids:
        device = sysfs / "bus" / "pci" / "devices" / bus_id
        if not device.exists():
            out["gpus"][bus_id] = {"error": f"{device} not found"}
            continue
        chain = [p for p in Path(os.path.realpath(device)).parts if _BDF.match(p)]
        path = []
        for bdf in chain:  # root port first, the GPU last
            entry: dict[str, Any] = {"bdf": bdf, "role": "gpu" if bdf == bus_id else "bridge"}
            for name in _SYSFS_LINK:
                with contextlib.suppress(OSError):
                    entry[name] = (
                        (sysfs / "bus" / "pci" / "devices" / bdf / name).read_text().strip()
                    )
            if lspci:
                text = run_text([lspci, "-vv", "-s", bdf], timeout=15)
                texts.append(f"### lspci -vv -s {bdf}\n{text}")
                lines = [
                    ln.strip() for ln in text.splitlines() if ln.strip().startswith(_LSPCI_KEYS)
                ]
                entry["lspci"] = lines or ["(no Lnk* lines: capabilities not readable?)"]
            path.append(entry)
        out["gpus"][bus_id] = path
    if texts:
        (results / "lspci.txt").write_text("\n".join(texts))
    write_json(results / "pcie.json", out)
    return out


def nvidia_functions(sysfs: Path) -> list[str]:
    """PCI functions of NVIDIA display/3D controllers (vendor 0x10de, class 0x03xxxx)."""
    found = []
    for device in sorted((sysfs / "bus" / "pci" / "devices").glob("*")):
        with contextlib.suppress(OSError):
            vendor = (device / "vendor").read_text().strip()
            klass = (device / "class").read_text().strip()
            if vendor == "0x10de" and klass.startswith("0x03"):
                found.append(device.name)
    return found


def run_text(command: list[str], timeout: float) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(failed: {e})"
    return done.stdout + (f"\n(stderr) {done.stderr}" if done.stderr.strip() else "")


def cmd_facts(args: argparse.Namespace) -> int:
    results = Path(args.results)
    node = None
    if args.simulate:
        from gpuwatchd.sim.node import SimNode
        from gpuwatchd.sim.scenario import load_scenario

        node = SimNode(load_scenario(args.simulate), virtual=False)
        nv, sysfs = node.pynvml, node.root / "sys"
    else:
        import pynvml as nv

        sysfs = Path("/sys")
    try:
        facts = nvml_facts(nv, results / "nvml.json")
        if not facts["gpus"] and not args.simulate:  # NVML gave none: NVIDIA functions in sysfs
            facts["gpus"] = [{"pci_bus_id": b} for b in nvidia_functions(sysfs)]
        pcie_facts([g["pci_bus_id"] for g in facts["gpus"]], sysfs, results)
    finally:
        if node is not None:
            node.close()
    return 0 if facts["gpus"] else 1


# -- setup: rules, config, the dry run's simulated node --------------------------------------

_QUOTED_DURATION = re.compile(r"'((?:\d+(?:\.\d+)?(?:ms|s|m|h))+)'")


def experiment_rules(
    for_cap: float, keep_cap: float, window_scale: float = 1.0, min_window: float = 2.0
) -> dict[str, Any]:
    """The default rules with `for` and `keep_firing_for` capped (seconds) so that each
    phase of a few minutes shows a cause firing and resolving; with window_scale < 1
    (the dry run only) every window literal shrinks too, to no less than min_window."""
    from importlib.resources import files

    import yaml

    from gpuwatchd.config import parse_duration

    data = yaml.safe_load((files("gpuwatchd.rules") / "default.yaml").read_text())

    def window(match: re.Match[str]) -> str:
        seconds = max(min_window, parse_duration(match.group(1)) * window_scale)
        return f"'{seconds:g}s'"

    for rule in data["rules"]:
        for key, cap in (("for", for_cap), ("keep_firing_for", keep_cap)):
            if key in rule:
                rule[key] = f"{min(parse_duration(rule[key]), cap):g}s"
        if window_scale != 1.0:
            for key in ("expr", "summary"):
                rule[key] = _QUOTED_DURATION.sub(window, rule[key])
    return data


def dryrun_scenario(lead: float, phase: float) -> dict[str, Any]:
    """A simulated one-H200 node whose timeline follows validate.sh's dry run: idle for
    `lead` seconds, then healthy / starved (num_workers=0) / healthy, `phase` each."""
    pid = 4242
    busy = {
        "pstate": 0,
        "clock_event_reasons": [],
        "utilization_gpu": 95,
        "utilization_memory": 40,
        "memory_used_mib": 20000,
        "power_w": 600,
        "sm_clock_mhz": 1980,
        "pcie_rx_mb_s": 300,
        "processes": [{"pid": pid, "name": "python3", "gpu_memory_mib": 20000}],
    }
    probe = {
        "step_seconds": 0.03,
        "wait_fraction": 0.03,
        "num_workers": 12,
        "pin_memory": True,
        "prefetch_factor": 4,
        "persistent_workers": False,
        "batch_size": 128,
        "cuda_device": 0,
        "reserved_mib": 8000,
        "allocated_mib": 6000,
        "largest_free_block_mib": 1500,
        "cuda_init_seconds": 0.4,
    }
    healthy_host = {
        "processes": {
            pid: {"main_thread_cpu_percent": 100, "workers": 12, "worker_cpu_percent": 30}
        },
        "probe": {pid: probe},
    }
    return {
        "name": "hardware-dry-run",
        "description": "validate.sh --dry-run: one simulated H200 following the training's phases",
        "node": {
            "hostname": "sim-h200",
            "gpu_model": {
                "name": "NVIDIA H200",
                "pci_device_id": 0x2335,
                "memory_total_mib": 143771,
                "power_limit_w": 700,
                "max_sm_clock_mhz": 1980,
                "max_mem_clock_mhz": 3201,
                "pcie_max_gen": 5,
                "nvlinks": 18,
            },
            "gpu_count": 1,
            "pcie_topology": "direct",
            "cpus": 16,
            "numa_nodes": 1,
            "dcgm": "none",
        },
        "phases": [
            {"name": "idle", "duration": f"{lead:g}s", "set": {"pstate": 8}},
            {"name": PHASES[0], "duration": f"{phase:g}s", "set": busy, "host": healthy_host},
            {
                "name": PHASES[1],
                "duration": f"{phase:g}s",
                "set": {**busy, "utilization_gpu": 12, "power_w": 200},
                "host": {
                    "processes": {pid: {"main_thread_cpu_percent": 100, "workers": 0}},
                    "probe": {pid: {**probe, "num_workers": 0, "wait_fraction": 0.85}},
                },
            },
            {"name": PHASES[2], "duration": f"{phase:g}s", "set": busy, "host": healthy_host},
            {"name": "after", "duration": "10m", "set": {**busy, "utilization_gpu": 0}},
        ],
    }


def cmd_setup(args: argparse.Namespace) -> int:
    import yaml

    results = Path(args.results)
    dry = args.dry_run
    # the dry run's phases last seconds: windows shrink 20x (1m -> 3s), `for` to 1 s
    rules = experiment_rules(
        for_cap=1.0 if dry else args.for_cap,
        keep_cap=1.0 if dry else args.keep_cap,
        window_scale=0.05 if dry else 1.0,
    )
    header = (
        "# gpuwatchd's default rules for the hardware experiment (bench/hardware/experiment.py"
        f" setup): `for` capped at {1.0 if dry else args.for_cap:g}s and `keep_firing_for` at "
        f"{1.0 if dry else args.keep_cap:g}s"
        + (", windows scaled by 0.05 (dry run)" if dry else "; windows as shipped")
        + "\n"
    )
    (results / "rules.yaml").write_text(
        header + yaml.safe_dump(rules, sort_keys=False, width=1000, allow_unicode=True)
    )
    config: dict[str, Any] = {
        "listen": "127.0.0.1:9766",  # `run` passes --listen with a free port
        "evaluation_interval": "1s",
        "rules_file": str((results / "rules.yaml").resolve()),
        "sources": {"probe": {"socket": str(Path(args.socket).resolve())}},
        # each source's poll duration is detail-only since issue 46: the report reads it
        "detail_metrics": True,
    }
    if dry:  # the scaled windows need the processes source's readings more often
        config["sources"]["processes"] = {"interval": "1s"}
    (results / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if dry:
        scenario = dryrun_scenario(args.lead, args.phase_seconds)
        (results / "scenario.yaml").write_text(yaml.safe_dump(scenario, sort_keys=False))
    return 0


# -- run: the daemon, the training loop, scrapes and /proc samples --------------------------


class Events:
    """experiment.jsonl: what the orchestrator did, with wall-clock times."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)

    def add(self, kind: str, **data: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), "event": kind, **data}, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


class Scraper:
    """GET /metrics into one gzip stream; each scrape is preceded by a marker line."""

    def __init__(self, url: str, path: Path) -> None:
        self.url = url
        self._file = gzip.open(path, "wt", compresslevel=6)  # noqa: SIM115 - open for the run
        self.count = self.failed = 0

    def scrape(self) -> None:
        t = time.time()
        try:
            with urllib.request.urlopen(self.url, timeout=2) as response:
                body = response.read().decode()
            self._file.write(f"{SCRAPE_MARK}{t:.3f} ok\n{body}")
            self.count += 1
        except Exception as e:
            self._file.write(f"{SCRAPE_MARK}{t:.3f} failed {type(e).__name__}: {e}\n")
            self.failed += 1
        if (self.count + self.failed) % 10 == 0:
            self._file.flush()  # a sync flush: a run cut short still leaves readable scrapes

    def close(self) -> None:
        self._file.close()


class Sampler:
    """The daemon's CPU seconds, RSS and threads from /proc/<pid>, one row a sample."""

    def __init__(self, pid: int, path: Path) -> None:
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")
        self._file = path.open("w", buffering=1)
        self._file.write("t,cpu_seconds,rss_bytes,threads\n")

    def sample(self) -> None:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
            status = Path(f"/proc/{self.pid}/status").read_text()
        except (OSError, ValueError, IndexError):
            return
        rss = threads = 0
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        self._file.write(f"{time.time():.3f},{cpu:.2f},{rss},{threads}\n")

    def close(self) -> None:
        self._file.close()


def every_second(until: Callable[[], bool], deadline: float, work: Callable[[], None]) -> None:
    """Call `work` once a second (on the second after start) until `until()` or deadline."""
    next_at = time.monotonic()
    while not until() and time.time() < deadline:
        work()
        next_at += 1.0
        if next_at < time.monotonic():
            next_at = time.monotonic()  # behind (a slow scrape): no catching up in bursts
        while time.monotonic() < next_at and not until():  # notice an exit within 0.1 s
            time.sleep(min(0.1, max(0.0, next_at - time.monotonic())))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_daemon(url: str, daemon: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll url/metrics until it answers 200 (bounded), or the daemon exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and daemon.poll() is None:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + "/metrics", timeout=2) as response,
        ):
            if response.status == 200:
                return True
        time.sleep(0.2)
    return False


def stop(process: subprocess.Popen[bytes] | None, name: str, events: Events) -> None:
    """SIGTERM to the process's group (its own session), SIGKILL after 15 s."""
    if process is None or process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    events.add("stopped", process=name, signal=sig.name, returncode=process.poll())


def fit_phases(spec: str, available: float) -> list[float]:
    """The phases' seconds ("a,b,c" or one for all), shrunk alike to fit `available`
    (what the budget leaves after the steps before ran long, less start-up and stop)."""
    seconds = [float(x) for x in spec.split(",")]
    seconds = seconds * 3 if len(seconds) == 1 else seconds
    scale = min(1.0, max(0.1, available / sum(seconds)))
    return [round(x * scale, 1) for x in seconds]


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds to the finally that stops the children


def cmd_run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    results = Path(args.results)
    deadline = time.time() + args.budget
    events = Events(results / "experiment.jsonl")
    events.add("start", args=vars(args))
    daemon = train = None
    scraper: Scraper | None = None
    sampler: Sampler | None = None
    pids = Path(args.pid_dir) if args.pid_dir else None
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "gpuwatchd", "run", "--config", args.config]
        command += ["--listen", f"127.0.0.1:{port}"]
        if args.simulate:
            command += ["--simulate", args.simulate]
        daemon_log = results / "daemon.log"
        with daemon_log.open("wb") as log:
            daemon = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        if pids:
            (pids / "daemon.pid").write_text(str(daemon.pid))
        events.add("daemon_started", pid=daemon.pid, command=command)
        if not wait_for_daemon(url, daemon, timeout=60):
            events.add("daemon_not_ready", returncode=daemon.poll())
            return 1
        ready = time.time()
        events.add("daemon_ready", url=url)
        socket = Path(args.socket)
        events.add("probe_socket", path=str(socket), bound=socket.is_socket())
        scraper = Scraper(url + "/metrics", results / "scrapes.txt.gz")
        sampler = Sampler(daemon.pid, results / "resources.csv")

        def tick() -> None:
            assert sampler is not None and scraper is not None
            sampler.sample()
            scraper.scrape()

        # the daemon alone, the GPU idle: its baseline cost
        events.add("idle_start")
        every_second(lambda: False, min(deadline, time.time() + args.idle_seconds), tick)
        events.add("idle_end")

        # what the training needs besides its phases: start-up (torch, CUDA, calibration:
        # the dry run's lead), its exit, the tail and the stops
        overhead = (45.0 if args.lead is None else args.lead) + 20.0 + args.tail_seconds
        phases = fit_phases(args.phase_seconds, deadline - time.time() - overhead)
        events.add("phases", seconds=phases)
        train_cmd = [
            sys.executable,
            str(HERE / "train.py"),
            "--device",
            args.device,
            "--phase-seconds",
            ",".join(f"{x:g}" for x in phases),
            "--events",
            str(results / "train.jsonl"),
        ]
        if args.lead is not None:  # the dry run: keep in step with the simulated timeline
            train_cmd += ["--start-at", f"{ready + args.lead:.3f}"]
        env = {**os.environ, "GPUWATCHD_PROBE_SOCKET": str(socket), "PYTHONUNBUFFERED": "1"}
        with (results / "train.log").open("wb") as log:
            train = subprocess.Popen(
                train_cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        if pids:
            (pids / "train.pid").write_text(str(train.pid))
        events.add("train_started", pid=train.pid, command=train_cmd)
        every_second(lambda: train.poll() is not None, deadline - args.tail_seconds - 20, tick)
        if train.poll() is None:
            events.add("train_overran", note="stopped at the run's deadline")
            stop(train, "train", events)
        events.add("train_ended", returncode=train.returncode)
        every_second(lambda: False, min(deadline, time.time() + args.tail_seconds), tick)
        return 0 if train.returncode == 0 else 1
    finally:
        stop(train, "train", events)
        stop(daemon, "daemon", events)
        if scraper is not None:
            events.add("scrapes", ok=scraper.count, failed=scraper.failed)
            scraper.close()
        if sampler is not None:
            sampler.close()
        events.add("end")
        events.close()


# -- analyze ----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
KEEP = re.compile(
    r"^gpuwatchd_(starvation_active|starvation_pending|gpu_utilization_ratio|gpu_info|probe_\w+"
    r"|source_up|source_duration_seconds|gpu_process_busiest_thread_cpu_ratio"
    r"|gpu_process_workers|gpu_compute_processes)\b"
)


def read_scrapes(path: Path) -> list[dict[str, Any]]:
    """Each scrape as {t, ok, series: [(name, labels, value)]}, only the series kept."""
    scrapes: list[dict[str, Any]] = []
    if not path.exists():
        return scrapes
    current: dict[str, Any] | None = None
    try:
        with gzip.open(path, "rt", errors="replace") as f:
            for line in f:
                if line.startswith(SCRAPE_MARK):
                    t, status = line[len(SCRAPE_MARK) :].split(maxsplit=1)
                    current = {"t": float(t), "ok": status.startswith("ok"), "series": []}
                    scrapes.append(current)
                elif current is not None and KEEP.match(line):
                    m = _SAMPLE.match(line)
                    if m:
                        labels = dict(_LABEL.findall(m.group(2) or ""))
                        current["series"].append((m.group(1)[10:], labels, float(m.group(3))))
    except (EOFError, OSError):  # a run cut short: the stream ends mid-block
        pass
    return scrapes


def condense(scrape: dict[str, Any]) -> dict[str, Any]:
    """One scrape as the timeline's row: firing/pending causes, GPU use, probe counters."""
    row: dict[str, Any] = {"t": scrape["t"], "ok": scrape["ok"], "firing": [], "pending": []}
    gpus: dict[str, dict[str, Any]] = {}
    for name, labels, value in scrape["series"]:
        gpu = labels.get("gpu")
        if name == "starvation_active" and value == 1:
            row["firing"].append(f"{labels['cause']}/{labels['dimension']}@{gpu}")
        elif name == "starvation_pending" and value == 1:
            row["pending"].append(f"{labels['cause']}@{gpu}")
        elif name in ("source_up", "source_duration_seconds"):
            row.setdefault(name, {})[labels["source"]] = value
        elif name == "gpu_info":
            gpus.setdefault(gpu, {})["uuid"] = labels.get("uuid")
        elif gpu is not None and name != "starvation_active" and name != "starvation_pending":
            gpus.setdefault(gpu, {})[name] = value
        elif gpu is None and name.startswith("probe_"):
            key = name + (f"{{{labels['result']}}}" if "result" in labels else "")
            row[key] = value
    row["gpus"] = gpus
    return row


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def intervals(timeline: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Spans over which each entry of `key` (firing or pending) was present."""
    open_at: dict[str, float] = {}
    spans: list[dict[str, Any]] = []
    last_t = None
    for row in timeline:
        if not row["ok"]:
            continue
        now = set(row[key])
        for item in now - open_at.keys():
            open_at[item] = row["t"]
        for item in list(open_at.keys() - now):
            spans.append({"what": item, "start": open_at.pop(item), "end": row["t"]})
        last_t = row["t"]
    for item, start in open_at.items():
        spans.append({"what": item, "start": start, "end": last_t, "open": True})
    return sorted(spans, key=lambda s: s["start"])


def phase_of(t: float, windows: list[tuple[str, float, float]]) -> str:
    for name, start, end in windows:
        if start <= t < end:
            return name
    return "outside"


def probe_ratio(rows: list[dict[str, Any]], gpu: str = "0") -> float | None:
    """Δwait / Δcompute of the daemon's probe counters over these scrapes."""
    have = [r["gpus"].get(gpu, {}) for r in rows]
    have = [
        g for g in have if "probe_wait_seconds_total" in g and "probe_compute_seconds_total" in g
    ]
    if len(have) < 2:
        return None
    wait = have[-1]["probe_wait_seconds_total"] - have[0]["probe_wait_seconds_total"]
    compute = have[-1]["probe_compute_seconds_total"] - have[0]["probe_compute_seconds_total"]
    return round(wait / compute, 3) if compute > 0 else None


def mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def daemon_cost(resources: list[tuple[float, float, int, int]], start: float, end: float) -> dict:
    rows = [r for r in resources if start <= r[0] <= end]
    cores = [
        (b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(rows, rows[1:], strict=False) if b[0] > a[0]
    ]
    return {
        "cpu_cores_mean": mean(cores),
        "cpu_cores_p95": round(sorted(cores)[int(0.95 * (len(cores) - 1))], 4) if cores else None,
        "rss_mib_max": round(max(r[2] for r in rows) / 2**20, 1) if rows else None,
        "threads": max(r[3] for r in rows) if rows else None,
    }


def read_resources(path: Path) -> list[tuple[float, float, int, int]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines()[1:]:
            with contextlib.suppress(ValueError):
                t, cpu, rss, threads = line.split(",")
                rows.append((float(t), float(cpu), int(rss), int(threads)))
    return rows


def read_steps(path: Path) -> list[dict[str, Any]]:
    steps = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 4:
                steps.append(
                    {"step": parts[0], "status": parts[1], "rc": parts[2], "seconds": parts[3]}
                )
    return steps


def judge_phase(
    name: str, start: float, end: float, spans: list[dict[str, Any]], settle: float
) -> dict[str, Any]:
    """Expected vs observed for one phase, from the firing spans (cause/dimension@gpu)."""

    def firing_in(lo: float, hi: float) -> list[dict[str, Any]]:
        return [s for s in spans if s["start"] < hi and (s["end"] or hi) > lo]

    def cause(span: dict[str, Any]) -> tuple[str, str]:
        what = span["what"].split("@")[0]
        c, _, dim = what.partition("/")
        return c, dim

    seen = firing_in(start, end)
    observed = sorted({cause(s)[0] for s in seen})
    input_seen = sorted({cause(s)[0] for s in seen if cause(s)[1] == "input"})
    verdict: dict[str, Any] = {"observed": observed, "observed_input": input_seen}
    if name == PHASES[1]:
        hit = sorted(set(input_seen) & set(EXPECTED_IN_B))
        verdict["expected"] = " and/or ".join(EXPECTED_IN_B) + " fire"
        verdict["pass"] = bool(hit)
        firsts = {
            cause(s)[0]: round(max(s["start"], start) - start, 1)
            for s in reversed(seen)
            if cause(s)[0] in EXPECTED_IN_B
        }
        verdict["first_firing_after_s"] = firsts
    else:
        lo = start + (settle if name == PHASES[2] else 0.0)
        late = sorted({cause(s)[0] for s in firing_in(lo, end) if cause(s)[1] == "input"})
        verdict["expected"] = "no input cause fires" + (
            f" after the first {settle:g}s (windows still hold phase b)" if lo > start else ""
        )
        verdict["judged_from_s"] = round(lo - start, 1)
        verdict["input_firing_when_judged"] = late
        # how long each input cause carried on into the phase (c: phase b's windows)
        verdict["input_until_s"] = {
            cause(s)[0]: round(min(s["end"] or end, end) - start, 1)
            for s in seen
            if cause(s)[1] == "input"
        }
        verdict["pass"] = not late
    return verdict


def cmd_analyze(args: argparse.Namespace) -> int:
    results = Path(args.results)
    scrapes = read_scrapes(results / "scrapes.txt.gz")
    timeline = [condense(s) for s in scrapes]
    with (results / "timeline.jsonl").open("w") as f:
        for row in timeline:
            f.write(json.dumps(row) + "\n")
    train = load_jsonl(results / "train.jsonl")
    experiment = load_jsonl(results / "experiment.jsonl")
    resources = read_resources(results / "resources.csv")
    spans = intervals(timeline, "firing")
    pending = intervals(timeline, "pending")

    starts = {e["phase"]: e for e in train if e.get("event") == "phase_start"}
    ends = {e["phase"]: e for e in train if e.get("event") == "phase_end"}
    windows = [
        (name, starts[name]["t"], ends[name]["t"] if name in ends else starts[name]["t"] + 1e9)
        for name in PHASES
        if name in starts
    ]
    first = min((w[1] for w in windows), default=None)
    idle = [e["t"] for e in experiment if e.get("event") in ("idle_start", "idle_end")]
    marks = list(windows)
    if len(idle) == 2:
        marks.insert(0, ("idle", idle[0], idle[1]))
    if first is not None and len(idle) == 2:
        marks.insert(1, ("startup", idle[1], first))

    gpu = training_gpu(timeline)
    mine = [s for s in spans if s["what"].endswith(f"@{gpu}")]  # judged: the training's GPU
    phases = []
    for name, start, end in marks:
        rows = [r for r in timeline if start <= r["t"] < end and r["ok"]]
        entry: dict[str, Any] = {
            "name": name,
            "start": start,
            "seconds": round(end - start, 1) if end < 1e12 else None,
            "scrapes": len(rows),
            "gpu_utilization_mean": mean(
                [
                    r["gpus"][gpu]["gpu_utilization_ratio"]
                    for r in rows
                    if "gpu_utilization_ratio" in r["gpus"].get(gpu, {})
                ]
            ),
            "probe_ratio_daemon": probe_ratio(rows, gpu),
            "daemon": daemon_cost(resources, start, end),
        }
        if name in ends:
            e = ends[name]
            entry["probe_ratio_train"] = e.get("ratio")
            entry["train"] = {k: e.get(k) for k in ("batches", "batches_per_s", "loader", "probe")}
            entry["cuda"] = e.get("cuda")
        if name in PHASES:
            entry["verdict"] = judge_phase(name, start, end, mine, args.settle)
            enough = len(rows) >= 0.5 * (end - start)  # a scrape a second, at least half
            if not enough:
                entry["verdict"]["pass"] = False
                entry["verdict"]["why"] = f"only {len(rows)} scrapes"
        phases.append(entry)

    span = (windows[0][1], windows[-1][2]) if windows else (0.0, 0.0)
    judged = [p for p in phases if "verdict" in p]
    verdict = "PASS" if len(judged) == 3 and all(p["verdict"]["pass"] for p in judged) else "FAIL"
    summary: dict[str, Any] = {
        "mode": args.mode,
        "verdict": verdict,
        "phases": phases,
        "causes": [
            {**s, "phase": phase_of(s["start"], marks), "offset_s": offset(s["start"], marks)}
            for s in spans
        ],
        "pending": [{**s, "phase": phase_of(s["start"], marks)} for s in pending],
        "scrapes": {
            "ok": sum(r["ok"] for r in timeline),
            "failed": sum(not r["ok"] for r in timeline),
        },
        # from phase a on: the first scrapes may come before a source's first poll
        "sources": source_health([r for r in timeline if span[0] <= r["t"] <= span[1]]),
        "gpu": gpu,
        "probe": probe_checks(timeline, train, gpu),
        "facts": facts_headline(results),
        "steps": read_steps(results / "steps.tsv"),
        "daemon_whole_run": daemon_cost(resources, 0, 1e12),
        # the phases' planned seconds (shrunk if the steps before ran long)
        "phases_planned": next(
            (e["seconds"] for e in experiment if e.get("event") == "phases"), None
        ),
    }
    summary["checks"] = checks(summary)
    write_json(results / "summary.json", summary)
    (results / "summary.txt").write_text(format_summary(summary))
    return 0


def offset(t: float, windows: list[tuple[str, float, float]]) -> float | None:
    for _, start, end in windows:
        if start <= t < end:
            return round(t - start, 1)
    return None


def source_health(timeline: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in timeline:
        for source, up in row.get("source_up", {}).items():
            s = out.setdefault(source, {"up": 0, "down": 0, "durations": []})
            s["up" if up == 1 else "down"] += 1
            d = row.get("source_duration_seconds", {}).get(source)
            if d is not None:
                s["durations"].append(d)
    for s in out.values():
        d = sorted(s.pop("durations"))
        s["poll_ms_median"] = round(statistics.median(d) * 1000, 2) if d else None
        s["poll_ms_max"] = round(d[-1] * 1000, 2) if d else None
    return out


def training_gpu(timeline: list[dict[str, Any]]) -> str:
    """The GPU the probed training process is on (the one lent machine has one: "0")."""
    counts: dict[str, int] = {}
    for row in timeline:
        for gpu, values in row["gpus"].items():
            if "probe_pid" in values:
                counts[gpu] = counts.get(gpu, 0) + 1
    return max(counts, key=lambda g: counts[g]) if counts else "0"


def running(t: float, train: list[dict[str, Any]]) -> bool:
    """Whether `t` falls between the training's first phase start and last phase end."""
    starts = [e["t"] for e in train if e.get("event") == "phase_start"]
    ends = [e["t"] for e in train if e.get("event") == "phase_end"]
    return bool(starts and ends) and min(starts) <= t <= max(ends)


def probe_checks(
    timeline: list[dict[str, Any]], train: list[dict[str, Any]], gpu: str
) -> dict[str, Any]:
    """Did the training's reports reach the daemon and land on the GPU, with CUDA parts?"""
    last = next((r for r in reversed(timeline) if r["ok"]), {})
    busy = [r for r in timeline if r["ok"] and "probe_pid" in r["gpus"].get(gpu, {})]
    daemon_gpu = busy[-1]["gpus"][gpu] if busy else {}
    cuda_series = {k: v for k, v in sorted(daemon_gpu.items()) if k.startswith("probe_cuda_")}
    cuda_event = next((e for e in train if e.get("event") == "cuda"), {})
    start_event = next((e for e in train if e.get("event") == "start"), {})
    final = next((e for e in reversed(train) if e.get("event") == "phase_end"), {})
    allocator = final.get("cuda") or {}
    return {
        "train_pid": start_event.get("pid"),
        "daemon_probe_pid": daemon_gpu.get("probe_pid"),
        "reports_accepted": last.get("probe_reports_total{accepted}"),
        "reports_by_result": {
            k: v for k, v in last.items() if k.startswith("probe_reports_total{")
        },
        # while the loop ran: its last reports outlive it (until they expire) once it
        # exits and NVML no longer lists it (seen on the H200, 2026-12-04)
        "unplaced_processes_max": max(
            (r.get("probe_unplaced_processes", 0) for r in timeline if running(r["t"], train)),
            default=None,
        ),
        "train_probe_counts": (final.get("probe") or {}),
        "daemon_cuda_series": cuda_series,
        "train_cuda": cuda_event,
        "daemon_gpu_uuid": daemon_gpu.get("uuid")
        or next(
            (g.get("uuid") for r in timeline for g in r["gpus"].values() if g.get("uuid")), None
        ),
        # the same quantities seen by the training process and by the daemon (the
        # daemon's are the last report before the run ended, the training's at its end)
        "cuda_compare": {
            "init_seconds": (
                cuda_event.get("probe_init_seconds"),
                cuda_series.get("probe_cuda_init_seconds"),
            ),
            "first_cuda_call_seconds": cuda_event.get("first_cuda_call_seconds"),
            "reserved_bytes": (
                allocator.get("reserved_bytes"),
                cuda_series.get("probe_cuda_reserved_bytes"),
            ),
            "allocated_bytes": (
                allocator.get("allocated_bytes"),
                cuda_series.get("probe_cuda_allocated_bytes"),
            ),
            "largest_free_block_bytes": (
                allocator.get("largest_free_block_bytes"),
                cuda_series.get("probe_cuda_largest_free_block_bytes"),
            ),
            "alloc_retries": (
                allocator.get("alloc_retries"),
                cuda_series.get("probe_cuda_alloc_retries_total"),
            ),
        },
    }


def facts_headline(results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        nvml = json.loads((results / "nvml.json").read_text())
        out["driver_version"] = nvml.get("driver_version")
        out["cuda_driver_version"] = nvml.get("cuda_driver_version")
        out["nvidia_ml_py"] = nvml.get("nvidia_ml_py")
        out["gpus"] = [
            {
                k: g.get(k)
                for k in ("name", "uuid", "pci_bus_id", "nvlinks", "poll_estimate_ms",
                          "pcie_throughput_blocking_ms")
            }
            | {"errors": {r["call"]: r["error"] for r in g.get("calls", []) if "error" in r}}
            for g in nvml.get("gpus", [])
        ]  # fmt: skip
    with contextlib.suppress(OSError, ValueError):
        doctor = json.loads((results / "doctor.json").read_text())
        out["doctor"] = {
            "exit_code": doctor.get("exit_code"),
            "holding": [
                f["cause"] for f in doctor.get("findings", []) if f.get("status") == "holds"
            ],
            "sources_down": doctor.get("sources_down"),
            "no_gpu": doctor.get("no_gpu"),
        }
    with contextlib.suppress(OSError, ValueError):
        pcie = json.loads((results / "pcie.json").read_text())
        out["pcie"] = {
            bdf: [
                f"{e['role']} {e['bdf']}: {e.get('current_link_speed', '?')} "
                f"x{e.get('current_link_width', '?')} of {e.get('max_link_speed', '?')} "
                f"x{e.get('max_link_width', '?')}"
                for e in path
            ]
            if isinstance(path, list)
            else path
            for bdf, path in pcie.get("gpus", {}).items()
        }
    return out


def checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Things the run should show besides the phases' verdicts (ok: True/False/None).

    In a dry run the daemon's probe series are the simulator's and the training runs on
    two shared CPU cores: those checks are shown, not judged (ok None)."""
    probe = summary["probe"]
    by_name = {p["name"]: p for p in summary["phases"]}
    dry = summary["mode"] == "dry-run"
    out = []

    def add(what: str, ok: bool | None, detail: Any, judged_in_dry_run: bool = False) -> None:
        if dry and not judged_in_dry_run:
            ok, detail = None, f"dry run, not judged: {json.dumps(detail, default=str)}"
        out.append({"check": what, "ok": ok, "detail": detail})

    accepted = probe.get("reports_accepted")
    add("probe reports reached the daemon", bool(accepted) if accepted is not None else None,
        accepted, judged_in_dry_run=True)  # fmt: skip
    unplaced = probe.get("unplaced_processes_max")
    add("the daemon placed the training process on a GPU (NVML lists it)",
        None if unplaced is None or not accepted else unplaced == 0,
        f"unplaced max {unplaced}", judged_in_dry_run=True)  # fmt: skip
    add(
        "the daemon's probe series are the training process's",
        None if probe.get("daemon_probe_pid") is None
        else probe.get("daemon_probe_pid") == probe.get("train_pid"),
        f"daemon {probe.get('daemon_probe_pid')}, train {probe.get('train_pid')}",
    )  # fmt: skip
    cuda = probe.get("train_cuda") or {}
    if cuda.get("torch_uuid"):
        add("torch's device uuid is NVML's", cuda.get("uuid_match"),
            f"torch {cuda.get('torch_uuid')}, NVML {cuda.get('nvml_uuid')}")  # fmt: skip
        add(
            "the daemon shows the probe's CUDA series (uuid matched)",
            bool(probe.get("daemon_cuda_series")),
            sorted(probe.get("daemon_cuda_series", {})),
        )
        mine, daemons = probe["cuda_compare"]["init_seconds"]
        add(
            "the daemon's CUDA init time is the probe's (and under the first CUDA call's)",
            None
            if mine is None or daemons is None
            else abs(mine - daemons) < 1e-3
            and mine <= (cuda.get("first_cuda_call_seconds") or 1e9),
            {"probe": mine, "daemon": daemons, "first call": cuda.get("first_cuda_call_seconds")},
        )
    for name, want in ((PHASES[0], "< 0.3"), (PHASES[1], "> 0.8"), (PHASES[2], "< 0.3")):
        ratio = by_name.get(name, {}).get("probe_ratio_train")
        ok = None if ratio is None else (ratio < 0.3 if want == "< 0.3" else ratio > 0.8)
        add(
            f"set-up: phase {name} wait/compute {want} (the loop really was fed/starved)", ok, ratio
        )
    sources = summary["sources"]
    for source in ("nvml", "processes", "probe", "pcie", "cpu"):
        s = sources.get(source)
        add(f"source {source} up in every scrape of the phases",
            None if s is None else s["down"] == 0, s, judged_in_dry_run=True)  # fmt: skip
    return out


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"gpuwatchd hardware validation ({summary['mode']}): {summary['verdict']}",
        "",
        "phase        secs  util  wait/compute(train, daemon)  input causes seen -> verdict",
    ]
    for p in summary["phases"]:
        v = p.get("verdict")
        util = p["gpu_utilization_mean"]
        lines.append(
            f"{p['name']:<12} {p['seconds'] or 0:>5} "
            f"{'-' if util is None else f'{util:.2f}':>5}  "
            f"{p.get('probe_ratio_train', '-')!s:>8}, "
            f"{p.get('probe_ratio_daemon') or '-'!s:<8}        "
            + (
                f"{seen_input(v)} -> {'PASS' if v['pass'] else 'FAIL'} (expected: {v['expected']})"
                if v
                else "(not judged)"
            )
        )
    lines.append(f"(phases planned: {summary.get('phases_planned')} s)")
    lines += ["", "causes that fired (phase +offset s, duration s):"]
    for c in summary["causes"]:
        duration = round((c["end"] or c["start"]) - c["start"], 1)
        lines.append(f"  {c['what']:<48} {c['phase']} +{c['offset_s']} for {duration}")
    if not summary["causes"]:
        lines.append("  none")
    lines += ["", "checks:"]
    for c in summary["checks"]:
        mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c["ok"]]
        lines.append(f"  {mark} {c['check']}: {json.dumps(c['detail'], default=str)[:160]}")
    compare = summary["probe"].get("cuda_compare", {})
    if any(v not in (None, (None, None), [None, None]) for v in compare.values()):
        lines += ["", "CUDA, as the training saw it / as the daemon's probe series show it:"]
        lines += [f"  {k}: {json.dumps(v)}" for k, v in compare.items()]
    lines += ["", "daemon cost (cores mean/p95, RSS MiB max) per phase:"]
    for p in summary["phases"]:
        d = p["daemon"]
        lines.append(
            f"  {p['name']:<12} {d['cpu_cores_mean']} / {d['cpu_cores_p95']}, {d['rss_mib_max']}"
        )
    lines += ["", "facts:"] + format_facts(summary["facts"]) + [""]
    lines.append("steps: " + ", ".join(f"{s['step']}={s['status']}" for s in summary["steps"]))
    lines.append(f"\nverdict: {summary['verdict']}")
    return "\n".join(lines) + "\n"


def seen_input(verdict: dict[str, Any]) -> str:
    until = verdict.get("input_until_s", {})
    return (
        ", ".join(
            f"{c} (until +{until[c]}s)" if c in until else c for c in verdict["observed_input"]
        )
        or "none"
    )


def format_facts(facts: dict[str, Any]) -> list[str]:
    lines = [
        f"  driver {facts.get('driver_version')}, CUDA {facts.get('cuda_driver_version')}, "
        f"nvidia-ml-py {facts.get('nvidia_ml_py')}"
    ]
    for g in facts.get("gpus", []):
        lines.append(
            f"  GPU {g['pci_bus_id']} {g['name']} {g['uuid']}: NVLinks {g['nvlinks']}, "
            f"one nvml poll ~{g['poll_estimate_ms']} ms, PcieThroughput blocks "
            f"{g['pcie_throughput_blocking_ms']} ms"
        )
        for call, error in g.get("errors", {}).items():
            lines.append(f"    {call}: {error}")
    for bdf, path in facts.get("pcie", {}).items():
        lines += [f"  PCIe {bdf}: {hop}" for hop in (path if isinstance(path, list) else [path])]
    doctor = facts.get("doctor")
    if doctor:
        lines.append(
            f"  doctor (idle GPU): exit {doctor['exit_code']}, holding {doctor['holding']}, "
            f"sources down {sorted(doctor.get('sources_down') or {})}"
        )
    return lines


# -- pins and check-wheels (prepare.sh) -------------------------------------------------------

# the lent machine's image has these already (/work/.library/device/KINDS.md)
ON_DEVICE = {"nvidia-ml-py", "prometheus-client", "pyyaml", "psutil"}
# the device's python3 (KINDS.md): markers are evaluated for it, not for this machine
DEVICE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(lines: list[str]) -> list[str]:
    """Names of the Requires-Dist entries that apply on the device (no extras)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    names = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(DEVICE_MARKERS):
            names.append(_norm(req.name))
    return names


def _wheel_requires(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return _requires([ln.split(":", 1)[1].strip() for ln in text.splitlines()
                      if ln.startswith("Requires-Dist:")])  # fmt: skip


def cmd_pins(args: argparse.Namespace) -> int:
    """NAME==VERSION for every dependency of the wheel, recursively, as installed here,
    less what the device has: the wheels prepare.sh downloads for the device."""
    from importlib.metadata import PackageNotFoundError, distribution

    todo, pins, problems = _wheel_requires(Path(args.wheel)), {}, []
    while todo:
        name = todo.pop()
        if name in pins or name in ON_DEVICE:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            problems.append(f"{name} is not installed here: install it in the venv first")
            continue
        pins[name] = dist.version
        todo += _requires(dist.requires or [])
    for name, version in sorted(pins.items()):
        print(f"{name}=={version}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def cmd_check_wheels(args: argparse.Namespace) -> int:
    wheels = sorted(Path(args.dir).glob("*.whl"))
    have = {_norm(w.name.split("-")[0]) for w in wheels}
    missing = [
        f"{wheel.name} needs {name}"
        for wheel in wheels
        for name in _wheel_requires(wheel)
        if name not in have and name not in ON_DEVICE
    ]
    names = [_norm(w.name.split("-")[0]) for w in wheels]
    twice = sorted({n for n in names if names.count(n) > 1})  # two versions stop pip
    for m in missing:
        print("missing:", m)
    if twice:
        print("more than one wheel of:", ", ".join(twice))
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB")
    ok = not missing and not twice and "gpuwatchd" in have
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("facts")
    p.add_argument("results")
    p.add_argument("--simulate")
    p.set_defaults(func=cmd_facts)

    p = sub.add_parser("setup")
    p.add_argument("results")
    p.add_argument("--socket", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--for-cap", type=float, default=30.0)
    p.add_argument("--keep-cap", type=float, default=15.0)
    p.add_argument("--lead", type=float, default=8.0)
    p.add_argument("--phase-seconds", type=float, default=5.0, help="each (dry run)")
    p.set_defaults(func=cmd_setup)

    p = sub.add_parser("run")
    p.add_argument("results")
    p.add_argument("--config", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--simulate")
    p.add_argument("--device", default="cuda")
    p.add_argument("--phase-seconds", default="60,120,90", help="a,b,c (or one for all)")
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--tail-seconds", type=float, default=3.0)
    p.add_argument("--lead", type=float, help="start phase a this long after the daemon is up")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for the whole step")
    p.add_argument("--pid-dir", help="write daemon.pid and train.pid here (for cleanup)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("analyze")
    p.add_argument("results")
    p.add_argument("--mode", default="hardware")
    p.add_argument("--settle", type=float, default=60.0)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("pins")
    p.add_argument("wheel")
    p.set_defaults(func=cmd_pins)

    p = sub.add_parser("check-wheels")
    p.add_argument("dir")
    p.set_defaults(func=cmd_check_wheels)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
