"""The status page at `/`: unit tests through the real pipeline in virtual time, then the
real daemon's page in headless Chromium (the rendered DOM, a phone and a desktop shot).

Regenerate the screenshot kept in the docs with
`python tests/test_status_page.py docs/status-page.png`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path

import pytest
import yaml
from daemon_process import require_tool, running_daemon
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.config import Config, SourceConfig
from gpuwatchd.exporter import Exporter, MetricsServer
from gpuwatchd.metrics import Sample
from gpuwatchd.rules import Catalog, RuleEngine, load_rules
from gpuwatchd.rules.engine import FIRING, PENDING
from gpuwatchd.scheduler import Poller
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.simulate import Simulation
from gpuwatchd.sources.base import Context, Source, SourceError
from gpuwatchd.sources.nvml.metrics import (
    INFO,
    LOST,
    POWER,
    POWER_LIMIT,
    TEMPERATURE,
    UTILIZATION,
)
from gpuwatchd.status_page import Cause, Gpu, NodeStatus, SourceState, StatusPage, render
from gpuwatchd.store import Store

CAUSE = "pcie_link_degraded"
VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "wbr", "source"}
BLOCKS = {"p", "li", "td", "th", "tr", "div", "section", "article", "h1", "h2", "h3", "h4"}


class Dom(HTMLParser):
    """The text of every element with an id (by id), the links, and the meta tags."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.classes: dict[str, str] = {}
        self.links: list[str] = []
        self.meta: dict[str, str] = {}
        self._open: list[str | None] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = {k: v or "" for k, v in attrs}
        if tag == "a":
            self.links.append(attr.get("href", ""))
        if tag == "meta" and ("name" in attr or "http-equiv" in attr):
            self.meta[attr.get("name") or attr["http-equiv"]] = attr.get("content", "")
        if tag in VOID:
            return
        if "id" in attr:
            self.text.setdefault(attr["id"], "")
            self.classes[attr["id"]] = attr.get("class", "")
        self._open.append(attr.get("id"))

    def handle_endtag(self, tag: str) -> None:
        if tag not in VOID:
            self._open.pop()
        if tag in BLOCKS:  # a browser would break the line here
            self.handle_data(" ")

    def handle_data(self, data: str) -> None:
        for element in self._open:
            if element is not None:
                self.text[element] += data

    def __getitem__(self, element: str) -> str:
        return " ".join(self.text[element].split())


# the real pipeline in virtual time ---------------------------------------------------


@dataclass
class PcieNode:
    """pcie-gen3-under-load's page while GPU 3's degraded link is pending, then firing."""

    sim: Simulation
    page: StatusPage
    pending: Dom
    firing: Dom
    gpu3: str  # its uuid


def step_until(sim: Simulation, uuid: str, state: str) -> None:
    """Step the simulation until the cause on `uuid` is in `state` (bounded: 10 minutes)."""
    clock, engine = sim.node.clock, sim.pipeline.engine
    while clock.elapsed() < 600:
        sim.step()
        current = engine.states.get((uuid, CAUSE))
        if current is not None and current.state == state:
            return
        clock.advance(sim.config.evaluation_interval)
    pytest.fail(f"{CAUSE} never got {state} on {uuid}")


@pytest.fixture(scope="module")
def pcie_node() -> Iterator[PcieNode]:
    # cycles of 5 s rather than 1 s: the same states in a fifth of the wall time
    sim = Simulation(load_scenario("pcie-gen3-under-load"), Config(evaluation_interval=5))
    try:
        sim.step()
        p = sim.pipeline
        gpu3 = next(ref.uuid for ref in p.engine.gpus.values() if ref.gpu == "3")
        page = StatusPage(p.store, p.pollers, p.now, p.engine, sim.scenario.node.hostname)
        step_until(sim, gpu3, PENDING)
        pending = Dom(page().decode())
        step_until(sim, gpu3, FIRING)
        firing = Dom(page().decode())
        yield PcieNode(sim, page, pending, firing, gpu3)
    finally:
        sim.close()


