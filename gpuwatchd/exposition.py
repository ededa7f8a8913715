"""Prometheus text (0.0.4) and OpenMetrics (1.0) rendering, for both at once, fast.

prometheus_client's own generators re-validate and re-escape every label of every
sample on every render (about 11 ms for both formats at 8 GPUs, measured in
bench/bench_cycle.py), which alone would exceed the daemon's per-cycle CPU budget.
This renderer produces byte-identical output (tests/test_exposition.py checks it
against prometheus_client's generators) while escaping each series' labels once: the
sample lines are shared by both formats, which differ only in their HELP/TYPE headers
and OpenMetrics' closing `# EOF` (which the caller adds after the last part, so
parts rendered at different times can be joined).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.utils import floatToGoString

from gpuwatchd.metrics import MetricSpec

Rows = list[tuple[tuple[str, ...], float]]
_LabelKey = tuple[tuple[str, ...], tuple[str, ...]]


def escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _headers(spec: MetricSpec) -> tuple[str, str]:
    """(text, OpenMetrics) HELP and TYPE lines: OpenMetrics names counters without _total."""
    text_help = spec.help.replace("\\", r"\\").replace("\n", r"\n")
    text = f"# HELP {spec.name} {text_help}\n# TYPE {spec.name} {spec.type}\n"
    family = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    om_help = escape_label_value(spec.help)
    openmetrics = f"# HELP {family} {om_help}\n# TYPE {family} {spec.type}\n"
    return text, openmetrics


class Renderer:
    """Renders families; label strings are cached per live series between renders."""

    def __init__(self) -> None:
        self._labels: dict[_LabelKey, str] = {}
        self._headers: dict[MetricSpec, tuple[str, str]] = {}

    def _label_string(self, names: tuple[str, ...], values: tuple[str, ...]) -> str:
        if not names:
            return ""
        pairs = sorted(zip(names, values, strict=True))
        return "{" + ",".join(f'{n}="{escape_label_value(v)}"' for n, v in pairs) + "}"

    def render(self, families: Iterable[tuple[MetricSpec, Rows]]) -> tuple[bytes, bytes]:
        old = self._labels
        labels: dict[_LabelKey, str] = {}
        text: list[str] = []
        openmetrics: list[str] = []
        for spec, rows in families:
            headers = self._headers.get(spec)
            if headers is None:
                headers = self._headers[spec] = _headers(spec)
            lines = []
            for values, value in rows:
                key = (spec.labels, values)
                label_string = labels.get(key) or old.get(key)
                if label_string is None:
                    label_string = self._label_string(spec.labels, values)
                labels[key] = label_string
                lines.append(f"{spec.name}{label_string} {floatToGoString(value)}\n")
            body = "".join(lines)
            text.append(headers[0] + body)
            openmetrics.append(headers[1] + body)
        self._labels = labels  # series gone since the last render drop out here
        return "".join(text).encode(), "".join(openmetrics).encode()


OPENMETRICS_EOF = b"# EOF\n"
