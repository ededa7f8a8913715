"""A GPU whose NVML calls hang: only that GPU is held up (issue 15, item 10); the nvml
source stays up, the other GPU keeps being read, and scrapes keep answering at once."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from daemon_process import running_daemon
from prometheus_client.parser import text_string_to_metric_families
from servers import wait_until

from gpuwatchd.sources import BUILTIN

SCENARIO = """
name: hang
node: {gpu_count: 2, pcie_topology: direct}
phases:
  - {name: ok, duration: 2s, set: {pstate: 0, utilization_gpu: 90}}
  - {name: gpu1-hangs, duration: 10m, changes: [{gpus: [1], set: {hung: true}}]}
"""
CONFIG = "sources:\n  nvml: {interval: 250ms, timeout: 500ms}\n"


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    # a 1 s client timeout: the scrape must be served from cache, never wait on NVML
    with urllib.request.urlopen(url, timeout=1) as response:
        families = text_string_to_metric_families(response.read().decode())
    return {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples} for f in families}


def per_gpu(metrics: dict, name: str) -> dict[str, float]:
    return {dict(labels)["gpu"]: v for labels, v in metrics.get(name, {}).items()}


def hung_seconds(url: str) -> float:
    return per_gpu(scrape(url), "gpuwatchd_gpu_nvml_hung_seconds").get("1", 0.0)


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_a_hung_gpu_holds_up_only_itself_and_scrapes_still_answer(tmp_path: Path):
    (tmp_path / "hang.yaml").write_text(SCENARIO)
    (tmp_path / "config.yaml").write_text(CONFIG)
    with running_daemon(
        str(tmp_path / "hang.yaml"), "--config", str(tmp_path / "config.yaml")
    ) as url:
        first = wait_until(  # GPU 1's call blocks from 2 s on: seen hung for a second
            "GPU 1 reported hung", lambda: h if (h := hung_seconds(url)) >= 1 else None, 30
        )
        for _ in range(10):  # while the call stays blocked
            got = scrape(url)
            up = {dict(labels)["source"]: v for labels, v in got["gpuwatchd_source_up"].items()}
            assert up == dict.fromkeys(BUILTIN, 1)  # nvml included: it is not held up
            assert per_gpu(got, "gpuwatchd_gpu_nvml_stale") == {}  # GPU 0 read this poll
            assert set(per_gpu(got, "gpuwatchd_gpu_utilization_ratio")) == {"0"}
            assert set(per_gpu(got, "gpuwatchd_gpu_info")) == {"0", "1"}
            time.sleep(0.1)
        wait_until(  # still counting, as the exposition follows each cycle
            "GPU 1's hung seconds to keep growing", lambda: hung_seconds(url) >= first + 0.5, 30
        )
