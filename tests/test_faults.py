"""Faults on a running node: the daemon serves through each, its self-metrics say what is
true during it, and it recovers by itself after (issue 13's soak-and-fault bullet).

Most run the daemon's pipeline on a simulated node in virtual time, with the daemon's own
clock wiring (`SteadyClock`) and its real web front in this process, scraped over
loopback: `Node` drives one evaluation cycle per simulated second as `run` does (sources
due, the stuck-poll and staleness check, rules, render). Where only a process shows the
fault (its stderr on a full disk), a real `gpuwatchd run --simulate` is started.
Already covered elsewhere and not repeated here: a hung NVML call in a real daemon
process (test_hang.py), stuck polls replaced by a fresh thread (test_blocking_files.py),
the DCGM source through host engine restarts and its registries (test_dcgm_source.py,
test_dcgm_hardening.py), each source's missing-file errors (test_*_source.py).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from series import Clock
from servers import free_port, wait_until

from gpuwatchd.config import Config, ProbeConfig, load_config
from gpuwatchd.daemon import Pipeline, SteadyClock
from gpuwatchd.exporter import Exporter
from gpuwatchd.scheduler import Poller, SteppedScheduler
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources import probe
from gpuwatchd.sources.base import Context
from gpuwatchd.store import Store
from gpuwatchd.web import MetricsServer

TRAINING = {
    "pstate": 0,
    "utilization_gpu": 90,
    "power_w": 300,
    "sm_active": 0.7,
    "processes": [{"pid": 4242, "name": "python", "gpu_memory_mib": 1024}],
}
WALL0 = 1_700_000_000.0
P = "gpuwatchd_"


class Scrape:
    """One /metrics exposition: values by name and labels."""

    def __init__(self, text: str) -> None:
        self.values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.values[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float | None:
        return self.values.get((P + name, frozenset(labels.items())))

    def names(self, **labels: str) -> set[str]:
        """Names of the series that carry `labels` (and maybe more)."""
        want = set(labels.items())
        return {name for name, have in self.values if want <= have}

    def source(self, name: str) -> tuple[float | None, float | None, float | None]:
        """(source_up, errors_total, last_success_timestamp) of source `name` (errors_total
        is shown once not 0)."""
        return (
            self.get("source_up", source=name),
            self.get("source_errors_total", source=name) or 0.0,
            self.get("source_last_success_timestamp_seconds", source=name),
        )


class Node:
    """A simulated node in virtual time, run by the daemon's pipeline, served over HTTP.

    The host's wall clock is the scenario's plus `jump` (a test steps it); the pipeline
    measures with `SteadyClock` over the virtual monotonic clock, as `run` does on a real
    node. `frozen`: sources whose files the simulated kernel stops rewriting (so a test
    can remove one and have it stay removed).
    """

    def __init__(self, tmp_path: Path, phases: list[dict[str, Any]], config: str = "") -> None:
        scenario = Scenario.model_validate(
            {
                "name": "faults",
                "node": {"gpu_count": 2, "pcie_topology": "direct", "hostname": "node7"},
                "phases": phases,
            }
        )
        # every family: each source's health is detail_metrics (issue 46)
        (tmp_path / "gpuwatchd.yaml").write_text("detail_metrics: true\n" + config)
        self.config: Config = load_config(tmp_path / "gpuwatchd.yaml")
        self.sim = SimNode(scenario, virtual=True)
        self.clock = self.sim.clock
        self.jump = 0.0
        self.frozen: set[str] = set()
        context = self.sim.context()
        context.extras["now"] = self.wall  # what time.time() says on the node
        steady = SteadyClock(self.wall, self.clock.elapsed)
        self.pipeline = Pipeline(self.config, context, steady, steady.to_wall)
        self.scheduler = SteppedScheduler(self.pipeline.pollers)
        self.pipeline.exporter.render()
        self.server = MetricsServer(self.pipeline.exporter, "127.0.0.1", 0)
        self.server.start()
        self.url = "http://{}:{}".format(*self.server.address)

    def wall(self) -> float:
        return self.clock.now() + self.jump

    def run(self, seconds: float) -> None:
        """`seconds` evaluation cycles, one per simulated second."""
        for _ in range(round(seconds)):
            now = self.pipeline.now()
            due = self.scheduler.due(now)
            self.sim.tick(due - self.frozen)
            self.scheduler.run_due(now)
            for poller in self.pipeline.pollers:  # the daemon's loop: hung or stale polls
                poller.check_hung(now)
            self.pipeline.evaluate_rules()
            self.pipeline.exporter.render()
            self.clock.advance(1.0)

    def scrape(self) -> Scrape:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            return Scrape(response.read().decode())

    def healthz(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def close(self) -> None:
        self.server.stop()
        self.pipeline.close()
        self.sim.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(phases: list[dict[str, Any]], config: str = "") -> Node:
        made.append(Node(tmp_path, phases, config))
        return made[-1]

    yield make
    for n in made:
        n.close()


def serving(node: Node, *down: str) -> Scrape:
    """Assert /healthz answers 200 naming exactly `down` down; return a fresh scrape."""
    status, body = node.healthz()
    assert status == 200, body
    assert {line.split()[1].rstrip(":") for line in body.splitlines() if "down" in line} == set(
        down
    ), body
    return node.scrape()


def fresh(value: float | None, node: Node, within: float = 10.0) -> bool:
    """A last-success timestamp within `within` s before the node's wall clock now."""
    return value is not None and 0 <= node.wall() - value <= within


