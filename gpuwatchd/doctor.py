"""`gpuwatchd doctor`: a one-shot diagnosis of this node, as the seed's checklist.

On this node the sources run for a short real-time window (each polled three times: at
the start, the middle and the end, so rate-based sources have rates whatever their
configured interval), then every rule is evaluated once on every GPU without waiting out
its `for` (`RuleEngine.diagnose`), and the host checks below judge the host series alone,
so they give verdicts with or without a GPU. With `--simulate` the simulated node is
played in virtual time through `Simulation` up to `--at`, which is instant and
deterministic, then diagnosed the same way. Without `--at` that is the moment the
scenario's expected causes hold (`expected_moment`).

Exit status (docs/doctor.md):
  0  every check ran and nothing holds;
  1  a cause holds on some GPU, or a host check found a problem;
  2  doctor could not run (bad configuration, rules or scenario: raised by the CLI);
  3  nothing holds, but some GPU checks could not run: no GPU or driver, or a dimension
     none of whose rules could be evaluated.
A problem outranks what could not be checked: scripts act on 1 first.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.daemon import Pipeline
from gpuwatchd.exposition import visible
from gpuwatchd.rules.engine import HOLDS, NOT_EVALUABLE, Finding
from gpuwatchd.sim.scenario import Expectation, Scenario
from gpuwatchd.sources import Context
from gpuwatchd.status_page import Where, gpu_places
from gpuwatchd.store import Store

DIMENSIONS = ("pcie", "input", "compute", "communication", "driver", "system")
OK, PROBLEM, NOT_CHECKED = "ok", "problem", "not checked"
# evidence worth a look that does not on its own say the GPUs starve: shown, not counted
NOTICE = "notice"
EXIT_OK, EXIT_PROBLEM, EXIT_NOT_CHECKED = 0, 1, 3  # 2: could not run (the CLI)

# Live series at one moment: name -> labels -> value.
Latest = dict[str, dict[tuple[str, ...], float]]

# GPU evidence read straight from the store for a dimension: (label, series, scale,
# unit, how several series of one name are summed up: the worst of them). The host's
# series are the host checks' evidence.
Aggregate = Callable[[list[float]], float]
EVIDENCE: dict[str, tuple[tuple[str, str, float, str, Aggregate], ...]] = {
    "pcie": (
        ("link gen", "gpuwatchd_gpu_pcie_link_generation", 1, "", min),
        ("max gen", "gpuwatchd_gpu_pcie_link_generation_max", 1, "", max),
        ("width", "gpuwatchd_gpu_pcie_link_width", 1, "", min),
    ),
    "compute": (("gpu util", "gpuwatchd_gpu_utilization_ratio", 100, "%", max),),
}

# -- host checks ------------------------------------------------------------------------------
# What the host alone can starve a GPU with, judged from the host series (cpu, disks,
# interrupts sources), so they give verdicts with or without a GPU. Rates are over the
# last poll interval. The thresholds (the physics is each check's `why`, in HOST_CHECKS):
SATURATED_CORE = 0.95  # busy share of one core, steal included
IOWAIT = 0.2  # share of the node's CPU time idle with I/O outstanding
DISK_BUSY, DISK_AWAIT = 0.95, 0.010  # iostat %util / 100, and await in seconds
STEAL = 0.1  # share of the node's CPU time taken by the hypervisor
MEMORY_PRESSURE = 0.1  # PSI memory `some` avg10: share of time a task stalled on memory
# an IRQ storm is the interrupts source's own `storm_threshold` (configuration)


@dataclass(frozen=True)
class HostCheckSpec:
    name: str
    dimension: str
    criterion: str  # when it is a problem
    why: str  # the physics behind the criterion
    judge: Callable[[Latest, Config], tuple[str, str]]  # -> (status, evidence)
    remedy: str


@dataclass
class HostCheck:
    check: str
    dimension: str
    status: str  # OK, PROBLEM, NOTICE or NOT_CHECKED
    evidence: str
    criterion: str
    remedy: str


def _fmt(value: float) -> str:
    """Three significant digits, but whole numbers from 100 on (45000/s, not 4.5e+04/s)."""
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.3g}"


def _pct(ratio: float) -> str:
    return f"{_fmt(ratio * 100)}%"


def _by_first_label(latest: Latest, name: str) -> dict[str, float]:
    return {labels[0]: value for labels, value in latest.get(name, {}).items()}


def _one(latest: Latest, name: str, *labels: str) -> float | None:
    return latest.get(name, {}).get(labels)


def _status(problem: bool) -> str:
    return PROBLEM if problem else OK


def _saturated_core(latest: Latest, config: Config) -> tuple[str, str]:
    cores = _by_first_label(latest, "gpuwatchd_cpu_busy_ratio")
    if not cores:  # per_core off: only the busiest core's ratio is known
        busiest = _one(latest, "gpuwatchd_cpu_busy_ratio_max")
        if busiest is None:
            return NOT_CHECKED, "no CPU busy reading (cpu source)"
        status = NOTICE if busiest >= SATURATED_CORE else OK
        return status, f"busiest core {_pct(busiest)} busy"
    hot = [cpu for cpu, busy in cores.items() if busy >= SATURATED_CORE]
    top = max(cores, key=lambda cpu: cores[cpu])
    if not hot:
        return OK, f"busiest core cpu {top} {_pct(cores[top])} busy"
    # a notice, not a problem: a rank's main thread spinning on the GPU also fills a
    # core; the GPU rules (dataloader_single_process, host_cpu_bound) judge the job
    return NOTICE, (
        f"cpu {number_ranges(hot)} at or over {_pct(SATURATED_CORE)} busy "
        f"({len(hot)} of {len(cores)} cores, busiest {_pct(cores[top])})"
    )


def _iowait(latest: Latest, config: Config) -> tuple[str, str]:
    iowait = _one(latest, "gpuwatchd_cpu_iowait_ratio")
    if iowait is None:
        return NOT_CHECKED, "no iowait reading (cpu source)"
    return _status(iowait >= IOWAIT), f"{_pct(iowait)} of CPU time waiting on I/O"


def _saturated_disk(latest: Latest, config: Config) -> tuple[str, str]:
    busy = _by_first_label(latest, "gpuwatchd_disk_utilization_ratio")
    wait = _by_first_label(latest, "gpuwatchd_disk_await_seconds")
    if not busy:
        return NOT_CHECKED, "no disk reading (disks source)"

    def describe(disk: str) -> str:
        return f"{disk} {_pct(busy[disk])} busy, {_fmt(wait.get(disk, 0) * 1000)} ms await"

    saturated = sorted(d for d in busy if busy[d] >= DISK_BUSY and wait.get(d, 0) >= DISK_AWAIT)
    if saturated:
        return PROBLEM, "; ".join(map(describe, saturated))
    return OK, f"busiest disk {describe(max(busy, key=lambda d: busy[d]))}"


def _steal(latest: Latest, config: Config) -> tuple[str, str]:
    steal = _one(latest, "gpuwatchd_cpu_steal_ratio")
    if steal is None:
        return NOT_CHECKED, "no steal reading (cpu source)"
    return _status(steal >= STEAL), f"{_pct(steal)} of CPU time stolen by the hypervisor"


def _irq_storm(latest: Latest, config: Config) -> tuple[str, str]:
    busiest = _by_first_label(latest, "gpuwatchd_interrupt_max_line_per_second")
    if not busiest:
        return NOT_CHECKED, "no interrupt rates (interrupts source)"
    cls = max(busiest, key=lambda c: busiest[c])
    line = f"busiest IRQ line {_fmt(busiest[cls])}/s ({cls})"
    storms = sum(latest.get("gpuwatchd_interrupt_storm_lines", {}).values())
    if not storms:
        return OK, line
    threshold = _fmt(config.sources.interrupts.storm_threshold)
    per_cpu = latest.get("gpuwatchd_cpu_interrupts_per_second", {})
    on_cpus = {cpu: rate for (cpu, of), rate in per_cpu.items() if of == cls}
    where = ""
    if on_cpus:  # where the storm lands: the core it slows
        cpu = max(on_cpus, key=lambda c: on_cpus[c])
        where = f", {_fmt(on_cpus[cpu])}/s of {cls} interrupts on cpu {cpu}"
    return PROBLEM, f"{_fmt(storms)} IRQ line(s) over {threshold}/s, {line}{where}"


def _memory_pressure(latest: Latest, config: Config) -> tuple[str, str]:
    some = _one(latest, "gpuwatchd_pressure_ratio", "memory", "some", "10s")
    available = _one(latest, "gpuwatchd_memory_available_bytes")
    total = _one(latest, "gpuwatchd_memory_total_bytes")
    memory = ""
    if available is not None and total:
        memory = f"; {_fmt(available / 2**30)} GiB of {_fmt(total / 2**30)} GiB available"
    if some is None:
        return NOT_CHECKED, f"no PSI (/proc/pressure/memory){memory}"
    evidence = f"tasks stalled on memory {_pct(some)} of the last 10 s{memory}"
    return _status(some >= MEMORY_PRESSURE), evidence


HOST_CHECKS = (
    HostCheckSpec(
        name="saturated core",
        dimension="input",
        criterion=f"a core at or over {_pct(SATURATED_CORE)} busy",
        why="a core under 5 % idle has no headroom: a serial stage on it (a Python main "
        "thread loading data with `num_workers=0`, a GIL-bound loop, a NIC's interrupts "
        "pinned there) cannot go faster; a fully used core reads 97-100 % at the kernel's "
        "tick granularity. Steal counts as busy: the vCPU wanted to run",
        judge=_saturated_core,
        remedy="See what runs there (`top -H`, then `py-spy dump --pid PID`): a DataLoader "
        "with num_workers=0 or a GIL-bound loop needs worker processes; interrupts pinned "
        "to the core need spreading (irqbalance). A rank's main thread spinning while it "
        "waits for the GPU also reads 100 % and is harmless.",
    ),
    HostCheckSpec(
        name="iowait",
        dimension="input",
        criterion=f"iowait at or over {_pct(IOWAIT)} of CPU time",
        why="iowait (idle with I/O outstanding) is averaged over every core, so the core "
        "count dilutes it; a fifth of all CPU time waiting on storage means the node's "
        "work waits on its disks (a node-wide sign; the `storage_io_bound` rule judges "
        "the disks the job reads)",
        judge=_iowait,
        remedy="Find who waits on which device (`iostat -x 1`, `pidstat -d 1`); stage the "
        "dataset on local NVMe or in page cache, read a sharded sequential format, "
        "prefetch more.",
    ),
    HostCheckSpec(
        name="saturated disk",
        dimension="input",
        criterion=f"a disk at or over {_pct(DISK_BUSY)} busy and {_fmt(DISK_AWAIT * 1000)} ms"
        " await",
        why="`%util` alone is no limit for devices serving requests in parallel (NVMe); "
        "busy nearly all the time *and* requests taking over 10 ms (NVMe answers in "
        "0.1-1 ms, a disk seeks in 5-10 ms) means requests queue",
        judge=_saturated_disk,
        remedy="The device queues requests (`iostat -x 1`): spread reads over more disks, "
        "stage the data on faster storage or in page cache, use large sequential reads "
        "(WebDataset, TFRecord) instead of many small files.",
    ),
    HostCheckSpec(
        name="cpu steal",
        dimension="system",
        criterion=f"steal at or over {_pct(STEAL)} of CPU time",
        why="the hypervisor takes a tenth of the vCPUs' time, slowing every thread by as "
        "much, in bursts the guest cannot schedule around; a dedicated host reads ~0",
        judge=_steal,
        remedy="The hypervisor is oversubscribed: ask for dedicated (pinned) vCPUs, a "
        "larger or bare-metal instance, or move the VM.",
    ),
    HostCheckSpec(
        name="irq storm",
        dimension="system",
        criterion="an IRQ line over the interrupts source's storm_threshold (default 10000/s)",
        why="at a few microseconds of handler and softirq work each, such a line takes a "
        "visible share of its CPU and trashes its caches; on the core that feeds the GPU, "
        "feeding slows. The evidence names the busiest line and the CPU its class lands on",
        judge=_irq_storm,
        remedy="Find the line (`watch -d cat /proc/interrupts`); spread the device's queues "
        "over more CPUs (irqbalance, set_irq_affinity), keep them off the cores that feed "
        "the GPU, coalesce more interrupts (`ethtool -C DEV adaptive-rx on`).",
    ),
    HostCheckSpec(
        name="memory pressure",
        dimension="system",
        criterion=f"PSI memory some avg10 at or over {_pct(MEMORY_PRESSURE)}",
        why="at least one task stalled on memory (reclaim, swap-in, refaults) a tenth of "
        "the last 10 s: the page cache holding the dataset is being evicted, loader "
        "workers stall on allocation. Not checked without PSI (`/proc/pressure`)",
        judge=_memory_pressure,
        remedy="The kernel is reclaiming memory (`cat /proc/pressure/memory`, `vmstat 1` "
        "si/so): fewer DataLoader workers or a lower prefetch_factor, stop what else "
        "fills memory, or add memory.",
    ),
)


def host_checks(latest: Latest, config: Config) -> list[HostCheck]:
    checks = []
    for spec in HOST_CHECKS:
        status, evidence = spec.judge(latest, config)
        checks.append(
            HostCheck(spec.name, spec.dimension, status, evidence, spec.criterion, spec.remedy)
        )
    return checks


# -- the report --------------------------------------------------------------------------------


@dataclass
class DimensionReport:
    dimension: str
    status: str  # OK, PROBLEM or NOT_CHECKED
    evidence: list[str] = field(default_factory=list)
    causes: list[dict[str, str]] = field(default_factory=list)  # gpu, cause, summary, remedy


@dataclass(frozen=True)
class DaemonProbe:
    """The probe socket a running gpuwatchd receives on: the in-process probe's reports go
    to the daemon, which judges the rules that read them; doctor leaves the socket alone."""

    socket: str
    status_page: str  # where the daemon shows those rules' verdicts


@dataclass
class Report:
    node: str  # "this node" or "simulated node 'NAME' at Ns"
    gpus: list[str]
    no_gpu: str | None  # why no GPU was found, or None
    sources_down: dict[str, str]
    dimensions: list[DimensionReport]
    findings: list[Finding]
    host: list[HostCheck] = field(default_factory=list)
    # rules that read the in-process probe: not evaluable is normal where none reports
    needs_probe: frozenset[str] = frozenset()
    where: dict[str, str] = field(default_factory=dict)  # GPU -> PCI address, pid, job
    daemon_probe: DaemonProbe | None = None  # a running daemon's probe socket, if one

    @property
    def holding(self) -> list[Finding]:
        return [f for f in self.findings if f.status == HOLDS]

    @property
    def host_problems(self) -> list[HostCheck]:
        return [c for c in self.host if c.status == PROBLEM]

    @property
    def holds(self) -> bool:
        return bool(self.holding or self.host_problems)

    @property
    def not_checked(self) -> list[str]:
        """The GPU dimensions none of whose rules could be evaluated."""
        return [d.dimension for d in self.dimensions if d.status == NOT_CHECKED]

    @property
    def exit_code(self) -> int:
        if self.holds:
            return EXIT_PROBLEM
        return EXIT_NOT_CHECKED if self.not_checked else EXIT_OK

    @property
    def verdict(self) -> str:
        """The result line, without its "result: " and exit code."""
        unchecked = self._unchecked()
        if not self.holds:
            if unchecked:
                return f"could not check {unchecked}; no cause holds on what was checked"
            return "no cause holds"
        causes = group_by_text((f.where, f.cause) for f in self.holding)
        held = [f"{cause} on {gpu_list(gpus)}" for gpus, cause in causes]
        held += [f"{c.check} on the host" for c in self.host_problems]
        could_not = f"; could not check {unchecked}" if unchecked else ""
        return f"a cause holds: {', '.join(held)}{could_not}"

    def _unchecked(self) -> str:
        if self.no_gpu is not None:
            return "the GPUs"
        return ", ".join(self.not_checked)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpus": self.gpus,
            "no_gpu": self.no_gpu,
            "sources_down": self.sources_down,
            "dimensions": [asdict(d) for d in self.dimensions],
            "host_checks": [asdict(c) for c in self.host],
            "findings": [asdict(f) for f in self.findings],
            "finding_groups": [
                {"gpus": gpus, **{k: v for k, v in asdict(f).items() if k not in ("gpu", "uuid")}}
                for gpus, f in finding_groups(self.findings)
            ],
            "where": self.where,
            "daemon_probe": None if self.daemon_probe is None else asdict(self.daemon_probe),
            "not_checked": self.not_checked,
            "result": self.verdict,
            "exit_code": self.exit_code,
        }


def _latest(store: Store, now: float) -> Latest:
    latest: Latest = {}
    for (name, labels), value in store.latest(now):
        latest.setdefault(name, {})[labels] = value
    return latest


def _evidence(latest: Latest, dimension: str) -> list[str]:
    out = []
    for label, series, scale, unit, aggregate in EVIDENCE.get(dimension, ()):
        values = list(latest.get(series, {}).values())
        if values:
            prefix = f"{aggregate.__name__} " if len(values) > 1 else ""
            out.append(f"{label} {prefix}{_fmt(aggregate(values) * scale)}{unit}")
    return out


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)


def number_ranges(names: Sequence[str]) -> str:
    """ "0-2, 4, 6-7" for indices; names that are not numbers follow as they are."""
    numbers = sorted({int(n) for n in names if n.isdigit()})
    others = sorted({n for n in names if not n.isdigit()})
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return ", ".join(parts + others)


def gpu_list(gpus: Sequence[str]) -> str:
    """ "GPU 3", "GPUs 0-7", "GPUs 0-2, 4-7"."""
    return f"GPU{'s' if len(gpus) > 1 else ''} {number_ranges(gpus)}"


def group_by_text(pairs: Iterable[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(gpu, text) pairs -> (the GPUs, text) per distinct text, in order of first sight."""
    groups: dict[str, list[str]] = {}
    for gpu, text in pairs:
        groups.setdefault(text, []).append(gpu)
    return [(gpus, text) for text, gpus in groups.items()]


