"""What N gpuwatchd nodes cost a real Prometheus, against a dcgm-exporter-like body (issue 24).

    python bench/bench_ingest.py [--nodes 50] [--minutes 3] [--interval 5]
                                 [--scenario healthy-8gpu] [--scenario nccl-hang-one-rank-8xh100]

Bodies: gpuwatchd's come from the real code (`gpuwatchd simulate SCENARIO --until 600
--metrics`, the final exposition, everything else stripped); the dcgm-exporter-like one
has, for the same GPUs, one series per field of dcgm-exporter's default counters list
(etc/default-counters.csv) with its label set. Each node gets its own UUIDs (and, for
DCGM, Hostname); values jitter between scrapes (counters only grow) so the TSDB stores
real samples, not runs of one value.

One in-process HTTP server serves every node at /node/<i>/metrics; a real Prometheus
(the suite's own launcher, tests/servers.py) scrapes all of them every --interval seconds
for --minutes, once per exporter, after an empty Prometheus gives the baseline. Prints
what that Prometheus reports about itself and a Markdown table for docs/performance.md.
Run by hand, not a test: the numbers depend on the machine and on the run's length (a
3-minute head holds ~36 samples a series, a real one 2-3 hours of them, so RSS per node
here is mostly the per-series cost: a floor).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import math
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # one Prometheus launcher for the suite and this bench
from servers import Prometheus, running_prometheus, wait_until  # noqa: E402

# Prometheus adds these to every target (up, scrape_duration_seconds,
# scrape_samples_scraped, scrape_samples_post_metric_relabeling, scrape_series_added)
SCRAPE_SERIES_PER_TARGET = 5
GZIP_LEVEL = 1  # what gpuwatchd's web front sends; Go's promhttp uses gzip's default (6)

# dcgm-exporter's etc/default-counters.csv, NVIDIA/dcgm-exporter at d5e5f510a1b6 (2026-05-12):
# its uncommented rows (field, type, help). DCGM_FI_DRIVER_VERSION is a "label" row: it
# becomes a label of every series, not a series.
DCGM_DEFAULT_COUNTERS = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
     "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
     "Total number of NVLink bandwidth counters for all lanes."),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for uncorrectable errors"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge",
     "Ratio of cycles the tensor (HMMA) pipe is active."),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
     "Ratio of cycles the device memory interface is active sending or receiving data."),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
     "The rate of data transmitted over the PCIe bus - including both protocol headers and "
     "data payloads - in bytes per second."),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
     "The rate of data received over the PCIe bus - including both protocol headers and "
     "data payloads - in bytes per second."),
)  # fmt: skip

# A busy training GPU's values, so the body's bytes are typical. dcgm-exporter prints
# DCGM's doubles with "%f" and its int64s as integers: floats here are the doubles.
DCGM_VALUES = {
    "DCGM_FI_DEV_SM_CLOCK": 1410, "DCGM_FI_DEV_MEM_CLOCK": 1593,
    "DCGM_FI_DEV_MEMORY_TEMP": 52, "DCGM_FI_DEV_GPU_TEMP": 45,
    "DCGM_FI_DEV_POWER_USAGE": 312.517, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 8391044562,
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0, "DCGM_FI_DEV_GPU_UTIL": 97,
    "DCGM_FI_DEV_MEM_COPY_UTIL": 41, "DCGM_FI_DEV_ENC_UTIL": 0, "DCGM_FI_DEV_DEC_UTIL": 0,
    "DCGM_FI_DEV_XID_ERRORS": 0, "DCGM_FI_DEV_FB_FREE": 18211, "DCGM_FI_DEV_FB_USED": 62342,
    "DCGM_FI_DEV_FB_RESERVED": 606, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 912837465,
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": 0, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0,
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 0, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.962113, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.413402,
    "DCGM_FI_PROF_DRAM_ACTIVE": 0.521197, "DCGM_FI_PROF_PCIE_TX_BYTES": 1482910345,
    "DCGM_FI_PROF_PCIE_RX_BYTES": 2913004871,
}  # fmt: skip

SAMPLE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? \S+")
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
GPU_INFO = re.compile(r"^gpuwatchd_gpu_info\{(.*)\} ", re.M)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


# ---- bodies ---------------------------------------------------------------------------


def gpuwatchd_exposition(scenario: str, until: float = 600) -> str:
    """The final /metrics of `gpuwatchd simulate SCENARIO`: the real code's families."""
    command = [
        sys.executable,
        "-m",
        "gpuwatchd",
        "simulate",
        scenario,
        "--until",
        str(until),
        "--metrics",
        "--log-level",
        "error",
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return strip_to_exposition(out)


def strip_to_exposition(text: str) -> str:
    """Only HELP/TYPE comments and sample lines: simulate also prints phase tables and
    the causes' timeline, before the exposition."""
    kept = [line for line in text.splitlines() if _is_exposition(line)]
    return "\n".join(kept) + "\n"


def _is_exposition(line: str) -> bool:
    if line.startswith(("# HELP ", "# TYPE ")):
        return True
    if not SAMPLE.fullmatch(line):
        return False
    try:  # "end of phase ..." has the shape of a sample; its "value" is not a number
        float(line.rsplit(" ", 1)[1])
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Gpu:
    index: str
    uuid: str
    pci_bus_id: str
    model: str
    driver: str


def gpus_of(body: str) -> list[Gpu]:
    """The node's GPUs, from gpuwatchd_gpu_info: the DCGM body describes the same cards."""
    gpus = []
    for match in GPU_INFO.finditer(body):
        labels = dict(LABEL.findall(match.group(1)))
        gpus.append(
            Gpu(
                labels["gpu"],
                labels["uuid"],
                labels["pci_bus_id"],
                labels["model"],
                labels["driver_version"],
            )
        )
    return gpus


def dcgm_exposition(gpus: Sequence[Gpu], hostname: str) -> str:
    """dcgm-exporter's default counters for `gpus`, in its label set and number format."""
    lines = []
    for name, kind, help_text in DCGM_DEFAULT_COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        value = DCGM_VALUES[name]
        text = f"{value:f}" if isinstance(value, float) else str(value)
        lines += [f"{name}{{{_dcgm_labels(gpu, hostname)}}} {text}" for gpu in gpus]
    return "\n".join(lines) + "\n"


def _dcgm_labels(gpu: Gpu, hostname: str) -> str:
    bus = gpu.pci_bus_id.split(":", 1)[1]  # DCGM writes the domain with 8 hex digits
    return (
        f'gpu="{gpu.index}",UUID="{gpu.uuid}",pci_bus_id="00000000:{bus.upper()}",'
        f'device="nvidia{gpu.index}",modelName="{gpu.model}",Hostname="{hostname}",'
        f'DCGM_FI_DRIVER_VERSION="{gpu.driver}"'
    )


def for_node(body: str, node: int) -> str:
    """`body` as node `node` would export it: its GPUs' UUIDs are its own."""
    return UUID.sub(lambda m: _node_uuid(m.group(0), node), body)


def _node_uuid(original: str, node: int) -> str:
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_OID, f"{node}/{original}"))


