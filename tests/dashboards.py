"""The Grafana dashboards under grafana/ as the tests see them: the generator, the panels,
and every panel's queries with Grafana's variables substituted, ready for Prometheus.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"
DASHBOARDS = (GRAFANA / "fleet.json", GRAFANA / "node.json")
REGENERATE = "python -m grafana.dashboards"

# Grafana's built-in variables, as Grafana would set them for a 1-hour view of a
# Prometheus scraped every 15 s; a caller's `variables` override them.
BUILTIN = {
    "__interval": "15s",
    "__interval_ms": "15000",
    "__rate_interval": "1m",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}

# $var, ${var}, ${var:format}, [[var]], [[var:format]]
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")


@cache
def generator() -> ModuleType:
    """grafana/dashboards.py, imported by path (grafana/ is not an installed package)."""
    spec = importlib.util.spec_from_file_location(
        "gpuwatchd_grafana_dashboards", GRAFANA / "dashboards.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard, those inside (collapsed) rows too; rows themselves not."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panels(panel)
        else:
            yield panel


def substitute(text: str, variables: Mapping[str, str]) -> str:
    """`text` with Grafana's variables replaced by `variables` (then the built-ins).

    Every form ($var, ${var}, ${var:regex}, [[var]]) becomes the value as given: in the
    dashboards' `=~` matchers a value is a regex, e.g. ".*" for All. `$1` and other
    all-digit names are left alone (label_replace's references, as Grafana leaves them).
    An unknown variable is a KeyError naming it.
    """
    values = {**BUILTIN, **variables}

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g is not None)
        if name.isdigit():
            return match.group(0)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {text!r}")
        return values[name]

    return _VARIABLE.sub(value, text)


def panel_queries(path: str | Path, variables: Mapping[str, str]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel of the dashboard file `path`
    (nested rows too), with Grafana's variables substituted from `variables` and the
    built-ins ($__interval, $__rate_interval, $__range, ...; overridable the same way).

    For the fleet dashboard pass cluster, job and node; for the node dashboard job, node
    and gpu. Use ".*" for All, e.g.
    `panel_queries(DASHBOARDS[1], {"job": "gpuwatchd", "node": "host:9766", "gpu": ".*"})`.
    """
    dashboard = json.loads(Path(path).read_text(encoding="utf-8"))
    return [
        (panel.get("title", ""), substitute(target["expr"], variables))
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
