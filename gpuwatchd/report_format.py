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
    if report.accounting == "rules":
        return ("totals from deploy/prometheus/jobs.yaml's accounting rules (the Grafana job "
                "dashboard's numbers); per GPU and node from samples every "
                f"{report.step:g} s")
    return (f"from samples every {report.step:g} s (Prometheus has no accounting rules for "
            "this job: load deploy/prometheus/jobs.yaml)")


def _onset(cause: CauseLoss) -> str:
    o = cause.onset
    return f"{_time(o.at)} on {o.node} GPU {o.gpu}" if o else "-"


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
        ("Run time", f"{_duration(report.end - report.start)} "
                     f"({_time(report.start)} to {_time(report.end)})"),
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
             f"{c.gpus}/{report.gpus}", _onset(c)] for c in report.causes]
    header = ["cause", "dimension", "share", "GPU-h", "GPUs", "first onset"]
    out += _table(header, rows, markdown) if rows else ["  none"]

    if report.causes:
        out.append(h2("What the daemon saw first, and the fix"))
        for c in report.causes:
            if c.onset is None:
                continue
            if markdown:
                out += [f"- **{c.cause}** ({_onset(c)}): {c.onset.summary}",
                        f"  - *Fix:* {c.onset.remedy}"]
            else:
                out += [f"  {c.cause} ({_onset(c)}):", f"    saw: {c.onset.summary}",
                        f"    fix: {c.onset.remedy}"]

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
