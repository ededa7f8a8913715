"""Wiring: config -> sources -> pollers -> store -> exporter -> HTTP, in real time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from gpuwatchd.config import Config
from gpuwatchd.exporter import Exporter
from gpuwatchd.metrics import MetricSpec
from gpuwatchd.notify import Notifier
from gpuwatchd.rules import (
    RULE_METRICS,
    Catalog,
    RuleEngine,
    RuleFileWatcher,
    Transition,
    load_rules,
)
from gpuwatchd.rules.engine import FIRING
from gpuwatchd.scheduler import LANES, Poller, ThreadedScheduler, name_os_thread
from gpuwatchd.sources import Context, Source, load_builtin_sources
from gpuwatchd.status_page import StatusPage
from gpuwatchd.store import Store
from gpuwatchd.web import MetricsServer

if TYPE_CHECKING:  # the simulator is loaded only to simulate (run --simulate)
    from gpuwatchd.sim.node import SimNode
    from gpuwatchd.sim.scenario import Scenario

log = logging.getLogger(__name__)


def build_sources(config: Config, context: Context) -> list[Source]:
    registry = load_builtin_sources()
    return [registry[name](cfg, context) for name, cfg in config.sources.enabled().items()]


def all_specs(sources: list[Source]) -> list[MetricSpec]:
    return [spec for source in sources for spec in source.metrics]


def _changed(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two config dumps."""
    keys = []
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(prefix + key)
    return sorted(keys)


class SteadyClock:
    """Unix time that moves with the monotonic clock, for everything the daemon measures
    (poll timeouts, staleness, rule windows and `for`, seconds starved): a step of the
    system clock (NTP at boot, `date -s`) would otherwise mark every source down or
    stale, fire pending causes at once, or add the step to `starvation_seconds_total`.
    Timestamps the daemon exports are put on the wall clock of the moment (`to_wall`),
    so they stay true after a step."""

    def __init__(
        self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic
    ) -> None:
        self._wall, self._mono = wall, mono
        self._offset = wall() - mono()

    def __call__(self) -> float:
        return self._mono() + self._offset

    def to_wall(self, t: float) -> float:
        """`t`, a time of this clock, on the wall clock as it reads now."""
        return t + self._wall() - self()


class Pipeline:
    """Sources, store, pollers and exporter for one node, real or simulated.

    `now` is the clock the pipeline measures with (monotonic in steps: `SteadyClock`, or
    a simulated node's); `to_wall` puts its times on the wall clock for export."""

    def __init__(
        self,
        config: Config,
        context: Context,
        now: Callable[[], float],
        to_wall: Callable[[float], float] | None = None,
    ) -> None:
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
        wall = now if to_wall is None else (lambda: to_wall(now()))  # reload time, exported
        self.rules_watcher = RuleFileWatcher(self.engine, config.rules_file, wall)
        specs = [*all_specs(self.sources), *RULE_METRICS]
        self.exporter = Exporter(
            self.store,
            self.pollers,
            specs,
            now,
            self.engine.exposition(),
            to_wall,
            detail=config.detail_metrics,
        )

    def _source_up(self, name: str) -> bool:
        poller = self._by_name.get(name)
        return poller is not None and poller.health.up

    def reconfigure(self, new: Config) -> Config:
        """Apply a config read again (SIGHUP): the rule file, the evaluation interval and
        the sources' intervals and timeouts change now; any other change needs a restart
        and is logged, not applied. Returns the config in force."""
        old = self.config
        merged = old.model_dump()
        merged["rules_file"] = new.rules_file
        merged["evaluation_interval"] = new.evaluation_interval
        for poller in self.pollers:
            fresh = getattr(new.sources, poller.name)
            merged["sources"][poller.name].update(interval=fresh.interval, timeout=fresh.timeout)
        try:
            running = Config.model_validate(merged)
        except ValidationError as e:  # e.g. a DCGM timeout below the connect_timeout kept
            log.error("config: not reloaded: what applies now conflicts with the rest: %s", e)
            return old
        if needs_restart := _changed(running.model_dump(), new.model_dump()):
            log.warning(
                "config: %s changed; that needs a restart (running on with the old values)",
                ", ".join(needs_restart),
            )
        for poller in self.pollers:
            fresh = getattr(running.sources, poller.name)
            poller.retime(fresh.interval, fresh.timeout)
        self.rules_watcher.path = running.rules_file
        if applied := _changed(old.model_dump(), running.model_dump()):
            log.info("config: reloaded: %s", ", ".join(applied))
        self.config = running
        return running

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


