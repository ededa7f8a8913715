"""VictoriaMetrics on loopback, from Debian's victoria-metrics package: the single-node
store, vmagent (scrapes, remote-writes) and vmalert (evaluates Prometheus rule files
against the store, sends to Alertmanager, writes recorded series and ALERTS back).

The store answers Prometheus's HTTP API (/api/v1/query, query_range, series), so the
suite's `Prometheus` client, the dashboards' checks and `gpuwatchd report` read it as
they read Prometheus. Each server runs as a subprocess with its data in a tmp_path and is
stopped on exit; waiting is bounded polling of its own API.

The store runs with -search.latencyOffset=0s (by default it evaluates a query within
30 s of now at now - 30 s, for samples still in flight from many vmagents: the tests
read what was just written) and -search.disableCache (a backfill or a replay writes into
the past, which the rollup cache would not see).
"""

from __future__ import annotations

import subprocess
import threading
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from daemon_process import require_tool
from servers import Prometheus, _process, free_port, get_json, scrape_config, wait_until

FLUSH_EVERY = 0.5  # seconds: see _flush_until


class VictoriaMetrics(Prometheus):
    """The HTTP API of a running single-node VictoriaMetrics."""

    def flush(self) -> None:
        """Make every sample received so far visible to queries (the store otherwise
        searches its in-memory buffers' samples a second or so later)."""
        with urllib.request.urlopen(f"{self.base}/internal/force_flush", timeout=10):
            pass

    def import_openmetrics(self, text: str) -> None:
        """Write samples given as OpenMetrics text with timestamps (backfill.Timeline's):
        /api/v1/import/prometheus takes the text format, timestamps in milliseconds."""
        lines = []
        for line in text.splitlines():
            if line.startswith("#") or not line:
                continue
            head, value, seconds = line.rsplit(" ", 2)
            lines.append(f"{head} {value} {round(float(seconds) * 1000)}")
        request = urllib.request.Request(
            f"{self.base}/api/v1/import/prometheus", data="\n".join(lines).encode() + b"\n"
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 204, response.status
        self.flush()

    def series_count(self) -> int:
        return int(get_json(f"{self.base}/api/v1/series/count")["data"][0])


@contextmanager
def running_victoria_metrics(
    tmp_path: Path, extra_args: Sequence[str] = (), flush: bool = True
) -> Iterator[VictoriaMetrics]:
    """A single-node store keeping any timestamp (100 years' retention: backfilled
    timelines lie in the past), flushed every FLUSH_EVERY s if `flush` (_flush_until);
    returns once it answers queries."""
    port = free_port()
    args = [
        require_tool("victoria-metrics"),
        f"-storageDataPath={tmp_path / 'victoria-metrics-data'}",
        f"-httpListenAddr=127.0.0.1:{port}",
        "-retentionPeriod=100y",
        "-search.latencyOffset=0s",
        "-search.disableCache",
        "-loggerLevel=WARN",
        *extra_args,
    ]
    with _process(args, tmp_path / "victoria-metrics.log"):
        store = VictoriaMetrics(f"http://127.0.0.1:{port}")
        wait_until("VictoriaMetrics to answer", lambda: store.query("vector(1)"), 30)
        stop = threading.Event()
        flusher = threading.Thread(target=_flush_until, args=(store, stop), daemon=True)
        if flush:
            flusher.start()
        try:
            yield store
        finally:
            stop.set()
            if flush:
                flusher.join()


def _flush_until(store: VictoriaMetrics, stop: threading.Event) -> None:
    """Flush the store every FLUSH_EVERY s until `stop`: it makes a new series searchable
    only when it flushes its index, up to ~10 s after the series' first sample, and each
    level of a rule chain (a rule on a recorded series) would wait that long again; a
    series' new samples are searchable within a second either way."""
    while not stop.wait(FLUSH_EVERY):
        try:
            store.flush()
        except OSError:  # stopping
            return


@contextmanager
def running_vmagent(
    tmp_path: Path,
    name: str,
    config: dict[str, Any] | Path,
    remote_write: str,
    shard: tuple[int, int] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """A vmagent scraping `config` (a Prometheus scrape config, as a dict or a file) and
    remote-writing to `remote_write`; `shard` = (member number, members count) makes it
    one of a cluster that splits the targets between them (-promscrape.cluster.*).
    Yields its base URL once it serves."""
    if isinstance(config, dict):
        path = tmp_path / f"{name}.yml"
        path.write_text(yaml.safe_dump(config))
        config = path
    port = free_port()
    args = [
        require_tool("vmagent"),
        f"-promscrape.config={config}",
        f"-remoteWrite.url={remote_write}/api/v1/write",
        f"-remoteWrite.tmpDataPath={tmp_path / (name + '-queue')}",
        "-remoteWrite.flushInterval=100ms",
        f"-httpListenAddr=127.0.0.1:{port}",
        "-loggerLevel=WARN",
        *extra_args,
    ]
    if shard is not None:
        number, count = shard
        args += [f"-promscrape.cluster.membersCount={count}",
                 f"-promscrape.cluster.memberNum={number}"]
    with _process(args, tmp_path / f"{name}.log"):
        base = f"http://127.0.0.1:{port}"
        wait_until(f"{name} to serve", lambda: _ok(f"{base}/health"), 30)
        yield base


class VmAlert:
    """The HTTP API of a running vmalert."""

    def __init__(self, base: str) -> None:
        self.base = base

    def alerts(self) -> list[dict]:
        return get_json(f"{self.base}/api/v1/alerts")["data"]["alerts"] or []

    def groups(self) -> list[dict]:
        return get_json(f"{self.base}/api/v1/rules")["data"]["groups"]


@contextmanager
def running_vmalert(
    tmp_path: Path,
    rule_files: Sequence[Path],
    store: str,
    notifier: str | None = None,
    interval: str = "1s",
    extra_args: Sequence[str] = (),
) -> Iterator[VmAlert]:
    """A vmalert evaluating `rule_files` against the store at `store` every `interval`
    (a group's own `interval` wins), writing recorded series and ALERTS there, and sending
    alerts to `notifier` (an Alertmanager's URL; it posts to /api/v2/alerts there).
    Returns once it serves its API."""
    port = free_port()
    args = [
        require_tool("vmalert"),
        *(f"-rule={path}" for path in rule_files),
        f"-datasource.url={store}",
        f"-remoteWrite.url={store}",
        "-remoteWrite.flushInterval=100ms",
        f"-remoteRead.url={store}",  # alerts' `for` state survives a restart, as Prometheus's
        f"-evaluationInterval={interval}",
        f"-httpListenAddr=127.0.0.1:{port}",
        "-external.url=http://vmalert.test",
        "-loggerLevel=WARN",
        *extra_args,
    ]
    if notifier:  # (vmalert refuses alerting rules without one)
        args.append(f"-notifier.url={notifier}")
    with _process(args, tmp_path / "vmalert.log"):
        server = VmAlert(f"http://127.0.0.1:{port}")
        wait_until("vmalert to serve", lambda: _ok(f"{server.base}/health"), 30)
        yield server


def replay(tmp_path: Path, rule_files: Sequence[Path], store: VictoriaMetrics,
           start: float, end: float) -> None:
    """vmalert's replay mode: evaluate `rule_files` over [start, end] as a running vmalert
    would have, each group at its own interval (as `promtool tsdb create-blocks-from
    rules` does for Prometheus), writing the recorded series into the store."""
    args = [
        require_tool("vmalert"),
        *(f"-rule={path}" for path in rule_files),
        f"-datasource.url={store.base}",
        f"-remoteWrite.url={store.base}",
        f"-replay.timeFrom={_rfc3339(start)}",
        f"-replay.timeTo={_rfc3339(end)}",
        "-replay.disableProgressBar",
        "-replay.rulesDelay=0s",  # no group here reads another's output
        "-datasource.queryStep=0s",  # each group's interval, not 5m
        "-loggerLevel=WARN",
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr[-3000:]}"
    store.flush()


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status == 200


@dataclass
class ScaleOut:
    """A store, the vmagent shards that feed it (base URLs) and the vmalert on it."""

    store: VictoriaMetrics
    agents: list[str]
    vmalert: VmAlert

    def scraped_by(self) -> dict[str, set[str]]:
        """{vmagent base URL: the `instance`s of the targets it scrapes}."""
        return {agent: _targets(agent) for agent in self.agents}


@contextmanager
def running_scale_out(
    tmp_path: Path,
    targets: dict[str, Sequence[str]],
    rule_files: Sequence[Path],
    alertmanager: str | None = None,
    interval: str = "1s",
    nodes: Mapping[str, str] | None = None,
    shards: int = 2,
) -> Iterator[ScaleOut]:
    """The scale-out path in one: a VictoriaMetrics store, `shards` vmagents splitting
    `targets` between them (labelled as servers.scrape_config says, as Prometheus's are),
    and a vmalert evaluating `rule_files` against the store, sending to `alertmanager`."""
    tmp_path.mkdir(exist_ok=True)
    config = scrape_config(targets, interval, nodes)
    with ExitStack() as stack:
        store = stack.enter_context(running_victoria_metrics(tmp_path))
        agents = [
            stack.enter_context(running_vmagent(
                tmp_path, f"vmagent-{shard}", config, store.base, shard=(shard, shards)))
            for shard in range(shards)
        ]
        vmalert = stack.enter_context(
            running_vmalert(tmp_path, rule_files, store.base, f"http://{alertmanager}", interval))
        yield ScaleOut(store, agents, vmalert)


def split_ports(tmp_path: Path, nodes: Sequence[str], job: str = "gpuwatchd",
                interval: str = "1s", shards: int = 2, tries: int = 30) -> dict[str, str]:
    """{127.0.0.1:PORT: node} for `nodes`, on free ports that `shards` vmagent shards split
    so that each scrapes at least one (vmagent assigns a target to a shard by a hash of
    its labels, the port among them: two random ports land on one shard half the time).
    Tried with throwaway shards on the same scrape config, writing nowhere."""
    for attempt in range(tries):
        targets = {f"127.0.0.1:{free_port()}": node for node in nodes}
        config = scrape_config({job: list(targets)}, interval, targets)
        path = tmp_path / f"split-{attempt}"
        path.mkdir(parents=True)
        with ExitStack() as stack:
            agents = [
                stack.enter_context(running_vmagent(
                    path, f"vmagent-{shard}", config, "http://127.0.0.1:9", (shard, shards)))
                for shard in range(shards)
            ]
            if all(_targets(agent) for agent in agents):
                return targets
    raise AssertionError(f"no {len(nodes)} ports split over {shards} shards in {tries} tries")


def _targets(agent: str) -> set[str]:
    active = get_json(f"{agent}/api/v1/targets")["data"]["activeTargets"]
    return {t["labels"]["instance"] for t in active}


@contextmanager
def running_prometheus_agent(tmp_path: Path, config: dict[str, Any]) -> Iterator[str]:
    """Prometheus in agent mode (--enable-feature=agent: scrapes and remote-writes, keeps
    no queryable TSDB) with `config`; yields its base URL once it is ready."""
    config_file = tmp_path / "agent.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    args = [
        require_tool("prometheus"),
        "--enable-feature=agent",
        f"--config.file={config_file}",
        f"--storage.agent.path={tmp_path / 'agent-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with _process(args, tmp_path / "agent.log"):
        base = f"http://127.0.0.1:{port}"
        wait_until("the Prometheus agent to be ready", lambda: _ok(f"{base}/-/ready"), 30)
        yield base


def agent_config(shipped: Path, targets: Sequence[str], remote_write: str,
                 interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml as an agent's (docs/fleet.md): its scrape configs as
    shipped but for `targets` in place of the example nodes and `interval` in place of
    15 s (its timeout too); without rule_files and alerting (an agent refuses them); with
    a remote_write to `remote_write` (a store's base URL)."""
    config = yaml.safe_load(shipped.read_text())
    for key in ("rule_files", "alerting"):
        config.pop(key)
    config["global"]["scrape_interval"] = interval
    (job,) = config["scrape_configs"]
    job["scrape_timeout"] = interval  # (no longer than the interval)
    (static,) = job["static_configs"]
    static["targets"] = list(targets)
    del job["file_sd_configs"]  # the example inventory's directory is not here
    # sent within `interval` (5 s by default: the store would lag the scrapes by that)
    config["remote_write"] = [{"url": f"{remote_write}/api/v1/write",
                               "queue_config": {"batch_send_deadline": interval}}]
    return config
