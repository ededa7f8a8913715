"""Command line: run, simulate (contracts in design.md)."""

from __future__ import annotations

from gpuwatchd import signals  # first of all: from here on SIGHUP is remembered, not fatal

# isort: split
import base64
import contextlib
import json
import logging
import signal
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpuwatchd import __version__
from gpuwatchd.config import Config, ConfigError, load_config
from gpuwatchd.rules.ruleset import RulesError

if TYPE_CHECKING:  # the simulator's models stay out of a production daemon's memory
    from gpuwatchd.daemon import Daemon
    from gpuwatchd.sim.scenario import Scenario

SCENARIO_HELP = "a built-in scenario's name or a path to a scenario file"
log = logging.getLogger("gpuwatchd")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _load(config_file: Path | None, **overrides: Any) -> Config:
    try:
        return load_config(config_file, **overrides)
    except ConfigError as e:
        raise click.ClickException(str(e)) from e


def _scenario(name: str) -> Scenario:
    from gpuwatchd.sim.scenario import load_scenario

    try:
        return load_scenario(name)
    except ConfigError as e:
        raise click.ClickException(str(e)) from e


class _CannotRun(click.ClickException):
    """doctor could not run at all (bad config, rules or scenario): exit 2, not 1."""

    exit_code = 2


config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="YAML configuration file (every key has a default)",
)
log_option = click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuwatchd")
@click.pass_context
def main(ctx: click.Context) -> None:
    """gpuwatchd: is this GPU starved, and on what?"""
    if ctx.invoked_subcommand != "run":
        signals.release()  # only the daemon reloads on SIGHUP


def serve(daemon: Daemon, reread: Callable[[], Config | None]) -> None:
    """Act on signals, in order, until SIGTERM or SIGINT: SIGHUP reloads the config (what
    of it can change while running) and the rules. Signals that came while the daemon
    started are acted on now."""
    while signals.RECEIVED.get() == signal.SIGHUP:
        daemon.reload(reread())


def _reread(config_file: Path | None, **overrides: Any) -> Config | None:
    """The config file read again, or None: no file, or a bad one (logged, not applied)."""
    if config_file is None:
        return None
    try:
        return load_config(config_file, **overrides)
    except ConfigError as e:
        log.error("config: not reloaded, the running configuration stays:\n%s", e)
        return None


@main.command()
@config_option
@click.option("--listen", help="HOST:PORT to serve /metrics on (overrides the config)")
@click.option(
    "--simulate",
    "scenario_name",
    metavar="SCENARIO",
    help=f"serve a simulated node: {SCENARIO_HELP}",
)
@click.option(
    "--at",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="with --simulate: start that many seconds into the scenario (at its fault)",
)
@click.option(
    "--web.config.file",
    "web_config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="TLS and basic auth, in Prometheus exporter-toolkit's web config format "
    "(overrides the config's web_config_file; docs/security.md)",
)
@log_option
def run(
    config_file: Path | None,
    listen: str | None,
    scenario_name: str | None,
    at: float | None,
    web_config_file: Path | None,
    log_level: str,
) -> None:
    """Run the daemon: sample this node and serve Prometheus metrics."""
    signals.catch(signal.SIGTERM, signal.SIGINT)  # acted on once the daemon runs
    from gpuwatchd import memory
    from gpuwatchd.daemon import Daemon
    from gpuwatchd.webconfig import WebConfigError

    memory.limit_arenas()  # before any thread starts
    _setup_logging(log_level)
    overrides: dict[str, Any] = dict(listen=listen, web_config_file=web_config_file)
    config = _load(config_file, **overrides)
    scenario = _scenario(scenario_name) if scenario_name else None
    if at is not None and scenario is None:
        raise click.UsageError("--at: only with --simulate")
    if at is not None and scenario is not None and at >= scenario.duration:
        raise click.UsageError(
            f"--at {at:g}: after the end of scenario {scenario.name!r} ({scenario.duration:g} s)"
        )
    try:
        daemon = Daemon(config, scenario, at or 0.0)
    except RulesError as e:
        raise click.ClickException(f"rules not loaded:\n{e}") from e
    except WebConfigError as e:
        raise click.ClickException(f"web config not loaded:\n{e}") from e
    except OSError as e:
        raise click.ClickException(f"cannot listen on {config.listen}: {e.strerror}") from e
    daemon.start()
    memory.release_startup_garbage()
    host, port = daemon.address
    what = f"simulated node {scenario.name!r}" if scenario else "this node"
    url = f"{daemon.server.scheme}://{host}:{port}/metrics"
    # stderr may be a file on a full disk (ENOSPC): a line nobody can read must not
    # stop a daemon that serves (log records that fail to write are dropped the same way)
    with contextlib.suppress(OSError):
        click.echo(f"gpuwatchd: serving {what} on {url}", err=True)
    serve(daemon, lambda: _reread(config_file, **overrides))
    daemon.stop()