def uuid(m: Scrape, gpu: int) -> str:
    labels = next(
        dict(k) for name, k in m.values if name == P + "gpu_info" and ("gpu", str(gpu)) in k
    )
    return labels["uuid"]


def names_of(m: Scrape) -> set[str]:
    return {name for name, _ in m.values}


# -- NVML hang ----------------------------------------------------------------------------


def test_a_hung_nvml_call_then_released(node):
    """test_hang.py shows a real daemon serving while a call hangs; here, what the
    self-metrics say meanwhile and that everything comes back when the call returns.
    The source reads the other GPUs without the hung one and says how long it has hung."""
    n = node([{"name": "ok", "duration": 600, "set": TRAINING}])
    n.run(10)
    u1 = uuid(serving(n), 1)
    fake = n.sim.pynvml._gpuwatchd_fake
    fake.hang(1)
    n.run(20)  # GPU 1's call has not returned for 20 s
    assert fake.blocked.is_set()
    m = serving(n)
    up, errors, last = m.source("nvml")
    assert (up, errors) == (1, 0) and fresh(last, n, within=2)
    hung = m.get("gpu_nvml_hung_seconds", gpu="1", uuid=u1)
    assert hung is not None and 15 <= hung <= 21
    assert P + "gpu_utilization_ratio" in m.names(gpu="0")
    assert P + "gpu_utilization_ratio" not in m.names(gpu="1")  # unknown, not frozen
    fake.release()  # the driver answers again
    n.run(3)
    m = serving(n)
    assert m.source("nvml")[:2] == (1, 0) and fresh(m.source("nvml")[2], n, within=2)
    assert m.get("gpu_nvml_hung_seconds", gpu="1", uuid=u1) is None  # 0: shown when not
    assert P + "gpu_utilization_ratio" in m.names(gpu="1")


# -- GPU lost ------------------------------------------------------------------------------


def test_gpu_lost_is_said_by_gpu_lost_not_by_a_source_down(node):
    n = node(
        [
            {"name": "ok", "duration": 30, "set": TRAINING},
            {"name": "lost", "duration": 60, "set": TRAINING, "changes": [
                {"gpus": [1], "set": {"lost": True}}]},
        ]
    )  # fmt: skip
    n.run(29)
    before = serving(n)
    assert before.get("gpu_lost", gpu="0", uuid=uuid(before, 0)) is None  # shown when 1
    n.run(40)
    m = serving(n)  # NVML answers (GPU_IS_LOST for one GPU): the source is up
    up, errors, last = m.source("nvml")
    assert up == 1 and errors == 0 and fresh(last, n)
    assert m.get("gpu_lost", gpu="1", uuid=uuid(before, 1)) == 1
    assert m.get("gpu_lost", gpu="0", uuid=uuid(before, 0)) is None
    # the lost GPU keeps only its identity: no value of before goes on being exported
    assert P + "gpu_utilization_ratio" in m.names(gpu="0")
    assert P + "gpu_utilization_ratio" not in m.names(gpu="1")
    assert m.get("starvation_active", gpu="1", uuid=uuid(before, 1), cause="gpu_lost",
                 gpu_instance="", dimension="driver", severity="critical") == 1  # fmt: skip


# -- DCGM host engine restart --------------------------------------------------------------


