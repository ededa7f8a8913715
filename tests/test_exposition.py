"""The fast renderer must produce exactly what prometheus_client's generators produce."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from gpuwatchd.exposition import OPENMETRICS_EOF, Renderer
from gpuwatchd.metrics import MetricSpec

label_names = st.sampled_from(["gpu", "uuid", "reason", "a_b", "zz"])
label_values = st.text(max_size=12)  # any unicode, quotes, backslashes, newlines
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