causes_log = logging.getLogger("gpuwatchd.causes")


def log_transitions(transitions: list[Transition]) -> None:
    """The journal's account of the causes: each firing with its evidence (a warning, as
    the page it raises), each stop. Pending and not-evaluable changes stay off it."""
    for t in transitions:
        if t.new == FIRING:
            causes_log.warning("GPU %s: %s firing: %s", t.where, t.cause, t.detail)
        elif t.old == FIRING:
            causes_log.info("GPU %s: %s resolved (now %s)", t.where, t.cause, t.new)


class Daemon:
    """`gpuwatchd run`: threads for the sources, the evaluation loop and the HTTP server."""

    def __init__(
        self, config: Config, scenario: Scenario | None = None, start_at: float = 0.0
    ) -> None:
        """`scenario`: serve a simulated node, from `start_at` seconds into it."""
        self.config = config
        self.node: SimNode | None = None
        if scenario is not None:
            from gpuwatchd.sim.node import SimNode

            self.node = SimNode(scenario, virtual=False, loop=True, start_at=start_at)
        to_wall = None  # a simulated node's clock is monotonic already
        if self.node is not None:
            context, now = self.node.context(), self.node.clock.now
        else:
            context = Context(procfs=config.procfs, sysfs=config.sysfs)
            clock = SteadyClock()
            now, to_wall = clock, clock.to_wall
        try:
            self.pipeline = Pipeline(config, context, now, to_wall)
        except BaseException:  # a bad rule file: leave no simulated node behind
            if self.node is not None:
                self.node.close()
            raise
        self.scheduler = ThreadedScheduler(self.pipeline.pollers, lanes=LANES)
        host, port = config.listen_address()
        pipeline = self.pipeline
        hostname = context.extras.get("hostname")  # a simulated node's; else this machine's
        self.status = StatusPage(
            pipeline.store, pipeline.pollers, now, pipeline.engine, hostname, to_wall
        )
        try:
            self.server = MetricsServer(
                pipeline.exporter, host, port, self.status, web_config_file=config.web_config_file
            )
        except BaseException:  # a port in use, a bad web config: nothing left behind either
            pipeline.close()
            if self.node is not None:
                self.node.close()
            raise
        self.notifier = Notifier(config.evaluation_interval)  # systemd: READY=1, watchdog
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._evaluate_forever, name="evaluate", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def start(self) -> None:
        if self.node is not None:
            self.node.start()  # the simulated node's files, kept current by its own thread
        self.scheduler.start()
        self.pipeline.exporter.render()
        self.server.start()
        self.notifier.ready()  # serving; the loop's watchdog pings follow
        self._loop.start()

    def evaluate_once(self) -> None:
        now = self.pipeline.now()
        self.scheduler.check_hung(now)  # a stuck poll: down, then a fresh thread
        transitions = self.pipeline.evaluate_rules()
        log_transitions(transitions)
        self.status.record(transitions)
        exporter = self.pipeline.exporter
        exporter.refresh()  # the rules' families; the sources' when a scrape comes:
        exporter.render_ahead(now, self.config.evaluation_interval)  # or just before one

    def reload(self, config: Config | None = None) -> None:
        """SIGHUP: apply `config` (the file read again; None: unchanged) as far as it can
        change while running, and reload the rule file at the next cycle."""
        if config is not None:
            self.config = self.pipeline.reconfigure(config)
        self.pipeline.rules_watcher.request()

    def _evaluate_forever(self) -> None:
        name_os_thread("evaluate")
        next_at = time.monotonic()
        while not self._stop.is_set():
            interval = self.config.evaluation_interval  # a reload may change it
            try:
                self.evaluate_once()
            except Exception:  # the loop must survive anything one cycle throws
                log.exception("evaluation cycle failed")
            else:  # only a loop that evaluates is alive: a wedged one gets restarted
                self.notifier.alive()
            next_at = max(next_at + interval, time.monotonic())
            self._stop.wait(next_at - time.monotonic())

    def request_stop(self) -> None:
        self._stop.set()

    def wait(self) -> None:
        self._stop.wait()

    def stop(self) -> None:
        self.notifier.stopping()
        self._stop.set()
        self.scheduler.stop()
        self.server.stop()
        self.pipeline.close()
        if self.node is not None:
            self.node.close()
