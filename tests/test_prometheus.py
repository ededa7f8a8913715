"""A real Prometheus server scrapes a simulated node; promtool lints the exposition."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from daemon_process import require_tool, running_daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success"
    return body["data"]["result"]


def test_prometheus_scrapes_every_gpu(tmp_path: Path):
    prometheus = require_tool("prometheus")
    with running_daemon("pcie-gen3-under-load") as metrics_url:
        target = urllib.parse.urlparse(metrics_url).netloc
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: gpuwatchd\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        port = free_port()
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:  # until Prometheus has scraped and ingested all 8 GPUs (bounded)
                try:
                    result = query(base, "gpuwatchd_gpu_utilization_ratio")
                except OSError:
                    result = []
                if len(result) == 8:
                    break
                assert time.monotonic() < deadline, "Prometheus never ingested 8 GPUs"
                time.sleep(0.5)
            assert query(base, 'up{job="gpuwatchd"}')[0]["value"][1] == "1"
            gens = query(base, "gpuwatchd_gpu_pcie_link_generation_max")
            assert {r["metric"]["gpu"] for r in gens} == {str(i) for i in range(8)}
            joined = query(
                base,
                "gpuwatchd_gpu_power_watts * on(gpu, uuid) group_left(model) gpuwatchd_gpu_info",
            )
            assert {r["metric"]["model"] for r in joined} == {"NVIDIA A100-SXM4-80GB"}
        finally:
            proc.terminate()
            proc.wait(10)


def test_promtool_lints_the_exposition():
    promtool = require_tool("promtool")
    with running_daemon("healthy-8gpu") as metrics_url:
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