def rule_spec(sim: Simulation, name: str):
    return next(r.spec for r in sim.pipeline.engine.rules.rules if r.name == name)


def test_the_node_its_gpus_and_the_links(pcie_node):
    dom, p = pcie_node.firing, pcie_node.sim.pipeline
    assert dom["hostname"] == "sim-hgx-a100" and dom["version"]
    assert dom.meta["viewport"].startswith("width=device-width")
    assert {"/metrics", "/healthz"} <= set(dom.links)
    models = {
        labels[1]: labels[2] for (name, labels), _ in p.store.latest(p.now()) if name == INFO.name
    }
    assert len(models) == 8
    for ref in p.engine.gpus.values():
        assert ref.uuid in dom[f"gpu-{ref.gpu}"] and models[ref.uuid] in dom[f"gpu-{ref.gpu}"]
    # no process reports to the probe here: its rules wait for it, apart from any fault
    assert dom["probe-rules"].startswith("input_pipeline_stall, memory_fragmentation")
    assert "unevaluable" not in dom.text


def test_a_firing_cause_shows_its_evidence_remedy_severity_and_age(pcie_node):
    dom, sim = pcie_node.firing, pcie_node.sim
    state = sim.pipeline.engine.states[(pcie_node.gpu3, CAUSE)]
    spec = rule_spec(sim, CAUSE)
    cause = dom[f"gpu-3-{CAUSE}"]
    assert state.summary and state.summary in cause  # the evidence frozen when it fired
    assert "Gen3 x16 of Gen4 x16" in cause
    assert " ".join(spec.remedy.split()).replace("`", "") in cause
    assert spec.severity in cause and spec.dimension in cause
    assert re.search(r"firing for \d+s, since \d\d:\d\d:\d\d UTC", cause)
    assert "starved" in dom.classes["gpu-3"] and spec.severity in dom.classes["gpu-3"]
    assert dom["verdict"].startswith(f"1 of 8 GPUs starved: {CAUSE} on GPU 3")
    assert f"#cause-{CAUSE}" in dom.links and dom[f"cause-{CAUSE}"].startswith(f"{CAUSE} GPU 3")
    others = [dom[f"gpu-{g}"] for g in "0124567"]
    assert all("firing" not in text and "pending" not in text for text in others)


def test_each_gpu_shows_its_utilization_temperature_and_power(pcie_node):
    """What dcgm-exporter users look at first (GPU_UTIL, GPU_TEMP, POWER_USAGE), from the
    store's latest values: GPU 3, starved on its link, is the one at half the work."""
    dom, p = pcie_node.firing, pcie_node.sim.pipeline
    latest = {(name, labels[:1]): v for (name, labels), v in p.store.latest(p.now())}
    for gpu in "01234567":
        util, temp, watts, limit = (
            latest[(spec.name, (gpu,))] for spec in (UTILIZATION, TEMPERATURE, POWER, POWER_LIMIT)
        )
        assert dom[f"readings-{gpu}"] == (
            f"utilization {util * 100:.0f}% · {temp:.0f} °C · power {watts:.0f} W of {limit:.0f} W"
        )
    assert dom["readings-0"].startswith("utilization 95%")
    assert dom["readings-3"].startswith("utilization 48%")


def test_a_pending_cause_shows_since_when(pcie_node):
    dom, engine = pcie_node.pending, pcie_node.sim.pipeline.engine
    assert dom["verdict"] == "No GPU starved (8 GPUs) (1 cause pending)"
    active_at = engine.states[(pcie_node.gpu3, CAUSE)].active_at  # the same episode, firing now
    since = time.strftime("%H:%M:%S UTC", time.gmtime(active_at))
    assert (
        f"pending {CAUSE}" in dom["gpu-3"] and f"holds since {since}, fires after" in dom["gpu-3"]
    )
    assert f"gpu-3-{CAUSE}" not in dom.text  # pending is not firing