def finding_groups(findings: list[Finding]) -> list[tuple[list[str], Finding]]:
    """Findings equal but for their GPU, once each with the GPUs they hold on."""
    groups: dict[tuple[str, ...], tuple[list[str], Finding]] = {}
    for f in findings:
        key = (f.cause, f.dimension, f.severity, f.status, f.detail, f.remedy)
        groups.setdefault(key, ([], f))[0].append(f.where)
    return list(groups.values())


def build_report(pipeline: Pipeline, node: str) -> Report:
    now = pipeline.now()
    findings = pipeline.engine.diagnose(now)
    latest = _latest(pipeline.store, now)
    down = {
        p.name: p.health.last_error or "no successful poll"
        for p in pipeline.pollers
        if not p.health.up
    }
    gpus = sorted({f.gpu for f in findings}, key=_gpu_order)
    no_gpu = None
    if not gpus:
        no_gpu = down.get("nvml") or "the NVML source found no GPU"
        if "nvml" not in {p.name for p in pipeline.pollers}:
            no_gpu = "the NVML source is disabled in the configuration"
    dimensions = []
    for dim in DIMENSIONS:
        mine = [f for f in findings if f.dimension == dim]
        holding = [f for f in mine if f.status == HOLDS]
        evaluated = [f for f in mine if f.status != NOT_EVALUABLE]
        status = PROBLEM if holding else OK if evaluated else NOT_CHECKED
        report = DimensionReport(dim, status, _evidence(latest, dim))
        report.causes = [
            {"gpu": f.where, "cause": f.cause, "summary": f.detail, "remedy": f.remedy}
            for f in holding
        ]
        dimensions.append(report)
    host = host_checks(latest, pipeline.config)
    rules = pipeline.engine.rules.rules
    needs_probe = frozenset(r.name for r in rules if "probe" in r.expr.sources)
    places = gpu_places(pipeline.store.latest(now))
    where = {f.gpu: text for f in findings if (text := places.get(f.uuid, Where()).text())}
    return Report(node, gpus, no_gpu, down, dimensions, findings, host, needs_probe, where)


