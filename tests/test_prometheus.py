"""A real Prometheus server scrapes a simulated node; promtool lints the exposition."""

from __future__ import annotations

import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from daemon_process import DETAIL, require_tool, running_daemon
from servers import running_prometheus, wait_until


@pytest.mark.ahead  # waits on real time (tests/ahead.py)
def test_prometheus_scrapes_every_gpu(tmp_path: Path):
    with running_daemon("pcie-gen3-under-load") as metrics_url:
        target = urllib.parse.urlparse(metrics_url).netloc
        with running_prometheus(tmp_path, {"gpuwatchd": [target]}) as prometheus:
            wait_until(
                "Prometheus to ingest all 8 GPUs",
                lambda: len(prometheus.query("gpuwatchd_gpu_utilization_ratio")) == 8,
                60,
            )
            assert prometheus.query('up{job="gpuwatchd"}')[0]["value"][1] == "1"
            clocks = prometheus.query("gpuwatchd_gpu_sm_clock_hertz")
            assert {r["metric"]["gpu"] for r in clocks} == {str(i) for i in range(8)}
            joined = prometheus.query(
                "gpuwatchd_gpu_power_watts * on(gpu, uuid) group_left(model) gpuwatchd_gpu_info"
            )
            assert {r["metric"]["model"] for r in joined} == {"NVIDIA A100-SXM4-80GB"}


def test_promtool_lints_the_exposition():
    promtool = require_tool("promtool")
    with running_daemon("healthy-8gpu", *DETAIL) as metrics_url:  # every family
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(metrics_url, timeout=5) as response:
                body = response.read()
            if b"gpuwatchd_pcie_link_generation{" in body and b"gpuwatchd_gpu_info{" in body:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
    lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True)
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