def test_dcgm_hostengine_restart_down_then_back_by_itself(node):
    n = node(
        [
            {"name": "ok", "duration": 30, "set": TRAINING},
            {"name": "stopped", "duration": 60, "set": TRAINING,
             "host": {"dcgm_hostengine_up": False}},
            {"name": "back", "duration": 600, "set": TRAINING,
             "host": {"dcgm_hostengine_up": True}},
        ]
    )  # fmt: skip
    n.run(29)
    m = serving(n)
    assert m.get("dcgm_state", state="connected") == 1
    assert P + "gpu_sm_active_ratio" in m.names(gpu="0")
    _, _, last_good = m.source("dcgm")
    n.run(45)  # the host engine has been gone for 45 s
    m = serving(n, "dcgm")
    up, errors, last = m.source("dcgm")
    assert up == 0 and errors is not None and errors >= 1
    assert last is not None and last_good is not None and last <= last_good + 5  # not since
    assert m.get("dcgm_state", state="connected") is None  # only the current state shows
    assert m.get("dcgm_state", state="hostengine_down") == 1
    assert P + "gpu_sm_active_ratio" not in m.names(gpu="0")  # no frozen values
    assert m.source("nvml")[:2] == (1, 0)  # NVML does not notice
    n.run(75)  # back for a minute: reconnected without anyone's help
    m = serving(n)
    up, errors_after, last = m.source("dcgm")
    assert up == 1 and errors_after is not None and errors_after >= errors and fresh(last, n)
    n.run(30)
    assert serving(n).source("dcgm")[:2] == (1, errors_after)  # no error since
    assert m.get("dcgm_state", state="connected") == 1
    assert P + "gpu_sm_active_ratio" in m.names(gpu="0")


# -- files vanishing -----------------------------------------------------------------------


def test_a_procfs_file_removed_then_restored(node):
    n = node([{"name": "ok", "duration": 600, "set": TRAINING}])
    n.run(20)
    interrupts = n.sim.root / "proc" / "interrupts"
    assert P + "interrupts_per_second" in names_of(serving(n))
    n.frozen = {"interrupts", "cpu"}  # the kernel side stops writing it, then it goes
    content = interrupts.read_text()
    interrupts.unlink()
    n.run(6)
    m = serving(n, "interrupts")
    up, errors, last = m.source("interrupts")
    assert up == 0 and errors is not None and errors >= 1
    assert last is not None and n.wall() - last > 5  # the last success, not a later one
    assert m.source("cpu")[0] == 1 and m.source("nvml")[0] == 1
    n.run(20)  # past its staleness (3 intervals): its old values are no longer exported
    m = serving(n, "interrupts")
    assert not any(name.startswith(P + "interrupts_") for name in names_of(m))
    up, errors, _ = m.source("interrupts")
    assert up == 0 and errors == 6  # one per poll (5 s apart) it was gone for
    interrupts.write_text(content)  # back
    n.frozen = set()
    n.run(11)  # two polls: rates need a previous reading
    m = serving(n)
    assert m.source("interrupts")[:2] == (1, errors)  # up, and the count of errors kept
    assert fresh(m.source("interrupts")[2], n)
    assert P + "interrupts_per_second" in names_of(m)


# -- disk full ------------------------------------------------------------------------------


class _FullFilesystem:
    """ENOSPC where the kernel gives it on a full filesystem: creating the socket's inode
    (bind) in `directory`, while `full` (checked on a real full tmpfs: mkdir and bind
    both fail with ENOSPC)."""

    def __init__(self, directory: Path) -> None:
        self.directory = str(directory)
        self.full = True
        fs, real = self, socket.socket

        class Sock(real):  # type: ignore[misc, valid-type]
            def bind(self, address: Any) -> None:
                if fs.full and isinstance(address, str) and address.startswith(fs.directory):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                super().bind(address)

        self.socket = Sock


