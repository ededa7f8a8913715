"""Wiring: config -> sources -> pollers -> store -> exporter -> HTTP, in real time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuwatchd.config import Config
from gpuwatchd.exporter import Exporter, MetricsServer
from gpuwatchd.metrics import MetricSpec
from gpuwatchd.rules import (
    RULE_METRICS,
    Catalog,
    RuleEngine,
    RuleFileWatcher,
    Transition,
    load_rules,
)
from gpuwatchd.scheduler import Poller, ThreadedScheduler
from gpuwatchd.sim.node import SimNode
from gpuwatchd.sim.scenario import Scenario
from gpuwatchd.sources import Context, Source, load_builtin_sources
from gpuwatchd.status_page import StatusPage
from gpuwatchd.store import Store

log = logging.getLogger(__name__)


def build_sources(config: Config, context: Context) -> list[Source]:
    registry = load_builtin_sources()
    return [registry[name](cfg, context) for name, cfg in config.sources.enabled().items()]


def all_specs(sources: list[Source]) -> list[MetricSpec]:
    return [spec for source in sources for spec in source.metrics]


class Pipeline:
    """Sources, store, pollers and exporter for one node, real or simulated."""

    def __init__(self, config: Config, context: Context, now: Callable[[], float]) -> None:
        self.config = config
        self.now = now
        self.sources = build_sources(config, context)
        self.store = Store(history_seconds=config.history)
        self.pollers = [Poller(source, self.store, now) for source in self.sources]
        self._by_name = {poller.name: poller for poller in self.pollers}
        catalog = Catalog.builtin()  # every source's series, enabled or not
        rules = load_rules(config.rules_file, catalog)  # RulesError: refuse to start
        if rules.max_window > config.history:
            log.warning(
                "rules: a window of %gs is longer than the %gs of history kept (`history`)",
                rules.max_window,
                config.history,
            )
        self.engine = RuleEngine(self.store, rules, self._source_up, catalog)
        self.rules_watcher = RuleFileWatcher(self.engine, config.rules_file, now)
        specs = [*all_specs(self.sources), *RULE_METRICS]
        self.exporter = Exporter(self.store, self.pollers, specs, now, [self.engine.rows])

    def _source_up(self, name: str) -> bool:
        poller = self._by_name.get(name)
        return poller is not None and poller.health.up

    def evaluate_rules(self) -> list[Transition]:
        """Reload the rules if asked to or their file changed, then evaluate them."""
        self.rules_watcher.check()
        return self.engine.evaluate(self.now())

    def close(self) -> None:
        for source in self.sources:
            try:
                source.close()
            except Exception as e:  # closing must not stop the others from closing
                log.warning("source %s: close failed: %s", source.name, e)


class Daemon:
    """`gpuwatchd run`: threads for the sources, the evaluation loop and the HTTP server."""

    def __init__(self, config: Config, scenario: Scenario | None = None) -> None:
        self.config = config
        self.node = SimNode(scenario, virtual=False, loop=True) if scenario else None
        if self.node is not None:
            context, now = self.node.context(), self.node.clock.now
        else:
            context, now = Context(procfs=config.procfs, sysfs=config.sysfs), time.time
        try:
            self.pipeline = Pipeline(config, context, now)
        except Exception:  # a bad rule file: leave no simulated node behind
            if self.node is not None:
                self.node.close()
            raise
        self.scheduler = ThreadedScheduler(self.pipeline.pollers)
        host, port = config.listen_address()
        pipeline = self.pipeline
        hostname = context.extras.get("hostname")  # a simulated node's; else this machine's
        status = StatusPage(pipeline.store, pipeline.pollers, now, pipeline.engine, hostname)
        self.server = MetricsServer(pipeline.exporter, host, port, status)
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._evaluate_forever, name="evaluate", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def start(self) -> None:
        self.scheduler.start()
        self.pipeline.exporter.render()
        self.server.start()
        self._loop.start()

    def evaluate_once(self) -> None:
        if self.node is not None:
            self.node.tick()
        now = self.pipeline.now()
        for poller in self.pipeline.pollers:
            poller.check_hung(now)
        self.pipeline.evaluate_rules()
        self.pipeline.exporter.render()

    def reload_rules(self) -> None:
        """Reload the rule file at the next cycle (SIGHUP)."""
        self.pipeline.rules_watcher.request()

    def _evaluate_forever(self) -> None:
        interval = self.config.evaluation_interval
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.evaluate_once()
            except Exception:  # the loop must survive anything one cycle throws
                log.exception("evaluation cycle failed")
            next_at = max(next_at + interval, time.monotonic())
            self._stop.wait(next_at - time.monotonic())

    def request_stop(self) -> None:
        self._stop.set()

    def wait(self) -> None:
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()
        self.scheduler.stop()
        self.server.stop()
        self.pipeline.close()
        if self.node is not None:
            self.node.close()
