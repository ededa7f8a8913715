"""`gpuwatchd report` as text (seff-like, for a job's output directory) or Markdown."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from gpuwatchd.report import CauseLoss, JobReport, percent


def as_json(report: JobReport) -> str:
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False)


def _time(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _hours(h: float) -> str:
    return f"{h:.3f}" if h < 10 else f"{h:.1f}"


def _owner(report: JobReport) -> str:
    who = [report.scheduler or "?"]
    if report.user:
        who.append(f"user {report.user}")
    if report.namespace:
        who.append(f"namespace {report.namespace}")
    return ", ".join(who)


def _gpus(report: JobReport) -> str:
    """The job's GPUs, "4"; with MIG GPU instances among them (each one GPU of the job,
    whatever its profile) "3 (2 of them MIG GPU instances)"."""
    n = report.gpu_instances
    if not n:
        return str(report.gpus)
    what = "MIG GPU instance" + ("s" if n > 1 else "")
    return f"{report.gpus} ({what})" if n == report.gpus else f"{report.gpus} ({n} of them {what})"


def _accounting(report: JobReport) -> str:
    line = ("every figure from the daemons' gpuwatchd_starvation_seconds_total, per scrape "
            f"interval ({report.scrape_interval:g} s) owned by the job")
    if report.overlap_gpu_hours > 0:
        line += (f"; causes overlapped on a GPU within a scrape interval: starved time may "
                 f"be up to {_hours(report.overlap_gpu_hours)} GPU-h more")
    return line


def _run_time(report: JobReport) -> str:
    """The job's run time, or what of it the window holds, saying where it cuts it."""
    span = f"{_time(report.start)} to {_time(report.end)}"
    cut = [what for what, yes in (("it held its GPUs before --since", report.cut_start),
                                  ("still at --until", report.cut_end)) if yes]
    if not cut:
        return f"{_duration(report.end - report.start)} ({span})"
    return (f"at least {_duration(report.end - report.start)}: the window cuts the job "
            f"({' and '.join(cut)}); {span} in the window")


def _onset(cause: CauseLoss) -> str:
    o = cause.onset
    if o is None:
        return "-"
    return f"{'before ' if o.before else ''}{_time(o.at)} on {o.node} GPU {o.gpu}"


def _began(cause: CauseLoss) -> str:
    """When the fault began, by the rule's evidence: its expression held from
    `holds_since`, on evidence reaching `window` seconds further back."""
    o = cause.onset
    if o is None:
        return "-"
    if o.before:  # firing when the job's time in the window began: its start is not in it
        return f"before {_time(o.at)}"
    if not o.window:
        return _time(o.holds_since)
    early = datetime.fromtimestamp(o.holds_since - o.window, timezone.utc)
    late = datetime.fromtimestamp(o.holds_since, timezone.utc)
    return f"{early:%Y-%m-%d %H:%M:%S} to {late:%H:%M:%S} UTC"


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return lines + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    return [line(header)] + [line(r) for r in rows]


def as_text(report: JobReport, markdown: bool = False) -> str:
    """The report for people: the summary block first (what `seff` prints), then where
    the time went, the causes' first evidence and remedies, the worst GPUs and nodes and
    the scrape gaps."""
    h2 = (lambda s: f"\n## {s}\n") if markdown else (lambda s: f"\n{s}:")
    out = [
        f"# Job {report.job}" if markdown else f"Job: {report.job} ({_owner(report)})",
    ]
    if markdown:
        out.append(f"\n{_owner(report)}\n")
    summary = [
        ("Verdict", report.verdict),
        ("Nodes", f"{len(report.nodes)} ({', '.join(report.nodes)})"),
        ("GPUs", _gpus(report)),
        ("Run time", _run_time(report)),
        ("GPU-hours", _hours(report.gpu_hours)),
        ("GPU time starved", f"{percent(report.starved_share)} "
                             f"({_hours(report.starved_gpu_hours)} GPU-h)"),
    ]
    for key, value in summary:
        out.append(f"- **{key}:** {value}" if markdown else f"{key + ':':<18}{value}")

    out.append(h2("GPU time lost per dimension"))
    rows = [[d, percent(h / report.gpu_hours if report.gpu_hours else 0), _hours(h)]
            for d, h in report.dimensions.items()]
    out += _table(["dimension", "share", "GPU-h"], rows, markdown) if rows else ["  none"]

    out.append(h2("GPU time lost per cause"))
    rows = [[c.cause, c.dimension, percent(c.share), _hours(c.gpu_hours),
             f"{c.gpus}/{report.gpus}", _began(c), _onset(c)] for c in report.causes]
    header = ["cause", "dimension", "share", "GPU-h", "GPUs", "fault began", "first onset"]
    out += _table(header, rows, markdown) if rows else ["  none"]

    if report.causes:
        out.append(h2("What the daemon saw first, and the fix"))
        for c in report.causes:
            if c.onset is None:
                continue
            saw = c.onset.summary or "(no scrape saw it firing: no evidence kept)"
            if markdown:
                out += [f"- **{c.cause}** (fired {_onset(c)}; began {_began(c)}): {saw}",
                        f"  - *Fix:* {c.onset.remedy}"]
            else:
                out += [f"  {c.cause} (fired {_onset(c)}; began {_began(c)}):",
                        f"    saw: {saw}", f"    fix: {c.onset.remedy}"]

    for title, usage in (("Worst GPUs", report.worst_gpus), ("Worst nodes", report.worst_nodes)):
        out.append(h2(title))
        rows = [[u.name, percent(u.share), _hours(u.starved_gpu_hours), u.top_cause or "-"]
                for u in usage]
        header = ["", "starved", "GPU-h lost", "top cause"]
        out += _table(header, rows, markdown) if rows else ["  none starved"]

    out.append(h2("Scrape gaps (their time is counted nowhere)"))
    rows = [[g.node, _time(g.start), _time(g.end), g.kind] for g in report.gaps]
    out += _table(["node", "from", "to", "what"], rows, markdown) if rows else ["  none"]
    window = f"{_time(report.since)} to {_time(report.until)}"
    out.append(f"\nAccounting: {_accounting(report)}; window {window}.")
    return "\n".join(out) + "\n"
