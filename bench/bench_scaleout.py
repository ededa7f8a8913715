"""What N gpuwatchd nodes cost each engine of the fleet path (issue 44, docs/fleet.md):
Prometheus, and VictoriaMetrics fed by vmagent (Debian's victoria-metrics), at once.

    python bench/bench_scaleout.py ingest [--nodes 200] [--minutes 10] [--interval 5]
    python bench/bench_scaleout.py report [--nodes 1000] [--hours 24]

ingest: bench_ingest.py's bodies (healthy-8gpu's exposition from the real code, each node
its own UUIDs, values moving every scrape) served to a Prometheus (no rules) and to a
vmagent remote-writing to a VictoriaMetrics store, both scraping every node every
--interval s. After every target is up on both, each engine's own counters are read at
the start and the end of --minutes: series, samples appended per second, CPU seconds,
RSS. At the end, bytes a sample takes on disk: Prometheus's head written as a block (the
admin API's snapshot: its chunks and index over the block's samples), VictoriaMetrics'
parts (flushed; its background merges shrink them further over hours) and its index.

report: a day of the series `gpuwatchd report` reads (up, gpuwatchd_gpu_owner_info,
the causes' counter, pending and info series) for --nodes 8-GPU nodes scraped every
15 s, each node running three 8-hour jobs on its 8 GPUs and a cause firing on one GPU for
20 minutes of each job, imported into a VictoriaMetrics store and backfilled into a
Prometheus (promtool); then the report of a 64-GPU job (8 nodes) over the day from each:
its queries, their time in the store, the whole report's time and the samples returned.

Run by hand, not a test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench_ingest import exporters_for, scrape_config, serving
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # (bench_ingest does too) the suite's launchers
from servers import Prometheus, running_prometheus, wait_until  # noqa: E402
from servers import scrape_config as prometheus_scrape_config  # noqa: E402
from victoria import VictoriaMetrics, running_victoria_metrics, running_vmagent  # noqa: E402

from gpuwatchd import report_prometheus  # noqa: E402
from gpuwatchd.report import build_report  # noqa: E402

MiB = 1024 * 1024
JOB = "gpuwatchd"


def self_metrics(base: str, names: Sequence[str], where: str = "") -> dict[str, float]:
    """Sums of the named families in a server's own /metrics (samples whose labels
    contain `where`, e.g. 'type="storage/'), read without scraping it."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            if sample.name in found and where in labels:
                found[sample.name] += sample.value
    return found


PROMETHEUS = ("prometheus_tsdb_head_series", "prometheus_tsdb_head_samples_appended_total",
              "process_cpu_seconds_total", "process_resident_memory_bytes")
VM = ("vm_rows_inserted_total", "process_cpu_seconds_total", "process_resident_memory_bytes")
AGENT = ("process_cpu_seconds_total", "process_resident_memory_bytes")