def test_times_shown_follow_a_step_of_the_wall_clock(pcie_node):
    # the pipeline's clock ignores a step of the system clock (an NTP jump an hour ahead
    # since start); the page shows its times as the wall clock reads now, ages unchanged
    sim, p = pcie_node.sim, pcie_node.sim.pipeline
    hour = 3600.0
    stepped = StatusPage(
        p.store, p.pollers, p.now, p.engine, "node", to_wall=lambda t: t + hour
    ).status()
    plain = pcie_node.page.status()
    assert stepped.now == plain.now + hour
    (cause,) = next(g for g in stepped.gpus if g.uuid == pcie_node.gpu3).firing
    (before,) = next(g for g in plain.gpus if g.uuid == pcie_node.gpu3).firing
    assert (cause.holds_since, cause.fires_at) == (
        before.holds_since + hour,
        before.fires_at + hour,
    )
    for shown, source in zip(stepped.sources, plain.sources, strict=True):
        assert source.last_success is not None and shown.last_success == source.last_success + hour
    since = time.strftime("%H:%M:%S UTC", time.gmtime(before.fires_at + hour))
    page = Dom(render(stepped))
    assert f"since {since}" in page[f"gpu-3-{CAUSE}"]
    assert sim.pipeline.engine.states[(pcie_node.gpu3, CAUSE)].state == FIRING


def test_sources_show_up_and_the_rules_in_use(pcie_node):
    dom, p = pcie_node.firing, pcie_node.sim.pipeline
    for poller in p.pollers:
        assert dom[f"source-{poller.name}"].startswith(f"{poller.name} up")
    assert dom["rules"].startswith(f"{len(p.engine.rules.rules)} rules from built-in")


def test_the_page_never_calls_a_source(pcie_node, monkeypatch):
    def no_polls(self):
        raise AssertionError("the page called a source")

    for poller in pcie_node.sim.pipeline.pollers:
        monkeypatch.setattr(type(poller.source), "collect", no_polls)
    assert b"GPU 3" in pcie_node.page()


# a lost GPU, a source down, hostile strings ------------------------------------------


class Nvml(Source):
    """Stands in for the NVML source: returns or raises whatever the test put in `next`."""

    name = "nvml"
    metrics = (INFO, LOST, UTILIZATION, TEMPERATURE)

    def __init__(self) -> None:
        super().__init__(SourceConfig(interval=1, timeout=1), Context())
        self.next: list[Sample] | Exception = []

    def collect(self) -> list[Sample]:
        if isinstance(self.next, Exception):
            raise self.next
        return self.next


def info(gpu: str, model: str) -> Sample:
    return Sample(INFO.name, (gpu, f"GPU-{gpu}", model, f"0000:0{gpu}:00.0", "550", "12.4"), 1.0)


def lost(gpu: str, value: float) -> Sample:
    return Sample(LOST.name, (gpu, f"GPU-{gpu}"), value)


def test_a_lost_gpu_and_a_down_source_render():
    t = [1000.0]
    store, source = Store(), Nvml()
    poller = Poller(source, store, lambda: t[0])
    catalog = Catalog.builtin()
    engine = RuleEngine(store, load_rules(None, catalog), lambda name: poller.health.up, catalog)
    page = StatusPage(store, [poller], lambda: t[0], engine, "node-1")

    def cycle(samples: list[Sample] | Exception) -> Dom:
        source.next = samples
        poller.poll()
        engine.evaluate(t[0])
        dom = Dom(page().decode())
        t[0] += 1
        return dom

    readings = [Sample(UTILIZATION.name, ("0", "GPU-0"), 0.5)]
    readings += [Sample(TEMPERATURE.name, ("0", "GPU-0"), 41.0)]
    cycle([info("0", "A100"), lost("0", 0), info("1", "A100 <b>80GB</b>"), lost("1", 0)])
    dom = cycle([info("0", "A100"), lost("0", 0), lost("1", 1), *readings])  # GPU 1 is lost
    assert "lost" in dom.classes["gpu-1"] and "A100 <b>80GB</b>" in dom["gpu-1"]  # remembered
    assert dom["readings-0"] == "utilization 50% · 41 °C"
    assert dom["readings-1"] == "no current readings"
    assert "the driver reports the GPU lost" in dom["gpu-1-gpu_lost"]
    assert dom["verdict"].startswith("1 of 2 GPUs starved: gpu_lost on GPU 1")
    dom = cycle(SourceError("<script>driver gone</script>"))
    assert dom["source-nvml"] == "nvml down SourceError: <script>driver gone</script> 1s ago"
    assert "GPU-0" in dom["gpu-0"] and "GPU-1" in dom["gpu-1"]  # still listed
    assert "source nvml down" in dom["verdict"]
    assert "nvml" in dom["unevaluable"]  # the rules that read NVML say why they cannot
    assert dom["readings-0"] == "utilization 50% · 41 °C"  # the last poll's, still current
    t[0] += 3  # stale 3 s after the last good poll: max(3 x interval, interval + timeout)
    assert Dom(page().decode())["readings-0"] == "no current readings"  # not shown as now