def hostname(node: int) -> str:
    return f"node-{node:03d}"


def distinct_series(body: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The series `body` holds, parsed as Prometheus would (a parse error raises)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def scrape_bytes(body: str) -> tuple[int, int]:
    data = body.encode()
    return len(data), len(gzip.compress(data, GZIP_LEVEL))


# ---- values that move ------------------------------------------------------------------

FIXED, COUNTER, GAUGE = "fixed", "counter", "gauge"


@dataclass
class Line:
    head: str  # a sample's "name{labels} ", or the whole line when it is FIXED
    value: float = 0.0
    kind: str = FIXED
    style: str = "repr"  # how the value was written: "int", "%f" or Python's repr


@dataclass
class Template:
    """A node's body whose values move from scrape to scrape the way real ones do."""

    lines: list[Line]
    series: int
    scrapes: Iterator[int] = field(default_factory=itertools.count)

    @classmethod
    def of(cls, body: str) -> Template:
        return cls(_parse_lines(body), len(distinct_series(body)))

    def render(self, scrape: int, rng: random.Random) -> bytes:
        return "".join(_render(line, scrape, rng) for line in self.lines).encode()


def _parse_lines(body: str) -> list[Line]:
    types: dict[str, str] = {}
    lines = []
    for text in body.splitlines():
        if text.startswith("#"):
            parts = text.split(" ", 3)
            if parts[1] == "TYPE":
                types[parts[2]] = parts[3]
            lines.append(Line(text))
            continue
        series, value = text.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        kind = _kind(name, float(value), types)
        head = text if kind == FIXED else series + " "
        lines.append(Line(head, float(value), kind, _style(value)))
    return lines


def _kind(name: str, value: float, types: dict[str, str]) -> str:
    """Zeros (error counts), ones and infos stay as they are: states and identities do
    not change every scrape; counters and timestamps grow; other gauges wander."""
    family = re.sub(r"_(total|bucket|count|sum|created)$", "", name)
    kind = types.get(name) or types.get(family) or "untyped"
    if not math.isfinite(value) or value == 0 or name.endswith("_info"):
        return FIXED
    if kind in ("counter", "histogram", "summary") or name.endswith("timestamp_seconds"):
        return COUNTER
    return FIXED if value == 1 else GAUGE


def _style(text: str) -> str:
    if re.fullmatch(r"-?\d+", text):
        return "int"
    return "%f" if re.fullmatch(r"-?\d+\.\d{6}", text) else "repr"


def _render(line: Line, scrape: int, rng: random.Random) -> str:
    if line.kind == FIXED:
        return line.head + "\n"
    value = line.value
    integral = line.style == "int" or value.is_integer()
    if line.kind == COUNTER:  # steps of 1..1.5 so a later scrape is never lower
        value += max(abs(value) * 1e-4, 1.0) * (scrape + 0.5 * rng.random())
    elif line.kind == GAUGE:
        value += rng.choice((-1, 0, 0, 1)) if integral else value * rng.uniform(-0.01, 0.01)
    return line.head + _format(value, line.style, integral) + "\n"


def _format(value: float, style: str, integral: bool) -> str:
    if style == "int":
        return str(round(value))
    if style == "%f":
        return f"{value:f}"
    return repr(float(round(value))) if integral else repr(value)


# ---- serving ---------------------------------------------------------------------------


@contextmanager
def serving(templates: Sequence[Template]) -> Iterator[int]:
    """One HTTP server for every node: /node/<i>/metrics is templates[i]. Yields its port."""
    rng = random.Random(24)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as Prometheus scrapes a real exporter

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            match = re.fullmatch(r"/node/(\d+)/metrics", self.path)
            if not match or int(match.group(1)) >= len(templates):
                self.send_error(404)
                return
            template = templates[int(match.group(1))]
            self._reply(template.render(next(template.scrapes), rng))

        def _reply(self, body: bytes) -> None:
            zipped = "gzip" in self.headers.get("Accept-Encoding", "")
            if zipped:  # as gpuwatchd's web front does
                body = gzip.compress(body, GZIP_LEVEL)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            if zipped:
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="bodies", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def scrape_config(nodes: int, port: int, exporter_port: int) -> tuple[list[str], dict]:
    """Targets named as a fleet's would be (instance="node-017:9400"), all rewritten to
    the one local server, each to its own path."""
    targets = [f"{hostname(i)}:{exporter_port}" for i in range(nodes)]
    relabel = [
        {"source_labels": ["__address__"], "target_label": "instance"},
        {
            "source_labels": ["__address__"],
            "regex": r"node-0*(\d+):\d+",
            "target_label": "__metrics_path__",
            "replacement": "/node/$1/metrics",
        },
        {"target_label": "__address__", "replacement": f"127.0.0.1:{port}"},
    ]
    return targets, {"relabel_configs": relabel}


# ---- what Prometheus says about itself -------------------------------------------------

SELF = (
    "prometheus_tsdb_head_series",
    "prometheus_tsdb_head_chunks",
    "process_resident_memory_bytes",
    "go_memstats_heap_inuse_bytes",
    "prometheus_tsdb_head_samples_appended_total",
)


def self_metrics(prometheus: Prometheus) -> dict[str, float]:
    """Read from its own /metrics, not by scraping itself, which would add series."""
    with urllib.request.urlopen(f"{prometheus.base}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = dict.fromkeys(SELF, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:  # summed: some carry a `type` label
                found[sample.name] += sample.value
    return found


def query_value(prometheus: Prometheus, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else math.nan


def watch(prometheus: Prometheus, seconds: float, every: float = 10) -> list[dict[str, float]]:
    """Its self metrics every `every` seconds for `seconds`, the last at the end."""
    end = time.monotonic() + seconds
    readings = [self_metrics(prometheus)]
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(every, left))
        readings.append(self_metrics(prometheus))
    return readings


# ---- runs ------------------------------------------------------------------------------


def baseline(workdir: Path, seconds: float) -> dict[str, float]:
    """An empty Prometheus: what every run's numbers are net of."""
    workdir.mkdir(parents=True, exist_ok=True)
    with running_prometheus(workdir, {}) as prometheus:
        return watch(prometheus, seconds)[-1]


def ingest(
    templates: Sequence[Template],
    seconds: float,
    interval: float,
    workdir: Path,
    job: str = "ingest",
    exporter_port: int = 9766,
) -> dict[str, float]:
    """Serve `templates` to a real Prometheus for `seconds` after every target is up."""
    workdir.mkdir(parents=True, exist_ok=True)
    with serving(templates) as port:
        targets, options = scrape_config(len(templates), port, exporter_port)
        nodes = {t: t.split(":")[0] for t in targets}
        with running_prometheus(
            workdir, {job: targets}, interval=f"{interval:g}s", nodes=nodes, scrape_options=options
        ) as prometheus:
            every_up = lambda: prometheus.targets_up() == len(templates)  # noqa: E731
            wait_until("every target up", every_up, max(60, 3 * interval))
            readings = watch(prometheus, seconds)
            return _summary(prometheus, readings, seconds, job)


def _summary(prometheus: Prometheus, readings: list[dict], seconds: float, job: str) -> dict:
    last = readings[-1]
    appended = last["prometheus_tsdb_head_samples_appended_total"]
    first_appended = readings[0]["prometheus_tsdb_head_samples_appended_total"]
    sel = f'{{job="{job}"}}'
    return {
        **last,
        "peak_rss": max(r["process_resident_memory_bytes"] for r in readings),
        "samples_per_second": (appended - first_appended) / seconds,
        "samples_per_scrape": query_value(prometheus, f"avg(scrape_samples_scraped{sel})"),
        "scrape_seconds": query_value(prometheus, f"avg(scrape_duration_seconds{sel})"),
        "scrapes": query_value(prometheus, f"sum(count_over_time(up{sel}[{seconds:.0f}s]))"),
        "down": query_value(prometheus, f"count(up{sel} == 0) or vector(0)"),
    }


# ---- the report ------------------------------------------------------------------------


@dataclass
class Exporter:
    name: str
    templates: list[Template]
    gpus: int
    plain: int  # bytes of node 0's body as first rendered
    gzipped: int

    @property
    def series(self) -> int:
        return self.templates[0].series


def exporters_for(scenarios: Sequence[str], nodes: int, until: float) -> list[Exporter]:
    """gpuwatchd's body per scenario, then the DCGM one for the first scenario's GPUs."""
    found = []
    bodies = [gpuwatchd_exposition(scenario, until) for scenario in scenarios]
    for scenario, body in zip(scenarios, bodies, strict=True):
        found.append(
            _exporter(
                f"gpuwatchd, {scenario}",
                lambda i, b=body: for_node(b, i),
                nodes,
                len(gpus_of(body)),
            )
        )
    gpus = gpus_of(bodies[0])
    dcgm = _exporter(
        "dcgm-exporter-like, default counters",
        lambda i: dcgm_exposition(for_gpus(gpus, i), hostname(i)),
        nodes,
        len(gpus),
    )
    return [*found, dcgm]


def for_gpus(gpus: Sequence[Gpu], node: int) -> list[Gpu]:
    return [Gpu(g.index, _node_uuid(g.uuid, node), g.pci_bus_id, g.model, g.driver) for g in gpus]


def _exporter(name: str, body_of, nodes: int, gpus: int) -> Exporter:
    bodies = [body_of(i) for i in range(nodes)]
    plain, zipped = scrape_bytes(bodies[0])
    return Exporter(name, [Template.of(b) for b in bodies], gpus, plain, zipped)


MiB = 1024 * 1024


def table(rows: list[tuple[Exporter, dict]], base: dict, nodes: int) -> str:
    head = (
        "| exporter | series a node | per GPU | bytes a scrape (gzip) | head series, "
        f"{nodes} nodes | head series per 1,000 nodes | RSS − empty, MiB | RSS per "
        "1,000 nodes, GiB | heap in use − empty, MiB | bytes of RSS a series |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([head, *(_row(e, r, base, nodes) for e, r in rows)])


def _row(e: Exporter, r: dict, base: dict, nodes: int) -> str:
    series = r["prometheus_tsdb_head_series"]
    rss = r["process_resident_memory_bytes"] - base["process_resident_memory_bytes"]
    heap = r["go_memstats_heap_inuse_bytes"] - base["go_memstats_heap_inuse_bytes"]
    return (
        f"| {e.name} | {e.series:,} | {e.series / e.gpus:.0f} | "
        f"{e.plain / 1000:.0f} KB ({e.gzipped / 1000:.1f} KB) | {series:,.0f} | "
        f"{series / nodes * 1000:,.0f} | {rss / MiB:.1f} | "
        f"{rss / nodes * 1000 / 1024 / MiB:.2f} | {heap / MiB:.1f} | "
        f"{rss / series:,.0f} |"
    )


def details(e: Exporter, r: dict, nodes: int) -> str:
    expected = (e.series + SCRAPE_SERIES_PER_TARGET) * nodes
    verdict = "ok" if r["prometheus_tsdb_head_series"] == expected else "MISMATCH"
    return (
        f"{e.name}: head series {r['prometheus_tsdb_head_series']:,.0f}, expected "
        f"{expected:,} ({verdict}); head chunks {r['prometheus_tsdb_head_chunks']:,.0f}; "
        f"{r['samples_per_second']:,.0f} samples/s; {r['samples_per_scrape']:,.0f} samples "
        f"a scrape; {r['scrapes']:,.0f} scrapes, {r['down']:.0f} targets down; scrape "
        f"{r['scrape_seconds'] * 1000:.1f} ms avg; "
        f"RSS {r['process_resident_memory_bytes'] / MiB:.1f} MiB (peak {r['peak_rss'] / MiB:.1f})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = _arguments(argv)
    if shutil.which("prometheus") is None:
        sys.exit("prometheus is not installed (apt-get install prometheus)")
    # a SIGTERM unwinds the context managers: Prometheus stopped, temp dirs removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    exporters = exporters_for(args.scenario or ["healthy-8gpu"], args.nodes, args.until)
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        base = baseline(Path(tmp) / "empty", args.baseline_seconds)
        print(
            f"empty Prometheus: RSS {base['process_resident_memory_bytes'] / MiB:.1f} MiB, "
            f"heap in use {base['go_memstats_heap_inuse_bytes'] / MiB:.1f} MiB",
            flush=True,
        )
        rows = []
        for n, exporter in enumerate(exporters):
            result = ingest(
                exporter.templates, args.minutes * 60, args.interval, Path(tmp) / f"run-{n}"
            )
            print(details(exporter, result, args.nodes), flush=True)
            rows.append((exporter, result))
    print(
        f"\n{args.nodes} nodes, scraped every {args.interval:g} s for {args.minutes:g} min"
        f" after every target was up; RSS and heap net of the empty Prometheus\n"
    )
    print(table(rows, base, args.nodes))


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--minutes", type=float, default=3.0, help="per exporter")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape interval, s")
    parser.add_argument(
        "--scenario", action="append", help="gpuwatchd scenario (repeatable; default healthy-8gpu)"
    )
    parser.add_argument("--until", type=float, default=600, help="simulated seconds")
    parser.add_argument("--baseline-seconds", type=float, default=20)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