def diagnose_node(
    config: Config, window: float, sleep: Callable[[float], None] = time.sleep
) -> Report:
    """Poll every enabled source three times over `window` seconds, then diagnose."""
    config = with_per_core(config)
    daemon = daemon_probe(config)
    if daemon is not None:  # its socket: binding it would fail, and the reports are its
        config = _without_probe(config)
    pipeline = Pipeline(config, Context(procfs=config.procfs, sysfs=config.sysfs), time.time)
    try:
        for i in range(3):
            if i:
                sleep(window / 2)
            for poller in pipeline.pollers:
                poller.poll()
        report = build_report(pipeline, "this node")
        report.daemon_probe = daemon
        return report
    finally:
        pipeline.close()


def daemon_probe(config: Config) -> DaemonProbe | None:
    """The configured probe socket, if a process (the node's daemon) receives on it."""
    probe = config.sources.probe
    if not probe.enabled:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as client:
        try:
            client.connect(os.fspath(probe.socket))  # sends nothing
        except OSError:
            return None  # none there, or a dead daemon's file: doctor listens itself
    return DaemonProbe(str(probe.socket), status_page(config))


def status_page(config: Config) -> str:
    """The daemon's page as the config has it listen: on this node, through loopback."""
    host, port = config.listen_address()
    if host in ("", "0.0.0.0", "::"):
        host = "localhost"
    if config.web_config_file is not None:  # TLS or not is in that file
        return f"/ on {host}:{port} (web config {config.web_config_file})"
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"