def test_every_value_is_escaped():
    evil = "<img src=x onerror=alert(1)>&\"'"
    cause = Cause(evil, evil, evil, 0.0, 30.0, evil, f"run `{evil}`")
    gpu = Gpu(evil, evil, evil, True, (cause,), (cause,))
    node = NodeStatus(
        evil, evil, 60.0, (gpu,), (SourceState(evil, False, evil, None),), (), evil, False
    )
    page = render(node)
    assert "<img" not in page  # the only way the string could become a tag
    dom = Dom(page)  # and every text and attribute reads back as it was
    assert dom["hostname"] == evil and dom[f"source-{evil}"].startswith(evil)
    assert evil in dom[f"gpu-{evil}-{evil}"] and "<code>&lt;img" in page


def test_a_hang_is_one_cause_and_the_rank_it_waits_for_comes_first():
    """nccl-hang-one-rank-8xh100: seven ranks spin, rank 3 never entered the collective.
    The page shows nccl_stall once over its seven GPUs, and straggler_gpu on GPU 3 first,
    as the culprit; each card says where the GPU is and whose process runs on it."""
    sim = Simulation(load_scenario("nccl-hang-one-rank-8xh100"), Config(evaluation_interval=5))
    try:
        p = sim.pipeline
        page = StatusPage(p.store, p.pollers, p.now, p.engine, sim.scenario.node.hostname)
        while sim.node.clock.elapsed() < 600:
            sim.step()
            firing = {(s.state, cause) for (_, cause), s in p.engine.states.items()}
            if {(FIRING, "nccl_stall"), (FIRING, "straggler_gpu")} <= firing:
                break
            sim.node.clock.advance(5)
        dom = Dom(page().decode())
    finally:
        sim.close()
    stalled = "GPUs 0, 1, 2, 4, 5, 6, 7"
    assert dom["verdict"] == (
        f"8 of 8 GPUs starved: straggler_gpu on GPU 3 (the rank the others wait for); "
        f"nccl_stall on {stalled}"
    )
    causes = dom["causes"]
    assert causes.index("straggler_gpu GPU 3") < causes.index(f"nccl_stall {stalled}")
    assert (
        f"culprit its job's {stalled} wait in a collective for this rank"
        in (dom["cause-straggler_gpu"])
    )
    assert "NCCL_DEBUG=INFO" in dom["cause-nccl_stall"]  # the remedy, once
    assert "Remedy with the cause" in dom["gpu-0-nccl_stall"]
    assert "NCCL_DEBUG" not in dom["gpu-0-nccl_stall"]
    assert re.search(r"PCI \S+:\S+ · pid 4004 · job of pid 4000", dom["gpu-3"]), dom["gpu-3"]


def test_a_cause_on_a_mig_instance_names_the_instance():
    """mig-thermal-steal-a100: clock_throttled on GPU 0 itself, cpu_steal on its GPU
    instance 1 only: the verdict and the cause group name "GPU 0/1" (a link to GPU 0's
    card), and the card says which instance."""
    sim = Simulation(load_scenario("mig-thermal-steal-a100"), Config(evaluation_interval=5))
    try:
        p = sim.pipeline
        page = StatusPage(p.store, p.pollers, p.now, p.engine, sim.scenario.node.hostname)
        while sim.node.clock.elapsed() < 480:
            sim.step()
            states = p.engine.states.items()
            if any(s.state == FIRING for (_, cause), s in states if cause == "cpu_steal"):
                break
            sim.node.clock.advance(5)
        html = page().decode()
    finally:
        sim.close()
    dom = Dom(html)
    assert "cpu_steal on GPU 0/1" in dom["verdict"], dom["verdict"]
    assert "clock_throttled on GPU 0" in dom["verdict"]
    assert '<a href="#gpu-0">0/1</a>' in html
    assert "on GI 1 (3g.40gb)" in dom["gpu-0"]