@main.command()
@click.argument("scenario_name", metavar="SCENARIO")
@config_option
@click.option("--until", type=float, help="stop after this many simulated seconds")
@click.option("--metrics", is_flag=True, help="print the final /metrics exposition")
@click.option(
    "--check",
    is_flag=True,
    help="compare the firing causes with the scenario's expectations; exit 1 on a mismatch",
)
@click.option(
    "--rules",
    "rules_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="rule file to use (overrides the config's rules_file)",
)
@click.option(
    "--privileges",
    type=click.Choice(["ptrace", "unprivileged"]),
    default="ptrace",
    show_default=True,
    help="what the daemon may read of other users' processes and the kernel log: ptrace "
    "(root, or CAP_SYS_PTRACE with CAP_DAC_READ_SEARCH, and CAP_SYSLOG), or unprivileged "
    "(the unit and DaemonSet as shipped: their environ, maps, io and fd/ refused, and "
    "/dev/kmsg where the node's dmesg_restrict holds); --check judges the expectations "
    "that hold under it",
)
@log_option
def simulate(
    scenario_name: str,
    config_file: Path | None,
    until: float | None,
    metrics: bool,
    check: bool,
    rules_file: Path | None,
    privileges: str,
    log_level: str,
) -> None:
    """Replay SCENARIO in virtual time, as fast as the CPU allows.

    SCENARIO is a built-in scenario's name or a path to a scenario file.
    """
    from gpuwatchd.sim.check import check as check_expectations
    from gpuwatchd.sim.check import (
        firing_instances,
        firing_intervals,
        firing_summaries,
        format_verdicts,
    )
    from gpuwatchd.simulate import Simulation, format_result

    _setup_logging(log_level if log_level != "info" else "warning")
    config = _load(config_file, rules_file=rules_file)
    scenario = _scenario(scenario_name)
    try:
        simulation = Simulation(scenario, config, ptrace=privileges == "ptrace")
    except RulesError as e:
        raise click.ClickException(f"rules not loaded:\n{e}") from e
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    try:
        result = simulation.run(until=until)
    finally:
        simulation.close()
    click.echo(format_result(result))
    if metrics:
        sys.stdout.write(result.exposition.decode())
    if check:
        intervals = firing_intervals(result.transitions, result.started_at)
        summaries = firing_summaries(result.transitions)
        instances = firing_instances(result.transitions, result.started_at)
        verdicts = check_expectations(
            scenario,
            intervals,
            result.simulated_seconds,
            summaries,
            instances,
            "unprivileged" if privileges == "unprivileged" else "ptrace",
        )
        click.echo("\n" + format_verdicts(scenario.name, verdicts))
        if not all(v.ok for v in verdicts):
            sys.exit(1)


@main.group()
def rules() -> None:
    """Starvation rule files."""


@rules.command("check")
@click.argument("rule_file", type=click.Path(path_type=Path, dir_okay=False))
def rules_check(rule_file: Path) -> None:
    """Validate RULE_FILE: exit 0 if valid, else 1 with one line per problem."""
    from gpuwatchd.rules import load_rules

    try:
        ruleset = load_rules(rule_file)
    except RulesError as e:
        for problem in e.problems:
            click.echo(problem)
        sys.exit(1)
    click.echo(f"{rule_file}: {len(ruleset.rules)} rules, valid")


@rules.command("detection")
def rules_detection() -> None:
    """Print the detection table (Markdown) from the scenario corpus, as docs/detection.md;
    how far the corpus has played goes to stderr (it takes minutes)."""
    from gpuwatchd.sim.detection import detection_table, play_ahead, replay
    from gpuwatchd.sim.scenario import builtin_scenarios

    logging.disable(logging.WARNING)
    names = builtin_scenarios()
    _progress(f"rules detection: playing {len(names)} scenarios, one process per CPU")
    play_ahead(names)
    for done, name in enumerate(names, 1):
        replay(name)  # each result taken in turn, to say how far the corpus is
        line = f"rules detection: {done}/{len(names)} scenarios played ({name})"
        _progress(line, last=done == len(names))
    click.echo(detection_table(), nl=False)


def _progress(line: str, last: bool = False) -> None:
    """A line on stderr; on a terminal, one line rewritten in place."""
    if sys.stderr.isatty():
        click.echo(f"\r\033[K{line}", err=True, nl=last)
    else:
        click.echo(line, err=True)


@main.command("metrics")
def list_metrics() -> None:
    """Print the metric reference (Markdown), as in docs/metrics.md."""
    from gpuwatchd.reference import metric_reference

    click.echo(metric_reference(), nl=False)


@main.command("scenarios")
def list_scenarios() -> None:
    """List the built-in scenarios."""
    from gpuwatchd.sim.scenario import builtin_scenarios, load_scenario

    for name in builtin_scenarios():
        click.echo(f"{name}: {' '.join(load_scenario(name).description.split())}")


@main.group()
def dcgm() -> None:
    """Talk to a running daemon's DCGM source."""


@dcgm.command("pause")
@click.argument("seconds", type=click.FloatRange(min=0))
@click.option(
    "--url", default="http://127.0.0.1:9766", show_default=True, help="the running daemon"
)
@click.option("--user", help="a basic_auth_users name of the daemon's web config")
@click.option(
    "--password-file",
    type=click.File(),
    help="a file whose first line is the user's password (else it is asked for)",
)
@click.option(
    "--ca-file",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="CA certificate to verify an https daemon with (default: the system's)",
)
def dcgm_pause(
    seconds: float, url: str, user: str | None, password_file: Any, ca_file: Path | None
) -> None:
    """Pause DCGM profiling for SECONDS so a profiler (Nsight) can take the counters.

    Profiling resumes by itself when the time is up (at most
    sources.dcgm.max_profiling_pause); 0 resumes it now. The pause applies to the whole
    host engine, other DCGM clients (dcgm-exporter) included. The daemon refuses it
    unless its web config has basic_auth_users (docs/security.md).
    """
    import urllib.error  # a client's: `run` never loads urllib.request (issue 46: memory)
    import urllib.request

    address = f"{url.rstrip('/')}/api/dcgm/pause?seconds={seconds:g}"
    request = urllib.request.Request(address, data=b"", method="POST")
    if user is not None:
        password = (
            password_file.readline().rstrip("\n")
            if password_file
            else click.prompt(f"password for {user}", hide_input=True)
        )
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            result = json.load(response)
    except urllib.error.HTTPError as e:
        raise click.ClickException(f"{url}: {e.code}: {e.read().decode().strip()}") from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise click.ClickException(f"cannot reach gpuwatchd at {url}: {reason}") from e
    if result["paused"]:
        when = "now" if result["applied"] else "at the next DCGM poll"
        click.echo(f"DCGM profiling paused for {result['seconds']:g}s ({when})")
    else:
        click.echo("DCGM profiling resumed")


@main.command()
@config_option
@click.option(
    "--simulate",
    "scenario_name",
    metavar="SCENARIO",
    help=f"diagnose a simulated node in virtual time: {SCENARIO_HELP}",
)
@click.option(
    "--at",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="with --simulate: diagnose at this many simulated seconds (default: when the "
    "scenario's expected causes hold: the latest `by` of the expectations that must fire, "
    "before their `ends`; the scenario's end when none must fire)",
)
@click.option(
    "--window",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    default=6.0,
    show_default=True,
    help="seconds to sample this node (each source is polled three times)",
)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def doctor(
    config_file: Path | None,
    scenario_name: str | None,
    at: float | None,
    window: float,
    as_json: bool,
) -> None:
    """One-shot diagnosis of this node: the six dimensions, host checks, remedies.

    Every rule is evaluated once on every GPU at the end of the window, without waiting
    out its `for`; host checks (saturated core, iowait, saturated disk, CPU steal, IRQ
    storm, memory pressure) judge the host alone, with or without a GPU. Findings shared
    by several GPUs print once with their list. Details: docs/doctor.md.

    \b
    Exit status:
      0  every check ran and no cause holds
      1  a cause holds on some GPU, or a host check found a problem
      2  the diagnosis could not run (bad configuration, rules or scenario)
      3  no cause holds, but GPU checks could not run (no GPU or driver, or a
         dimension none of whose rules could be evaluated)
    """
    from gpuwatchd.doctor import diagnose_node, diagnose_simulated, format_report
    from gpuwatchd.sim.scenario import load_scenario

    _setup_logging("error")
    if at is not None and not scenario_name:
        raise _CannotRun("--at: only with --simulate (a real node is diagnosed now)")
    try:
        config = load_config(config_file)
        if scenario_name:
            scenario = load_scenario(scenario_name)
            if at is not None and at > scenario.duration:
                raise _CannotRun(
                    f"--at {at:g}: after the end of scenario {scenario.name!r} "
                    f"({scenario.duration:g} s)"
                )
            report = diagnose_simulated(scenario, config, at)
        else:
            report = diagnose_node(config, window)
    except (ConfigError, RulesError) as e:
        raise _CannotRun(str(e)) from e
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(format_report(report))
    sys.exit(report.exit_code)


@main.command()
@click.argument("job")
@click.option(
    "--prometheus",
    "prometheus_url",
    envvar="GPUWATCHD_PROMETHEUS_URL",
    default="http://localhost:9090",
    show_default=True,
    help="Prometheus (or Thanos, Mimir) query API base URL; env GPUWATCHD_PROMETHEUS_URL",
)
@click.option(
    "--since",
    default="7d",
    show_default=True,
    help="start of the window to look for the job in: Unix time, ISO 8601, or a duration "
    "back from --until (6h, 7d)",
)
@click.option("--until", help="end of the window (default: now); the same forms")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.001),
    default=60,
    show_default=True,
    help="seconds for all of the report's queries together",
)
@click.option("--step", type=float, hidden=True, help="ignored (the report has no grid now)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--markdown", is_flag=True, help="print the report as Markdown")
def report(
    job: str,
    prometheus_url: str,
    since: str,
    until: str | None,
    timeout: float,
    step: float | None,
    as_json: bool,
    markdown: bool,
) -> None:
    """GPU-hours JOB lost per starvation cause, with the fix, from Prometheus.

    JOB is a Slurm job id or torchrun run id (the owner series' job_id), else a
    Kubernetes pod (POD or NAMESPACE/POD). Exit 0 with the report, 1 if JOB is empty
    ('' or '/': an unset variable), Prometheus cannot answer in --timeout, or it owns
    nothing of the job in the window. Details: docs/report.md.
    """
    import time

    from gpuwatchd.report import ReportError, build_report, check_job, parse_time
    from gpuwatchd.report_format import as_json as to_json
    from gpuwatchd.report_format import as_text
    from gpuwatchd.report_prometheus import Prometheus, PrometheusError

    if as_json and markdown:
        raise click.UsageError("--json and --markdown exclude each other")
    if step is not None:
        click.echo("gpuwatchd report: --step is ignored: the report accounts every scrape "
                   "interval from the daemons' counters", err=True)
    try:
        end = parse_time(until, time.time())
        start = parse_time(since, end - 7 * 86400, now=end)
        check_job(job)
        built = build_report(Prometheus(prometheus_url, timeout), job, start, end)
    except (ReportError, PrometheusError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(to_json(built) if as_json else as_text(built, markdown=markdown), nl=as_json)
