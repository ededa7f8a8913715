"""The floor: a bare loop making only the NVML reads a starvation diagnosis needs.

    python bench/floor_on_sim.py SCENARIO PORT

bench/bench_vs_peer.py runs it beside gpuwatchd and nvitop-exporter, measured the same
way, on the same simulated node and fake driver costs (DRIVER_COSTS). Issue 14 named it:
every second, per GPU, one batched nvmlDeviceGetFieldValues (power, PCIe TX/RX byte
counters, replays, ECC, the NVLinks' states) plus utilization, memory, temperature, SM
and memory clocks, P-state and clock event reasons, through pynvml, the values kept in a
dict and nothing else: no rules, no other source, no exposition. It answers every HTTP
request with one line, so the benchmark can see it is up and scrape it as the others.
"""

from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIELDS = (
    "NVML_FI_DEV_POWER_INSTANT",
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES",
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES",
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER",
    "NVML_FI_DEV_ECC_DBE_VOL_TOTAL",
    "NVML_FI_DEV_ECC_SBE_VOL_TOTAL",
)


def read_forever(nv: Any, values: dict[str, Any]) -> None:
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    fields = [getattr(nv, name) for name in FIELDS if hasattr(nv, name)]
    links = [(nv.NVML_FI_DEV_NVLINK_LINK_COUNT, 0)]
    per_gpu: list[list[Any]] = []
    for handle in handles:
        (count,) = nv.nvmlDeviceGetFieldValues(handle, links)
        nvlinks = int(count.value.uiVal) if count.nvmlReturn == nv.NVML_SUCCESS else 0
        state = getattr(nv, "NVML_FI_DEV_NVLINK_GET_STATE", None)
        scoped = [(state, link) for link in range(nvlinks)] if state is not None else []
        per_gpu.append([(f, 0) for f in fields] + scoped)
    next_at = time.monotonic()
    while True:
        for i, handle in enumerate(handles):
            values[f"fields{i}"] = nv.nvmlDeviceGetFieldValues(handle, per_gpu[i])
            values[f"util{i}"] = nv.nvmlDeviceGetUtilizationRates(handle)
            values[f"memory{i}"] = nv.nvmlDeviceGetMemoryInfo(handle)
            values[f"temperature{i}"] = nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)
            values[f"sm{i}"] = nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)
            values[f"mem{i}"] = nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM)
            values[f"pstate{i}"] = nv.nvmlDeviceGetPerformanceState(handle)
            values[f"reasons{i}"] = nv.nvmlDeviceGetCurrentClocksEventReasons(handle)
        next_at += 1.0
        time.sleep(max(0.0, next_at - time.monotonic()))


def main() -> int:
    scenario, port = sys.argv[1], int(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pynvml

    from gpuwatchd.sim.clock import SimClock
    from gpuwatchd.sim.fake_nvml import DRIVER_COSTS, FakeNvmlLib
    from gpuwatchd.sim.scenario import Timeline, load_scenario

    timeline = Timeline(load_scenario(scenario), loop=True)
    fake = FakeNvmlLib(pynvml, timeline, SimClock(virtual=False), costs=DRIVER_COSTS)
    pynvml.nvmlLib = fake  # what CDLL("libnvidia-ml.so.1") would have set
    pynvml.nvmlInit()
    values: dict[str, Any] = {}
    threading.Thread(target=read_forever, args=(pynvml, values), daemon=True).start()

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"floor_values {len(values)}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Answer).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