RULE = """rules:
  - name: cause_x
    dimension: compute
    severity: warning
    expr: {expr}
    for: 0s
    summary: util {{{{ gpu_utilization_ratio * 100 }}}}%
    remedy: none
"""


def test_the_daemon_logs_causes_and_the_page_lists_the_resolved(tmp_path, caplog):
    """journalctl shows each cause firing (with its evidence) and resolving; the page keeps
    the causes that stopped lately, and reloads itself."""
    from gpuwatchd.config import load_config
    from gpuwatchd.daemon import Daemon

    rules = tmp_path / "rules.yaml"
    rules.write_text(RULE.format(expr="gpu_utilization_ratio < 0.5"))  # idle: it holds
    config = tmp_path / "config.yaml"
    config.write_text(f"rules_file: {rules}\nlisten: 127.0.0.1:0\n")
    daemon = Daemon(load_config(config), load_scenario("idle-8gpu"))
    try:
        caplog.set_level("INFO", logger="gpuwatchd.causes")
        for poller in daemon.pipeline.pollers:  # the scheduler's threads are not started
            poller.poll()
        daemon.evaluate_once()
        fired = [r for r in caplog.records if "firing" in r.getMessage()]
        assert len(fired) == 8 and fired[0].levelname == "WARNING"
        assert fired[0].getMessage() == "GPU 0: cause_x firing: util 0%"
        rules.write_text(RULE.format(expr="gpu_utilization_ratio > 0.5"))
        for _ in range(3):  # noticed, loaded on the loader thread, swapped in
            daemon.evaluate_once()
            assert daemon.pipeline.rules_watcher.wait_idle(10)
        daemon.evaluate_once()
        resolved = [r.getMessage() for r in caplog.records if "resolved" in r.getMessage()]
        assert "GPU 3: cause_x resolved (now inactive)" in resolved and len(resolved) == 8
        page = daemon.status().decode()
    finally:
        daemon.server.stop()  # never started: closes its socket
        daemon.pipeline.close()
        assert daemon.node is not None
        daemon.node.close()
    assert '<meta http-equiv="refresh" content="30">' in page
    dom = Dom(page)
    assert dom["resolved"].count("cause_x on GPU") == 8
    assert "cause_x on GPU 0: fired" in dom["resolved"] and "(util 0%)" in dom["resolved"]


def test_a_failing_page_answers_500_and_the_server_goes_on():
    store = Store()
    exporter = Exporter(store, [], [], time.time)
    exporter.render()

    def broken() -> bytes:
        raise RuntimeError("bug")

    server = MetricsServer(exporter, "127.0.0.1", 0, broken)
    server.start()
    try:
        base = "http://{}:{}".format(*server.address)
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(base + "/", timeout=5)
        assert failed.value.code == 500
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            assert response.status == 200
    finally:
        server.stop()


# the real daemon in headless Chromium ------------------------------------------------

