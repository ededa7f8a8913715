"""The series a scenario's metric expectations may name: those `simulate --check` samples
(docs/scenarios.md#expectations), and what is wrong with an expectation that names
another, or picks its series by a label the family does not have.

Three kinds are sampled: a source's series (what the sources stored), the rules engine's
own (`gpuwatchd_starvation_active`, `gpuwatchd_gpu_starved`, ...: what the status page
and the alerts read), and a source's health (`gpuwatchd_source_up`,
`gpuwatchd_source_errors_total`, one source's, named by its `source` label).
"""

from __future__ import annotations

from functools import cache

HEALTH = ("gpuwatchd_source_up", "gpuwatchd_source_errors_total")
INSTANCE_LABEL = "gpu_instance"  # the GI id of a MIG GPU instance's series


@cache
def families() -> dict[str, tuple[str, ...]]:
    """Every series the check samples -> its label names."""
    from gpuwatchd.sources import load_builtin_sources

    out = {
        spec.name: spec.labels
        for source in load_builtin_sources().values()
        for spec in source.metrics
    }
    out.update((name, ("source",)) for name in HEALTH)
    out.update((name, labels) for name, labels in engine_families().items())
    return out


@cache
def engine_families() -> dict[str, tuple[str, ...]]:
    """The rules engine's own series -> their label names."""
    from gpuwatchd.rules.engine import RULE_METRICS

    return {spec.name: spec.labels for spec in RULE_METRICS}


def problem(metric: str, labels: dict[str, str], instances: bool) -> str | None:
    """What keeps a metric expectation from being judged (`instances`: its `gpus` name MIG
    GPU instances, "0/2"), as `field: what was expected`; None when nothing does."""
    known = families()
    if metric not in known:
        return (
            f"metric: {metric!r} is no series the check samples: expected a source's series, "
            "the rules engine's (gpuwatchd_starvation_active, gpuwatchd_gpu_starved, ...) or "
            f"{' / '.join(HEALTH)} (docs/metrics.md lists them)"
        )
    names = known[metric]
    unknown = sorted(set(labels) - set(names))
    if unknown:
        return (
            f"labels: {metric} has no label {', '.join(unknown)}: expected some of "
            f"{', '.join(names) or '(none: it has no labels)'}"
        )
    if instances and INSTANCE_LABEL not in names:
        return (
            f'gpus: {metric} has no {INSTANCE_LABEL} label, so a MIG GPU instance ("0/2") '
            "picks none of its series: expected GPU indexes"
        )
    if metric in HEALTH:
        return _health_problem(metric, labels.get("source"))
    return None


def _health_problem(metric: str, source: str | None) -> str | None:
    from gpuwatchd.sources import BUILTIN

    if source in BUILTIN:
        return None
    got = f", got {source!r}" if source is not None else ""
    return f"labels: {metric} needs source, one of {', '.join(BUILTIN)}{got}"
