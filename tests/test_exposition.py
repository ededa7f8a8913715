"""The fast renderer must produce exactly what prometheus_client's generators produce,
but for control characters in label values, which it writes as visible text (issue 41)."""

from __future__ import annotations

import math
import shutil
import subprocess
from importlib import resources

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuwatchd.config import Config
from gpuwatchd.exposition import OPENMETRICS_EOF, Renderer, visible
from gpuwatchd.metrics import MetricSpec
from gpuwatchd.sim.scenario.schema import Scenario
from gpuwatchd.simulate import Simulation

label_names = st.sampled_from(["gpu", "uuid", "reason", "a_b", "zz"])
# any unicode, quotes, backslashes, newlines; no other control character (written apart)
label_values = st.text(
    st.characters(exclude_categories=("Cs", "Cc"), include_characters="\n"), max_size=12
)
values = st.one_of(
    st.floats(allow_nan=False),
    st.integers(-(2**60), 2**60).map(float),
    st.sampled_from([math.inf, -math.inf, 0.0, 1e22, 1.5e-7]),
)


@st.composite
def families(draw):
    count = draw(st.integers(0, 4))
    out = []
    for i in range(count):
        labels = tuple(draw(st.lists(label_names, unique=True, max_size=3)))
        kind = draw(st.sampled_from(["gauge", "counter"]))
        name = f"gpuwatchd_m{i}" + ("_total" if kind == "counter" else "")
        help_text = draw(st.text(max_size=20))
        rows = draw(
            st.lists(
                st.tuples(st.tuples(*[label_values] * len(labels)), values),
                min_size=1,
                max_size=4,
                unique_by=lambda row: row[0],
            )
        )
        out.append((MetricSpec(name, help_text, labels, kind), rows))
    return out


def reference(fams) -> tuple[bytes, bytes]:
    class Collector:
        def collect(self):
            for spec, rows in fams:
                cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
                family = cls(spec.name, spec.help, labels=list(spec.labels))
                for labels, value in rows:
                    family.add_metric(list(labels), value)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry), generate_openmetrics(registry)


@settings(max_examples=300, deadline=None)
@given(families())
def test_byte_identical_to_prometheus_client(fams):
    text, openmetrics = Renderer().render(fams)
    assert (text, openmetrics + OPENMETRICS_EOF) == reference(fams)


def controls(text: str) -> list[str]:
    """The control characters in `text` but its newlines."""
    return [c for c in text if c != "\n" and (c < " " or "\x7f" <= c <= "\x9f")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12), min_size=1, max_size=4, unique=True))
def test_control_characters_in_label_values_are_written_as_visible_text(names):
    """A raw ESC, CR or C1 byte in a label value (a process name is its owner's to choose)
    used to reach the exposition as it was; now each is the text \\xNN, and both parsers
    read back exactly that text."""
    spec = MetricSpec("gpuwatchd_x", "x", ("name",))
    rows = [((name,), 1.0) for name in names]
    text, openmetrics = Renderer().render([(spec, rows)])
    shown = [((visible(name),), 1.0) for name in names]
    assert (text, openmetrics + OPENMETRICS_EOF) == reference([(spec, shown)])
    for body in (text.decode(), (openmetrics + OPENMETRICS_EOF).decode()):
        assert not controls(body)
    parsed = [s.labels["name"] for f in parse_text(text.decode()) for s in f.samples]
    assert parsed == [visible(name) for name in names]
    om = parse_om((openmetrics + OPENMETRICS_EOF).decode())
    assert [s.labels["name"] for f in om for s in f.samples] == parsed


def test_a_process_name_with_escapes_reaches_the_exposition_visible_and_valid():
    """A tenant's process renamed to ESC [2J (clear screen), CR and CSI (C1): the
    simulated node's /proc hands the processes source those bytes; the exposition shows
    them as text, and promtool accepts it."""
    text = (resources.files("gpuwatchd.sim.scenarios") / "healthy-8gpu.yaml").read_text()
    text = text.replace("name: python,", 'name: "py\\e[2J\\rthon\\x9b",', 1)
    # the name is gpu_process_info's, shown with detail_metrics (issue 46)
    scenario = Scenario.model_validate(yaml.safe_load(text))
    simulation = Simulation(scenario, Config(detail_metrics=True))
    try:
        body = simulation.run(until=5).exposition
    finally:
        simulation.close()
    assert b'name="py\\\\x1b[2J\\\\x0dthon\\\\x9b"' in body
    assert not controls(body.decode())
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian's prometheus package)")
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    assert check.returncode == 0, check.stderr.decode()


def test_cached_labels_follow_the_series():
    renderer = Renderer()
    spec = MetricSpec("gpuwatchd_x", "x", ("gpu",))
    text, _ = renderer.render([(spec, [(("0",), 1.0), (("1",), 2.0)])])
    assert b'gpuwatchd_x{gpu="1"} 2.0' in text
    text, _ = renderer.render([(spec, [(("0",), 3.0)])])
    assert b'gpu="1"' not in text and b'gpuwatchd_x{gpu="0"} 3.0' in text
    assert len(renderer._families["gpuwatchd_x"][1]) == 1  # the gone series' line dropped
    text, _ = renderer.render([(spec, [(("0",), 3.0), (("2",), -0.0)])])
    assert b'gpuwatchd_x{gpu="0"} 3.0' in text  # kept: the same value
    text, _ = renderer.render([(spec, [(("0",), 3.0), (("2",), 0.0)])])
    assert b'gpuwatchd_x{gpu="2"} 0.0' in text  # 0.0 is not written as -0.0