def _without_probe(config: Config) -> Config:
    probe = config.sources.probe.model_copy(update={"enabled": False})
    sources = config.sources.model_copy(update={"probe": probe})
    return config.model_copy(update={"sources": sources})


# A second before a fault ends every reading is still the fault's (the simulation steps
# once per evaluation_interval, 1 s by default); at `ends` the repaired values arrive.
FAULT_END_MARGIN = 1.0


def _holding_window(expectation: Expectation, end: float) -> tuple[float, float]:
    """From `by` (the cause must be firing, so its condition holds) to the fault's end."""
    last = end if expectation.ends is None else expectation.ends - FAULT_END_MARGIN
    by = last if expectation.by is None else expectation.by
    return max(expectation.onset, min(by, last)), last


def expected_moment(scenario: Scenario) -> float:
    """When the scenario's expected causes hold: the latest `by` of its expectations that
    must fire, kept inside the fault windows (before `ends`); where those windows do
    not all overlap, the `by` inside the most of them. Its end if none must fire."""
    end = scenario.duration
    windows = [_holding_window(e, end) for e in scenario.expect if not e.never]
    if not windows:
        return end

    def holding(t: float) -> int:
        return sum(start <= t <= last for start, last in windows)

    return max((start for start, _ in windows), key=lambda t: (holding(t), t))


