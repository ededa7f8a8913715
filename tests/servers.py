"""Real Prometheus and Alertmanager servers on loopback, and a webhook that records alerts.

Each server runs as a subprocess with its data in the test's tmp_path and is stopped on
exit. Waiting is bounded polling of the server's own API, never a fixed sleep.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import yaml
from daemon_process import require_tool

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, probe: Callable[[], T | None], timeout: float) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = probe()
        except OSError:  # the server is not listening yet
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.25)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


class Prometheus:
    """The HTTP API of a running Prometheus."""

    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, expr: str) -> list[dict]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = get_json(url)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        params = {"query": expr, "start": start, "end": end, "step": step}
        body = get_json(f"{self.base}/api/v1/query_range?" + urllib.parse.urlencode(params))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self) -> list[dict]:
        return get_json(f"{self.base}/api/v1/alerts")["data"]["alerts"]

    def targets_up(self) -> int:
        return sum(r["value"][1] == "1" for r in self.query("up"))


def scrape_config(
    targets: dict[str, Sequence[str]],
    interval: str = "1s",
    nodes: Mapping[str, str] | None = None,
    scrape_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A Prometheus scrape configuration (Prometheus's and vmagent's): `targets`
    ({job: [host:port, ...]}) every `interval`, each with a `node` label as
    deploy/prometheus/prometheus.yml's relabelling gives a node's name: `nodes[host:port]`,
    else the host:port. `scrape_options` go into every scrape config (scheme, tls_config,
    basic_auth)."""
    nodes = nodes or {}
    return {
        "global": {"scrape_interval": interval},
        "scrape_configs": [
            {
                "job_name": job,
                "static_configs": [
                    {"targets": [t], "labels": {"node": nodes.get(t, t)}} for t in hosts
                ],
                **(scrape_options or {}),
            }
            for job, hosts in targets.items()
        ],
    }


@contextmanager
def running_prometheus(
    tmp_path: Path,
    targets: dict[str, Sequence[str]],
    rule_files: Sequence[Path] = (),
    alertmanager: str | None = None,
    interval: str = "1s",
    nodes: Mapping[str, str] | None = None,
    scrape_options: Mapping[str, Any] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[Prometheus]:
    """A Prometheus scraping `targets` ({job: [host:port, ...]}) every `interval`, with
    `extra_args` on its command line.

    The targets are labelled as `scrape_config` says. Returns once the server answers
    queries.
    """
    config = scrape_config(targets, interval, nodes, scrape_options)
    config["global"]["evaluation_interval"] = interval
    config["rule_files"] = [str(p) for p in rule_files]
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    args = [
        require_tool("prometheus"),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--rules.alert.resend-delay=1s",  # resolutions reach Alertmanager within a cycle
        *extra_args,
    ]
    with _process(args, tmp_path / "prometheus.log"):
        server = Prometheus(f"http://127.0.0.1:{port}")
        wait_until("Prometheus to answer", lambda: server.query("vector(1)"), 30)
        yield server


@contextmanager
def running_alertmanager(tmp_path: Path, config: dict[str, Any]) -> Iterator[str]:
    """An Alertmanager with `config`; yields its host:port once it is ready."""
    config_file = tmp_path / "alertmanager.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    args = [
        require_tool("prometheus-alertmanager"),
        f"--config.file={config_file}",
        f"--storage.path={tmp_path / 'alertmanager-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",  # a single instance: no gossip port
    ]
    with _process(args, tmp_path / "alertmanager.log"):
        address = f"127.0.0.1:{port}"
        wait_until("Alertmanager to be ready", lambda: _ready(f"http://{address}/-/ready"), 30)
        yield address


def _ready(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status == 200


@contextmanager
def _process(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Webhook:
    """Alertmanager's webhook receiver: records every notification it is sent."""

    def __init__(self) -> None:
        self.notifications: list[dict] = []
        self._lock = threading.Lock()
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with received._lock:
                    received.notifications.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def alerts(self) -> list[tuple[dict, dict]]:
        """(notification, alert) for every alert of every notification, in arrival order."""
        with self._lock:
            return [(n, a) for n in self.notifications for a in n["alerts"]]

    def __enter__(self) -> Webhook:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def serving_pod_resources(lister: object, socket_path: str | Path) -> Iterator[None]:
    """`lister` (a PodResourcesListerServicer) served over gRPC on the unix socket
    `socket_path`, as the kubelet serves its pod-resources API."""
    from concurrent import futures

    import grpc

    from gpuwatchd.sources.owner.podresources_v1 import api_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    try:
        yield
    finally:
        server.stop(grace=None)
