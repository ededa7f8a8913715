"""A real Prometheus holding a known timeline of what gpuwatchd's daemons export.

The series are written as the daemons' scrapes would have given them, at fixed scrape
times, in OpenMetrics; `promtool tsdb create-blocks-from openmetrics` turns them into
TSDB blocks (backfilling) and `promtool tsdb create-blocks-from rules` evaluates
recording rules over them as a running Prometheus would have, minute by minute. No clock
is waited on: the numbers are known to the second.

A backfilled series has no staleness marker where it ends (a live Prometheus writes one
at the first scrape that misses it), so the server runs with its lookback just under a
scrape interval: a series is gone from instant queries at the next scrape, as it is from
a live server's.

Series and labels are the daemon's (gpuwatchd/rules/engine.py and
gpuwatchd/sources/processes/metrics.py): a cause's counter
gpuwatchd_starvation_seconds_total from its first pending on (0 until it fires),
gpuwatchd_starvation_pending while pending, gpuwatchd_starvation_active and _info while
firing, gpuwatchd_gpu_starved on every whole GPU; `up` per scrape (0 and nothing else
for a failed one).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from daemon_process import require_tool
from servers import Prometheus, running_prometheus
from victoria import VictoriaMetrics, replay, running_victoria_metrics

SCRAPE = 15  # seconds between two scrapes of a node


@dataclass(frozen=True)
class Device:
    """A whole GPU, or a MIG GPU instance (`gpu_instance` its GI id)."""

    node: str
    gpu: int
    gpu_instance: str = ""
    profile: str = ""

    @property
    def target(self) -> dict[str, str]:
        return {"job": "gpuwatchd", "instance": f"{self.node}:9766", "node": self.node}

    @property
    def labels(self) -> dict[str, str]:
        gpu = {**self.target, "gpu": str(self.gpu), "uuid": f"{self.node}-GPU{self.gpu}"}
        return {**gpu, "gpu_instance": self.gpu_instance} if self.gpu_instance else gpu


@dataclass(frozen=True)
class Owner:
    """`device` is the job's (or pod's) from `start` to before `end`."""

    device: Device
    start: float
    end: float
    job_id: str = ""
    rank: str = "0"
    user: str = "ada"
    namespace: str = ""
    pod: str = ""

    def series(self) -> tuple[str, dict[str, str]]:
        d = self.device
        who = {"scheduler": "kubernetes" if self.pod else "slurm", "job_id": self.job_id,
               "rank": self.rank, "user": self.user, "namespace": self.namespace,
               "pod": self.pod}
        labels = {**d.labels, **{k: v for k, v in who.items() if v}}
        if d.gpu_instance:
            return "gpuwatchd_gpu_instance_owner_info", {**labels, "profile": d.profile}
        return "gpuwatchd_gpu_owner_info", labels


@dataclass(frozen=True)
class Episode:
    """`cause` pending on `device` for `pending` seconds (its `for`), then firing from
    `fires` to before `stops`."""

    device: Device
    cause: str
    dimension: str
    fires: float
    stops: float
    pending: float = 60
    summary: str = "evidence"
    remedy: str = "Fix it."

    def fired(self, t: float) -> float:
        return min(max(t - self.fires, 0.0), self.stops - self.fires)


@dataclass
class Timeline:
    """Every node scraped each SCRAPE s from `start` to `end`, but at its `failed` times."""

    start: float
    end: float
    owners: list[Owner]
    episodes: list[Episode]
    failed: dict[str, list[float]] = field(default_factory=dict)

    def openmetrics(self) -> str:
        families: dict[str, list[str]] = defaultdict(list)
        for node in sorted({o.device.node for o in self.owners}):
            t = self.start
            while t <= self.end:
                for name, labels, value in self._scrape(node, t):
                    families[name].append(f"{name}{_labels(labels)} {float(value)!r} {t:.3f}")
                t += SCRAPE
        return "".join(line + "\n" for lines in families.values() for line in lines) + "# EOF\n"

    def _scrape(self, node: str, t: float) -> Iterator[tuple[str, dict[str, str], float]]:
        target = Device(node, 0).target
        if t in self.failed.get(node, []):
            yield "up", target, 0
            return
        yield "up", target, 1
        for owner in self.owners:
            if owner.device.node == node and owner.start <= t < owner.end:
                yield (*owner.series(), 1)
        yield from self._causes(node, t)

    def _causes(self, node: str, t: float) -> Iterator[tuple[str, dict[str, str], float]]:
        by_cause: dict[tuple[Device, str], list[Episode]] = defaultdict(list)
        for e in self.episodes:
            if e.device.node == node:
                by_cause[(e.device, e.cause)].append(e)
        starved = {(o.device.gpu, o.device.labels["uuid"]): 0 for o in self.owners
                   if o.device.node == node}
        for (device, cause), episodes in by_cause.items():
            if t < min(e.fires - e.pending for e in episodes):
                continue  # the counter is exported from the first pending on
            labels = {**device.labels, "cause": cause}
            yield "gpuwatchd_starvation_seconds_total", labels, sum(e.fired(t) for e in episodes)
            for e in episodes:
                kind = {**labels, "dimension": e.dimension, "severity": "warning"}
                if e.fires - e.pending <= t < e.fires:
                    yield "gpuwatchd_starvation_pending", labels, 1
                if e.fires <= t < e.stops:
                    starved[(device.gpu, device.labels["uuid"])] = 1
                    yield "gpuwatchd_starvation_active", kind, 1
                    yield ("gpuwatchd_starvation_info",
                           {**kind, "summary": e.summary, "remedy": e.remedy}, 1)
        for (gpu, uuid), value in starved.items():
            yield "gpuwatchd_gpu_starved", {**Device(node, gpu).target, "gpu": str(gpu),
                                            "uuid": uuid}, value


def _labels(labels: dict[str, str]) -> str:
    quoted = (f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + ",".join(quoted) + "}"


@contextmanager
def backfilled_prometheus(tmp_path: Path, timeline: Timeline,
                          rule_files: Sequence[Path] = ()) -> Iterator[Prometheus]:
    """A Prometheus serving `timeline`, with `rule_files`' recording rules evaluated over
    it every minute from its start (their groups' own `interval`)."""
    promtool = require_tool("promtool")
    data = tmp_path / "prometheus-data"
    source = tmp_path / "timeline.om"
    source.write_text(timeline.openmetrics())
    _run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)])
    lookback = [f"--query.lookback-delta={SCRAPE * 1000 - 1}ms"]
    if rule_files:
        with running_prometheus(tmp_path, {}, extra_args=lookback) as prometheus:
            _run([promtool, "tsdb", "create-blocks-from", "rules", f"--url={prometheus.base}",
                  f"--start={timeline.start:.0f}", f"--end={timeline.end:.0f}",
                  f"--output-dir={tmp_path / 'rules-data'}", *map(str, rule_files)])
        for block in (tmp_path / "rules-data").iterdir():
            shutil.move(block, data / block.name)
    with running_prometheus(tmp_path, {}, extra_args=lookback) as prometheus:
        yield prometheus


def _run(args: list[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"


@contextmanager
def backfilled_victoria_metrics(tmp_path: Path, timeline: Timeline,
                                rule_files: Sequence[Path] = ()) -> Iterator[VictoriaMetrics]:
    """A VictoriaMetrics store serving `timeline` (imported with its timestamps), with
    `rule_files`' recording rules replayed over it by vmalert (-replay.*), each group at
    its own `interval`: backfilled_prometheus's twin. Its lookback, as that Prometheus's,
    is just under a scrape interval (-search.maxLookback: VictoriaMetrics' name for
    Prometheus's lookback delta)."""
    lookback = [f"-search.maxLookback={SCRAPE * 1000 - 1}ms"]
    with running_victoria_metrics(tmp_path, extra_args=lookback) as store:
        store.import_openmetrics(timeline.openmetrics())
        if rule_files:
            replay(tmp_path, rule_files, store, timeline.start, timeline.end)
        yield store