def ingest(nodes: int, minutes: float, interval: float, tmp: Path) -> dict[str, float]:
    (exporter, _) = exporters_for(["healthy-8gpu"], nodes, 600)
    with serving(exporter.templates) as port, ExitStack() as stack:
        targets, options = scrape_config(nodes, port, 9766)
        labels = {t: t.split(":")[0] for t in targets}
        every = f"{interval:g}s"
        (tmp / "p").mkdir()
        (tmp / "v").mkdir()
        prometheus = stack.enter_context(running_prometheus(
            tmp / "p", {JOB: targets}, interval=every, nodes=labels, scrape_options=options,
            extra_args=["--web.enable-admin-api"]))
        store = stack.enter_context(running_victoria_metrics(tmp / "v", flush=False))
        config = prometheus_scrape_config({JOB: targets}, every, labels, options)
        agent = stack.enter_context(running_vmagent(tmp / "v", "vmagent", config, store.base))
        for name, server in (("Prometheus", prometheus), ("VictoriaMetrics", store)):
            wait_until(f"every target up on {name}", lambda s=server: _up(s) == nodes,
                       max(120, 4 * interval))
        first = _readings(prometheus, store, agent)
        time.sleep(minutes * 60)
        last = _readings(prometheus, store, agent)
        seconds = last["t"] - first["t"]
        result = {
            "nodes": nodes, "interval": interval, "seconds": seconds,
            "series_per_node": exporter.series,
            "p_series": last["prometheus_tsdb_head_series"],
            "v_series": store.series_count(),
            "p_samples_s": _rate(first, last, "prometheus_tsdb_head_samples_appended_total"),
            "v_samples_s": _rate(first, last, "vm_rows_inserted_total"),
            "p_cpu": _rate(first, last, "p:process_cpu_seconds_total"),
            "v_cpu": _rate(first, last, "v:process_cpu_seconds_total"),
            "agent_cpu": _rate(first, last, "a:process_cpu_seconds_total"),
            "p_rss": last["p:process_resident_memory_bytes"],
            "v_rss": last["v:process_resident_memory_bytes"],
            "agent_rss": last["a:process_resident_memory_bytes"],
        }
        result.update(_prometheus_disk(prometheus, tmp / "p" / "prometheus-data"))
        result.update(_vm_disk(store))
    return result


def _up(server: Prometheus) -> int:
    result = server.query(f'count(up{{job="{JOB}"}} == 1)')
    return int(float(result[0]["value"][1])) if result else 0


def _readings(prometheus: Prometheus, store: VictoriaMetrics, agent: str) -> dict[str, float]:
    p = self_metrics(prometheus.base, PROMETHEUS)
    v = self_metrics(store.base, VM)
    a = self_metrics(agent, AGENT)
    return {"t": time.monotonic(), **p, **{f"p:{k}": x for k, x in p.items()},
            **v, **{f"v:{k}": x for k, x in v.items()}, **{f"a:{k}": x for k, x in a.items()}}


def _rate(first: dict, last: dict, name: str) -> float:
    return (last[name] - first[name]) / (last["t"] - first["t"])