PHONE, DESKTOP = (390, 844), (1280, 1440)  # the desktop shot holds the whole page
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    # no network here: keep Chromium from reaching for it
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def fast_pcie_files(where: Path) -> Path:
    """pcie-gen3-under-load with its fault 1 s in, the rule's `for` 1 s: a config file."""
    scenarios = resources.files("gpuwatchd.sim.scenarios")
    scenario = yaml.safe_load((scenarios / "pcie-gen3-under-load.yaml").read_text())
    scenario["phases"] = scenario["phases"][:2]
    scenario["phases"][0]["duration"], scenario["phases"][1]["duration"] = "1s", "1h"
    del scenario["expect"]
    rules = yaml.safe_load((resources.files("gpuwatchd.rules") / "default.yaml").read_text())
    next(r for r in rules["rules"] if r["name"] == CAUSE)["for"] = "1s"
    (where / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    (where / "rules.yaml").write_text(yaml.safe_dump(rules))
    config = {"rules_file": str(where / "rules.yaml"), "sources": {"pcie": {"interval": "1s"}}}
    (where / "config.yaml").write_text(yaml.safe_dump(config))
    return where / "config.yaml"


def firing(metrics_url: str) -> bool:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return any(
        s.labels["cause"] == CAUSE and s.labels["gpu"] == "3" and s.value == 1
        for family in text_string_to_metric_families(text)
        if family.name == "gpuwatchd_starvation_active"
        for s in family.samples
    )


@contextmanager
def firing_daemon(where: Path) -> Iterator[str]:
    """The daemon on the fast scenario; yields the page's URL once GPU 3's cause fires."""
    config = fast_pcie_files(where)
    with running_daemon(str(where / "scenario.yaml"), "--config", str(config)) as metrics_url:
        deadline = time.monotonic() + 30
        while not firing(metrics_url):
            assert time.monotonic() < deadline, f"{CAUSE} did not fire within 30s"
            time.sleep(0.2)
        yield metrics_url.removesuffix("metrics")


def chromium(where: Path, url: str, *args: str) -> str:
    profile = tempfile.mkdtemp(prefix="chromium-", dir=where)
    command = [require_tool("chromium"), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(where: Path, url: str, path: Path, size: tuple[int, int]) -> None:
    chromium(where, url, f"--screenshot={path}", f"--window-size={size[0]},{size[1]}")


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_chromium_shows_the_firing_cause_on_a_phone_and_a_desktop(tmp_path):
    require_tool("chromium")
    with firing_daemon(tmp_path) as url:
        dom = Dom(chromium(tmp_path, url, "--dump-dom"))
        for size, name in ((PHONE, "phone.png"), (DESKTOP, "desktop.png")):
            screenshot(tmp_path, url, tmp_path / name, size)
            assert png_size(tmp_path / name) == size
    rules = yaml.safe_load((tmp_path / "rules.yaml").read_text())["rules"]
    spec = next(r for r in rules if r["name"] == CAUSE)
    cause = dom[f"gpu-3-{CAUSE}"]
    assert "firing for" in cause and "Gen3 x16 of Gen4 x16" in cause
    assert " ".join(spec["remedy"].split()).replace("`", "") in cause
    assert spec["severity"] in cause and spec["dimension"] in cause
    assert dom["verdict"].startswith(f"1 of 8 GPUs starved: {CAUSE} on GPU 3")
    assert dom["hostname"] == "sim-hgx-a100"
    for source in ("nvml", "pcie", "dcgm", "cpu"):
        assert dom[f"source-{source}"].startswith(f"{source} up")
    assert {"/metrics", "/healthz", "#gpu-3"} <= set(dom.links)
    assert dom.meta["viewport"].startswith("width=device-width")
    assert dom.meta["refresh"] == "30"  # a screen left open stays current
    # the cause once, with its remedy; where GPU 3 is and whose process runs on it
    assert dom[f"cause-{CAUSE}"].startswith(f"{CAUSE} GPU 3") and "BIOS" in dom[f"cause-{CAUSE}"]
    assert re.search(r"PCI \S+:\S+ · pid \d+", dom["gpu-3"]), dom["gpu-3"]
    assert "read the in-process probe" in dom["probe-rules"]
    shown = r"utilization \d+% · \d+ °C · power \d+ W of \d+ W"
    assert re.fullmatch(shown, dom["readings-3"]), dom["readings-3"]


if __name__ == "__main__":  # regenerate docs/status-page.png: python tests/test_status_page.py PATH
    with tempfile.TemporaryDirectory() as tmp, firing_daemon(Path(tmp)) as page_url:
        screenshot(Path(tmp), page_url, Path(sys.argv[1]).resolve(), DESKTOP)
