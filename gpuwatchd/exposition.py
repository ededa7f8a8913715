"""Prometheus text (0.0.4) and OpenMetrics (1.0) rendering, for both at once, fast.

prometheus_client's own generators re-validate and re-escape every label of every
sample on every render (about 11 ms for both formats at 8 GPUs, measured in
bench/bench_cycle.py), which alone would exceed the daemon's per-cycle CPU budget.
This renderer produces byte-identical output (tests/test_exposition.py checks it
against prometheus_client's generators), but for control characters in label values,
which it writes as visible text (`visible`), while escaping each series' labels once: the
sample lines are shared by both formats, which differ only in their HELP/TYPE headers
and OpenMetrics' closing `# EOF` (which the caller adds after the last part, so
parts rendered at different times can be joined).
"""

from __future__ import annotations

import gzip
import math
import re
from collections.abc import Iterable

from gpuwatchd.metrics import MetricSpec

# prometheus_client's, written out: importing it brings http.server, wsgiref and
# urllib.request into the daemon, ~30 modules of memory for three lines (issue 46)
OPENMETRICS_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_INF, _MINUS_INF = float("inf"), float("-inf")


def gzip_accepted(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (prometheus_client's test)."""
    return any(
        part.split(";")[0].strip().lower() == "gzip" for part in (accept_encoding or "").split(",")
    )


def floatToGoString(d: float) -> str:  # noqa: N802 (prometheus_client.utils' name)
    """A sample value as Go's strconv writes it, as prometheus_client.utils does."""
    d = float(d)
    if d == _INF:
        return "+Inf"
    if d == _MINUS_INF:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s

Rows = list[tuple[tuple[str, ...], float]]
_Line = tuple[float, str, str]  # a series' value, its name and labels, its sample line
_LabelKey = tuple[tuple[str, ...], tuple[str, ...]]


def escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


# Control characters other than the newline the format escapes (C0, DEL, C1): a process
# name is its owner's to choose (prctl, exec -a), and a raw ESC or CR reaches whoever
# reads the exposition in a terminal (issue 41). The format has no escape for them
# (promtool refuses `\r`), so each becomes the visible text \xNN.
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def visible(value: str) -> str:
    """`value` with every control character but the newline written as the text \\xNN."""
    if _CONTROL.search(value) is None:
        return value
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)


def _headers(spec: MetricSpec) -> tuple[str, str]:
    """(text, OpenMetrics) HELP and TYPE lines: OpenMetrics names counters without _total."""
    text_help = spec.help.replace("\\", r"\\").replace("\n", r"\n")
    text = f"# HELP {spec.name} {text_help}\n# TYPE {spec.name} {spec.type}\n"
    family = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    om_help = escape_label_value(spec.help)
    openmetrics = f"# HELP {family} {om_help}\n# TYPE {family} {spec.type}\n"
    return text, openmetrics


class Renderer:
    """Renders families, each again only as far as it changed: a family passed without
    rows (None), or with the same rows as at the last render, is not rendered again; in
    one that changed, only the lines of series whose value changed are made again (label
    strings are escaped once per live series)."""

    def __init__(self) -> None:
        # family -> (its rows, its lines by label values: (value, name and labels, line),
        # its body)
        self._families: dict[str, tuple[Rows, dict[tuple[str, ...], _Line], str]] = {}
        self._headers: dict[MetricSpec, tuple[str, str]] = {}

    def _label_string(self, names: tuple[str, ...], values: tuple[str, ...]) -> str:
        if not names:
            return ""
        pairs = sorted(zip(names, values, strict=True))
        return "{" + ",".join(f'{n}="{escape_label_value(visible(v))}"' for n, v in pairs) + "}"

    def render(self, families: Iterable[tuple[MetricSpec, Rows | None]]) -> tuple[bytes, bytes]:
        old = self._families
        kept: dict[str, tuple[Rows, dict[tuple[str, ...], _Line], str]] = {}
        text: list[str] = []
        openmetrics: list[str] = []
        for spec, rows in families:
            headers = self._headers.get(spec)
            if headers is None:
                headers = self._headers[spec] = _headers(spec)
            name = spec.name
            before = old.get(name)
            if before is not None and (
                rows is None or before[0] == rows and _zeros_alike(before[0], rows)
            ):
                family = before  # the same rows: the same lines
            else:
                assert rows is not None, f"{name}: no rows and none rendered before"
                lines = before[1] if before is not None else {}
                fresh: dict[tuple[str, ...], _Line] = {}
                for values, value in rows:
                    line = lines.get(values)
                    if line is None:
                        series = name + self._label_string(spec.labels, values)
                        line = (value, series, f"{series} {floatToGoString(value)}\n")
                    elif not _same(line[0], value):
                        line = (value, line[1], f"{line[1]} {floatToGoString(value)}\n")
                    fresh[values] = line
                family = (rows, fresh, "".join(line[2] for line in fresh.values()))
            kept[name] = family
            text.append(headers[0] + family[2])
            openmetrics.append(headers[1] + family[2])
        self._families = kept  # families and series gone since drop out here
        return "".join(text).encode(), "".join(openmetrics).encode()


def _zeros_alike(before: Rows, rows: Rows) -> bool:
    """Rows found equal are also written alike: no 0.0 became -0.0, or back."""
    sign = math.copysign
    return all(
        sign(1.0, was) == sign(1.0, value)
        for (_, was), (_, value) in zip(before, rows, strict=True)
        if value == 0.0
    )


def _same(a: float, b: float) -> bool:
    """Equal and written alike (0.0 and -0.0 are not; NaN never is)."""
    return a == b and (a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b))


OPENMETRICS_EOF = b"# EOF\n"


def gzip_body(body: bytes) -> bytes:
    """An exposition as a gzip member (zlib's default level; no timestamp,
    so one body always compresses to the same bytes)."""
    return gzip.compress(body, compresslevel=6, mtime=0)
