"""A GPU whose NVML calls hang: the source goes down, scrapes keep answering at once."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from daemon_process import running_daemon
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.sources import BUILTIN

SCENARIO = """
name: hang
node: {gpu_count: 2, pcie_topology: direct}
phases:
  - {name: ok, duration: 2s, set: {pstate: 0, utilization_gpu: 90}}
  - {name: gpu1-hangs, duration: 10m, changes: [{gpus: [1], set: {hung: true}}]}
"""
CONFIG = "sources:\n  nvml: {interval: 250ms, timeout: 500ms}\n"


def source_up(url: str) -> dict[str, float]:
    # a 1 s client timeout: the scrape must be served from cache, never wait on NVML
    with urllib.request.urlopen(url, timeout=1) as response:
        families = text_string_to_metric_families(response.read().decode())
    up = next(f for f in families if f.name == "gpuwatchd_source_up")
    return {s.labels["source"]: s.value for s in up.samples}


def test_hung_nvml_call_marks_source_down_and_scrapes_still_answer(tmp_path: Path):
    (tmp_path / "hang.yaml").write_text(SCENARIO)
    (tmp_path / "config.yaml").write_text(CONFIG)
    with running_daemon(
        str(tmp_path / "hang.yaml"), "--config", str(tmp_path / "config.yaml")
    ) as url:
        seen = []
        deadline = time.monotonic() + 30
        # up first (the first render can come before the first poll ends), then down
        for want in (1, 0):
            while not seen or seen[-1].get("nvml") != want:
                seen.append(source_up(url))
                assert time.monotonic() < deadline, f"nvml never reported {want}: {seen[-3:]}"
                time.sleep(0.1)
        for _ in range(10):  # while the call stays blocked, every scrape still answers
            up = source_up(url)
            # the processes source lists each GPU's processes through NVML too: it goes
            # down once its own poll (every 5 s, timeout 3 s) has waited past its timeout
            assert up.pop("processes") in (0, 1)
            assert up == dict.fromkeys(set(BUILTIN) - {"processes"}, 1) | {"nvml": 0}