def _prometheus_disk(prometheus: Prometheus, data: Path) -> dict[str, float]:
    """The head written as a block (a snapshot): bytes of its chunks and its index, and
    its samples."""
    request = urllib.request.Request(f"{prometheus.base}/api/v1/admin/tsdb/snapshot",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        name = json.load(response)["data"]["name"]
    samples = chunks = index = 0.0
    for meta in (data / "snapshots" / name).glob("*/meta.json"):
        samples += json.loads(meta.read_text())["stats"]["numSamples"]
        chunks += sum(f.stat().st_size for f in (meta.parent / "chunks").iterdir())
        index += (meta.parent / "index").stat().st_size
    return {"p_samples": samples, "p_chunk_bytes": chunks, "p_index_bytes": index}


def _vm_disk(store: VictoriaMetrics) -> dict[str, float]:
    store.flush()
    data = self_metrics(store.base, ("vm_data_size_bytes", "vm_rows"), 'type="storage/')
    index = self_metrics(store.base, ("vm_data_size_bytes",), 'type="indexdb')
    return {"v_samples": data["vm_rows"], "v_data_bytes": data["vm_data_size_bytes"],
            "v_index_bytes": index["vm_data_size_bytes"]}


def ingest_table(r: dict[str, float]) -> str:
    per = 1000 / r["nodes"]
    at15 = r["interval"] / 15  # samples/s and CPU at the shipped 15 s scrape interval
    rows = [
        ("series", r["p_series"] * per, r["v_series"] * per, "{:,.0f}"),
        ("samples/s at 15 s scrapes", r["p_samples_s"] * per * at15,
         r["v_samples_s"] * per * at15, "{:,.0f}"),
        ("CPU cores at 15 s scrapes (store; vmagent beside)", r["p_cpu"] * per * at15,
         r["v_cpu"] * per * at15, "{:.2f}"),
        ("RSS, GiB (store)", r["p_rss"] * per / 1024 / MiB, r["v_rss"] * per / 1024 / MiB,
         "{:.2f}"),
        ("bytes a sample on disk (data)", r["p_chunk_bytes"] / r["p_samples"],
         r["v_data_bytes"] / r["v_samples"], "{:.2f}"),
        ("bytes a sample on disk (with the index)",
         (r["p_chunk_bytes"] + r["p_index_bytes"]) / r["p_samples"],
         (r["v_data_bytes"] + r["v_index_bytes"]) / r["v_samples"], "{:.2f}"),
    ]
    lines = ["| per 1,000 nodes | Prometheus 2.42 | VictoriaMetrics 1.79 |", "|---|---|---|"]
    lines += [f"| {name} | {fmt.format(p)} | {fmt.format(v)} |" for name, p, v, fmt in rows]
    agent = (f"vmagent: {r['agent_cpu'] * per * at15:.2f} cores, "
             f"{r['agent_rss'] * per / 1024 / MiB:.2f} GiB RSS per 1,000 nodes")
    return "\n".join(lines) + "\n\n" + agent


# ---- report ------------------------------------------------------------------------------

SCRAPE = 15
GPUS = 8
JOB_HOURS = 8


def day_of_series(nodes: int, start: float, hours: float) -> Iterator[dict]:
    """/api/v1/import lines (one a series): up, each job's owner series, and one cause per
    job on one of its GPUs for 20 minutes (counter, pending for a minute before, info)."""
    times = [int((start + i * SCRAPE) * 1000) for i in range(int(hours * 3600 / SCRAPE))]
    for node in range(nodes):
        name = f"node-{node:04d}"
        target = {"job": JOB, "instance": f"{name}:9766", "node": name}
        yield {"metric": {"__name__": "up", **target}, "values": [1] * len(times),
               "timestamps": times}
        for slot in range(math.ceil(hours / JOB_HOURS)):
            job_id = str(100000 + slot * nodes + node // 8)  # a job: 8 nodes side by side
            span = [t for t in times
                    if slot * JOB_HOURS * 3600 <= t / 1000 - start < (slot + 1) * JOB_HOURS * 3600]
            for gpu in range(GPUS):
                labels = {**target, "gpu": str(gpu), "uuid": f"GPU-{node:04d}-{gpu}"}
                owner = {"__name__": "gpuwatchd_gpu_owner_info", **labels,
                         "scheduler": "slurm", "job_id": job_id, "rank": str(node % 8 * 8 + gpu),
                         "user": "ada"}
                yield {"metric": owner, "values": [1] * len(span), "timestamps": span}
            yield from _cause(target, node, span)


def _cause(target: dict, node: int, span: list[int]) -> Iterator[dict]:
    labels = {**target, "gpu": "3", "uuid": f"GPU-{node:04d}-3", "cause": "clock_throttled"}
    fires = span[len(span) // 3]
    stops = fires + 20 * 60 * 1000
    counter = [(t, max(0, min(t, stops) - fires) / 1000) for t in span if t >= fires - 60_000]
    yield {"metric": {"__name__": "gpuwatchd_starvation_seconds_total", **labels},
           "values": [v for _, v in counter], "timestamps": [t for t, _ in counter]}
    pending = [t for t in span if fires - 60_000 <= t < fires]
    yield {"metric": {"__name__": "gpuwatchd_starvation_pending", **labels},
           "values": [1] * len(pending), "timestamps": pending}
    info = [t for t in span if fires <= t < stops]
    yield {"metric": {"__name__": "gpuwatchd_starvation_info", **labels,
                      "dimension": "compute", "severity": "warning", "summary": "990 MHz",
                      "remedy": "Check cooling."},
           "values": [1] * len(info), "timestamps": info}


class CountingPrometheus(report_prometheus.Prometheus):
    """The report's client, counting its queries, their time and the samples returned."""

    queries = 0
    seconds = 0.0
    samples = 0

    def query(self, expr: str, at: float) -> list[dict]:
        began = time.perf_counter()
        result = super().query(expr, at)
        self.seconds += time.perf_counter() - began
        self.queries += 1
        self.samples += sum(len(s.get("values", ())) or 1 for s in result)
        return result


def report_cost(nodes: int, hours: float, tmp: Path) -> dict[str, dict[str, float]]:
    """The same day in VictoriaMetrics (imported) and in Prometheus (backfilled with
    promtool), and the report of job 100000 (nodes 0-7, the first 8 hours) from each."""
    start = float(int(time.time() // 86400 * 86400 - 2 * 86400))  # two days ago, 00:00 UTC
    results = {}
    (tmp / "v").mkdir()
    with running_victoria_metrics(tmp / "v", flush=False) as store:
        began = time.perf_counter()
        series = samples = 0
        batch: list[bytes] = []
        for line in day_of_series(nodes, start, hours):
            series += 1
            samples += len(line["values"])
            batch.append(json.dumps(line).encode())
            if len(batch) >= 500:
                _import(store, batch)
        _import(store, batch)
        store.flush()
        results["VictoriaMetrics"] = {"series": series, "samples": samples,
                                      "load_s": time.perf_counter() - began,
                                      **_report(store.base, start, hours)}
    began = time.perf_counter()
    data = tmp / "p" / "prometheus-data"
    data.parent.mkdir()
    _backfill(day_of_series(nodes, start, hours), tmp / "p", data)
    with running_prometheus(tmp / "p", {}) as prometheus:
        results["Prometheus"] = {"series": series, "samples": samples,
                                 "load_s": time.perf_counter() - began,
                                 **_report(prometheus.base, start, hours)}
    return results


def _report(base: str, start: float, hours: float) -> dict[str, float]:
    client = CountingPrometheus(base, timeout=600)
    began = time.perf_counter()
    report = build_report(client, "100000", start, start + hours * 3600)
    took = time.perf_counter() - began
    assert report.gpus == 64, report.gpus
    return {"report_s": took, "queries": client.queries, "query_s": client.seconds,
            "returned": client.samples, "gpu_hours": report.gpu_hours}


def _backfill(lines: Iterator[dict], tmp: Path, data: Path) -> None:
    """OpenMetrics, one file a family (a family's samples must be contiguous), then
    `promtool tsdb create-blocks-from openmetrics`."""
    files: dict[str, Any] = {}
    for line in lines:
        metric = dict(line["metric"])
        name = metric.pop("__name__")
        if name not in files:
            files[name] = (tmp / f"{name}.om").open("w")
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(metric.items()))
        out = files[name]
        for value, t in zip(line["values"], line["timestamps"], strict=True):
            out.write(f"{name}{{{labels}}} {value} {t / 1000:.3f}\n")
    for out in files.values():
        out.close()
    whole = tmp / "day.om"
    with whole.open("wb") as out:
        for name in files:
            with (tmp / f"{name}.om").open("rb") as part:
                shutil.copyfileobj(part, out)
            (tmp / f"{name}.om").unlink()
        out.write(b"# EOF\n")
    done = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(whole),
                           str(data)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    whole.unlink()


def _import(store: VictoriaMetrics, batch: list[bytes]) -> None:
    if batch:
        request = urllib.request.Request(f"{store.base}/api/v1/import", data=b"\n".join(batch))
        with urllib.request.urlopen(request, timeout=600):
            pass
        batch.clear()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("what", choices=("ingest", "report"))
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=5.0, help="scrape interval, s")
    parser.add_argument("--hours", type=float, default=24.0)
    args = parser.parse_args(argv)
    random.seed(44)
    tmp = Path(tempfile.mkdtemp(prefix="bench-scaleout-"))
    try:
        if args.what == "ingest":
            result = ingest(args.nodes or 200, args.minutes, args.interval, tmp)
            print(json.dumps(result, indent=1))
            print(ingest_table(result))
        else:
            print(json.dumps(report_cost(args.nodes or 1000, args.hours, tmp), indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