def with_per_core(config: Config) -> Config:
    """The config with per-core CPU series on: a one-shot diagnosis names the saturated
    core (no Prometheus pays for the series)."""
    cpu = config.sources.cpu.model_copy(update={"per_core": True})
    sources = config.sources.model_copy(update={"cpu": cpu})
    return config.model_copy(update={"sources": sources})


def diagnose_simulated(scenario: Scenario, config: Config, at: float | None) -> Report:
    """Play `scenario` in virtual time up to `at` (default: `expected_moment`), then
    diagnose."""
    from gpuwatchd.simulate import Simulation

    why = ""
    if at is None:
        at = expected_moment(scenario)
        firing = any(not e.never for e in scenario.expect)
        why = ", when its expected causes hold" if firing else ", its end (no cause expected)"
    simulation = Simulation(scenario, with_per_core(config))
    try:
        result = simulation.run(until=at)
        node = f"simulated node {scenario.name!r} at {result.simulated_seconds:.0f}s{why}"
        return build_report(simulation.pipeline, node)
    finally:
        simulation.close()


# -- text -----------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _dimension_rows(report: Report) -> list[tuple[str, str, str]]:
    rows = []
    for d in report.dimensions:
        causes = group_by_text((c["gpu"], f"{c['cause']}: {c['summary']}") for c in d.causes)
        evidence = [f"{gpu_list(gpus)} {text}" for gpus, text in causes] + d.evidence
        rows.append((d.dimension, d.status, "; ".join(evidence) or "-"))
    return rows