def test_probe_socket_on_a_full_filesystem_is_down_then_back(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    full = _FullFilesystem(run_dir)
    monkeypatch.setattr(probe.socket, "socket", full.socket)
    clock = Clock(WALL0)
    config = ProbeConfig(socket=run_dir / "probe.sock")
    source = probe.ProbeSource(config, Context(procfs=tmp_path))
    store = Store()
    poller = Poller(source, store, clock)
    exporter = Exporter(store, [poller], source.metrics, clock, detail=True)
    try:
        for _ in range(3):
            poller.poll()
            clock.t += 1
        m = Scrape(exporter.render().text.decode())
        assert m.source("probe") == (0, 3, None)
        assert "No space left on device" in (poller.health.last_error or "")
        full.full = False  # space again: the next poll binds, nothing else needed
        poller.poll()
        m = Scrape(exporter.render().text.decode())
        assert m.source("probe") == (1, 3, WALL0 + 3)
        assert (run_dir / "probe.sock").is_socket()
    finally:
        source.close()


LOST_SOON = """
name: lost-soon
node: {gpu_count: 2, pcie_topology: direct}
phases:
  - {name: ok, duration: 2s, set: {pstate: 0, utilization_gpu: 90}}
  - {name: lost, duration: 10m, changes: [{gpus: [1], set: {lost: true}}]}
"""


def test_stderr_on_a_full_disk_does_not_stop_the_daemon(tmp_path):
    """Its log (stderr redirected to a file on a full disk: /dev/full fails every write
    with ENOSPC) cannot be written: the daemon serves on and exits cleanly. It used to die
    at start-up, printing that it serves."""
    (tmp_path / "lost.yaml").write_text(LOST_SOON)
    port = free_port()
    command = [sys.executable, "-m", "gpuwatchd", "run", "--simulate", str(tmp_path / "lost.yaml"),
               "--listen", f"127.0.0.1:{port}"]  # fmt: skip
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(command, stdout=full, stderr=full)
    try:
        url = f"http://127.0.0.1:{port}"

        def lost_said() -> Scrape | None:
            assert proc.poll() is None, f"the daemon exited ({proc.returncode})"
            with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
                m = Scrape(response.read().decode())
            lost = [v for (name, _), v in m.values.items() if name == P + "gpu_lost"]
            return m if lost == [1] else None  # its warnings were logged by now (0: not shown)

        m = wait_until("the lost GPU in /metrics", lost_said, 30)
        assert m.source("nvml")[:2] == (1, 0)
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            assert response.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


# -- clock steps ----------------------------------------------------------------------------

BUSY_RULE = """
rules:
  - name: busy
    dimension: compute
    severity: info
    expr: gpu_utilization_ratio >= 0.5
    for: 2m
    summary: busy
    remedy: none
"""


def test_wall_clock_steps_change_no_measurement(node, tmp_path):
    """NTP stepping the clock at boot, or `date -s`: an hour forward, then two back. No
    source goes down or stale, a pending cause does not fire early, seconds starved do
    not jump (nor run backwards), exported timestamps follow the new wall clock, and
    staleness and /healthz's loop age are still judged on time."""
    (tmp_path / "rules.yaml").write_text(BUSY_RULE)
    n = node(
        [{"name": "busy", "duration": 3600, "set": TRAINING}],
        config=f"rules_file: {tmp_path / 'rules.yaml'}\n",
    )
    n.run(60)

    def busy(m: Scrape, gpu: str = "0") -> tuple[float | None, float | None]:
        u = uuid(m, int(gpu))
        return (
            m.get("starvation_active", gpu=gpu, uuid=u, cause="busy", dimension="compute",
                  severity="info", gpu_instance=""),
            m.get("starvation_seconds_total", gpu=gpu, uuid=u, cause="busy", gpu_instance=""),
        )  # fmt: skip

    assert busy(serving(n)) == (None, 0)  # pending (no active series): it holds 2 minutes
    errors = {s: serving(n).source(s)[1] for s in ("nvml", "dcgm", "cpu", "interrupts")}

    n.jump = 3600.0  # an hour forward
    serving(n)  # the last render is still a second old, not an hour
    n.run(3)
    m = serving(n)
    for name, before in errors.items():
        up, after, last = m.source(name)
        assert (up, after) == (1, before), name
    assert fresh(m.source("nvml")[2], n, within=2)  # on the new wall clock
    assert busy(m) == (None, 0)  # still pending: 63 s of its 2 minutes, not an hour
    n.run(60)
    active, seconds = busy(serving(n))
    assert active == 1 and seconds is not None and 0 < seconds <= 5

    n.jump = -3600.0  # two hours back
    n.run(10)
    m = serving(n)
    active, later = busy(m)
    assert active == 1 and later is not None and seconds + 9 <= later <= seconds + 11
    assert fresh(m.source("nvml")[2], n, within=2)
    assert all(m.source(s)[1] == before for s, before in errors.items())

    # a rules reload after the steps is stamped with the wall clock of its moment
    (tmp_path / "rules.yaml").write_text(BUSY_RULE + "\n# edited\n")
    n.run(2)  # seen changed, then settled: loaded on the loader thread
    assert n.pipeline.rules_watcher.wait_idle(10)
    n.run(1)  # swapped in
    assert fresh(serving(n).get("rules_last_reload_success_timestamp_seconds"), n, within=3)

    # after the step back a source that stops must still go stale on time, not an hour late
    n.frozen = {"interrupts", "cpu"}
    (n.sim.root / "proc" / "interrupts").unlink()
    n.run(20)
    m = serving(n, "interrupts")
    assert not any(name.startswith(P + "interrupts_") for name in names_of(m))
    # and an evaluation loop that stops is unhealthy after 30 s, not 2 h later
    n.clock.advance(31)
    assert n.healthz()[0] == 503


def test_steady_clock_is_the_wall_clock_moved_by_the_monotonic_one():
    wall, mono = Clock(WALL0), Clock(5.0)
    clock = SteadyClock(wall, mono)
    assert clock() == WALL0
    mono.t += 10
    wall.t += 10 + 3600  # stepped forward an hour meanwhile
    assert clock() == WALL0 + 10  # intervals: monotonic
    assert clock.to_wall(WALL0 + 4) == WALL0 + 4 + 3600  # timestamps: today's wall clock