def _finding_lines(report: Report) -> list[str]:
    """Per GPU: the causes that hold, else "no cause holds", then what was not
    evaluable; a line shared by several GPUs is printed once, with their list."""
    holding = report.holding
    quiet = [gpu for gpu in report.gpus if gpu not in {f.gpu for f in holding}]
    # why a rule cannot judge a GPU (a source down, a series this driver lacks): the
    # on-call must know which causes this node cannot see, and why
    unknown: dict[tuple[str, str], list[str]] = {}
    no_probe: dict[str, list[str]] = {}
    for f in report.findings:
        if f.status == NOT_EVALUABLE:
            if f.cause in report.needs_probe:
                no_probe.setdefault(f.where, []).append(f.cause)
            else:
                unknown.setdefault((f.where, f.detail), []).append(f.cause)
    pairs = [(f.where, f"{f.cause} ({f.dimension}, {f.severity}): {f.detail}") for f in holding]
    pairs += [(gpu, "no cause holds") for gpu in quiet]
    pairs += [
        (gpu, f"cannot judge {', '.join(causes)}: {why}") for (gpu, why), causes in unknown.items()
    ]
    pairs += [(gpu, f"{_probe_rules(report)}: {', '.join(c)}") for gpu, c in no_probe.items()]
    lines = [f"  {gpu_list(gpus)}: {text}" for gpus, text in group_by_text(pairs)]
    starved = sorted({f.gpu for f in holding if f.gpu in report.where}, key=_gpu_order)
    return lines + [f"  where GPU {gpu} is: {report.where[gpu]}" for gpu in starved]


def _probe_rules(report: Report) -> str:
    """What became of the rules that read the in-process probe."""
    if report.daemon_probe is not None:  # normal beside a daemon: not a fault
        return f"judged by the running gpuwatchd ({report.daemon_probe.status_page})"
    return "need the in-process probe (docs/probe.md), not reporting here"


def format_report(report: Report) -> str:
    lines = []
    if report.no_gpu is not None:
        lines.append(f"no NVIDIA GPU or driver found: {report.no_gpu}")
        lines.append("GPU checks could not run; host checks follow.")
        lines.append("")
    gpus = number_ranges(report.gpus) or "none"
    lines.append(f"gpuwatchd doctor: {report.node}, GPUs: {gpus}")
    if report.sources_down:
        lines.append("sources down:")
        lines += [f"  {name}: {why}" for name, why in sorted(report.sources_down.items())]
    if report.daemon_probe is not None:
        daemon = report.daemon_probe
        lines.append(
            f"probe: a running gpuwatchd receives the probe's reports on {daemon.socket}, "
            f"so it judges the rules that read them, not doctor: {daemon.status_page}"
        )
    lines.append("")
    lines += _table(("dimension", "status", "evidence"), _dimension_rows(report))
    lines.append("")
    host_rows = [(c.check, c.dimension, c.status, c.evidence) for c in report.host]
    lines += _table(("host check", "dimension", "status", "evidence"), host_rows)
    remedies = {(c["cause"], c["remedy"]) for d in report.dimensions for c in d.causes}
    remedies |= {(c.check, c.remedy) for c in report.host_problems}
    if remedies:
        lines.append("")
        lines.append("remedies:")
        lines += [f"  {cause}: {remedy}" for cause, remedy in sorted(remedies)]
    if report.gpus:
        lines.append("")
        lines.append("per-GPU findings:")
        lines += _finding_lines(report)
    lines.append("")
    lines.append(f"result: {report.verdict} (exit {report.exit_code})")
    # process names and the kernel's lines are a tenant's to choose: an ESC or OSC
    # sequence must reach the operator's terminal as text, as in the exposition
    return visible("\n".join(lines))
