"""The exporter and HTTP server, through real HTTP, with a small real Source."""

import contextlib
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuwatchd.config import SourceConfig
from gpuwatchd.exporter import Exporter, MetricsServer, wants_openmetrics
from gpuwatchd.metrics import Sample, counter, gauge
from gpuwatchd.scheduler import Poller
from gpuwatchd.sources.base import Context, Source, SourceError
from gpuwatchd.store import Store


class Scripted(Source):
    """Returns whatever the test put in `next`; raises it if it is an exception."""

    name = "scripted"
    metrics = (
        gauge("gpu_temperature_celsius", "Temperature", ("gpu", "uuid")),
        counter("gpu_xid_errors_total", "Xid errors", ("gpu", "uuid", "xid")),
    )

    def __init__(self) -> None:
        super().__init__(SourceConfig(interval=1, timeout=1), Context())
        self.next: list[Sample] | Exception = []

    def collect(self) -> list[Sample]:
        if isinstance(self.next, Exception):
            raise self.next
        return self.next


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def setup():
    clock, source, store = Clock(), Scripted(), Store()
    poller = Poller(source, store, clock)
    exporter = Exporter(store, [poller], source.metrics, clock)
    return clock, source, poller, exporter


def families(text: bytes) -> dict:
    return {f.name: f for f in parse_text(text.decode())}


def test_renders_samples_self_metrics_and_build_info(setup):
    clock, source, poller, exporter = setup
    source.next = [
        Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 61.0),
        Sample("gpuwatchd_gpu_xid_errors_total", ("0", "GPU-a", "79"), 2.0),
    ]
    poller.poll()
    got = families(exporter.render().text)
    temp = got["gpuwatchd_gpu_temperature_celsius"]
    assert temp.type == "gauge"
    assert [(s.labels, s.value) for s in temp.samples] == [({"gpu": "0", "uuid": "GPU-a"}, 61.0)]
    xid = got["gpuwatchd_gpu_xid_errors"]
    assert xid.type == "counter"
    assert xid.samples[0].name == "gpuwatchd_gpu_xid_errors_total"
    assert got["gpuwatchd_source_up"].samples[0].value == 1.0
    assert "gpuwatchd_source_last_success_timestamp_seconds" not in got  # detail_metrics
    assert got["gpuwatchd_last_success_timestamp_seconds"].samples[0].value == 1000.0
    assert got["gpuwatchd_build_info"].samples[0].labels["version"]


def test_failed_source_is_down_and_counts_errors_and_keeps_others(setup, caplog):
    clock, source, poller, exporter = setup
    source.next = SourceError("driver not loaded")
    for _ in range(3):
        poller.poll()
    got = families(exporter.render().text)
    assert got["gpuwatchd_source_up"].samples[0].value == 0.0
    assert got["gpuwatchd_source_errors"].samples[0].value == 3.0
    assert [r.message for r in caplog.records].count(
        "source scripted: down: SourceError: driver not loaded"
    ) == 1


def test_stale_series_disappear_while_source_stays_listed(setup):
    clock, source, poller, exporter = setup
    source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 61.0)]
    poller.poll()
    clock.t += 10  # well past 3 intervals with no successful poll
    got = families(exporter.render().text)
    assert "gpuwatchd_gpu_temperature_celsius" not in got
    assert "gpuwatchd_source_up" in got


def test_openmetrics_rendering_parses(setup):
    clock, source, poller, exporter = setup
    source.next = [Sample("gpuwatchd_gpu_xid_errors_total", ("0", "GPU-a", "79"), 1.0)]
    poller.poll()
    text = exporter.render().openmetrics.decode()
    assert text.endswith("# EOF\n")
    names = {f.name for f in parse_openmetrics(text)}
    assert {"gpuwatchd_gpu_xid_errors", "gpuwatchd_source_up"} <= names


@pytest.mark.parametrize(
    "accept, expected",
    [
        (None, False),
        ("text/plain;version=0.0.4", False),
        ("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4", True),
    ],
)
def test_content_negotiation(accept, expected):
    assert wants_openmetrics(accept) is expected


def get(url: str, accept: str | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


@contextlib.contextmanager
def serving(setup) -> Iterator[str]:
    """The real web front over the setup's exporter, one poll rendered (61.0): its URL."""
    clock, source, poller, exporter = setup
    source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 61.0)]
    poller.poll()
    exporter.render()
    server = MetricsServer(exporter, "127.0.0.1", 0)
    server.start()
    try:
        yield "http://{}:{}".format(*server.address)
    finally:
        server.stop()


def test_http_endpoints_serve_cached_bytes(setup):
    clock, source, poller, exporter = setup
    with serving(setup) as base:
        status, ctype, body = get(base + "/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert b'gpuwatchd_gpu_temperature_celsius{gpu="0",uuid="GPU-a"} 61.0' in body
        # a scrape renders what the last poll stored (the loop need not have run)
        source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 70.0)]
        poller.poll()
        assert b"} 70.0" in get(base + "/metrics")[2]
        status, ctype, body = get(base + "/metrics", "application/openmetrics-text; version=1.0.0")
        assert ctype.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
        status, _, body = get(base + "/healthz")
        assert status == 200 and b"source scripted: up" in body
        status, ctype, body = get(base + "/")
        assert status == 200 and b"/metrics" in body and ctype.startswith("text/html")
        assert get(base + "/nope")[0] == 404
        clock.t += 3600
        assert get(base + "/healthz")[0] == 503


def test_scrapes_are_gzipped_for_a_scraper_that_accepts_it(setup):
    """Prometheus asks with Accept-Encoding: gzip (a 300 KB 8-GPU body becomes ~25 KB);
    a client that does not gets the plain bytes."""
    import gzip

    with serving(setup) as base:
        request = urllib.request.Request(base + "/metrics", headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert response.headers["Vary"] == "Accept-Encoding"
            body = gzip.decompress(response.read())
        assert body == get(base + "/metrics")[2]
        assert b'gpuwatchd_gpu_temperature_celsius{gpu="0",uuid="GPU-a"} 61.0' in body
        request = urllib.request.Request(base + "/metrics", headers={"Accept-Encoding": "identity"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers["Content-Encoding"] is None


def test_hung_source_reported_down_once_and_recovers(setup, caplog):
    clock, source, poller, exporter = setup
    entered, release = threading.Event(), threading.Event()

    class Hanging(Scripted):
        def collect(self):
            entered.set()
            release.wait(30)
            return [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 50.0)]

    hanging = Hanging()
    poller = Poller(hanging, exporter.store, clock)
    exporter.pollers[:] = [poller]
    thread = threading.Thread(target=poller.poll)
    thread.start()
    assert entered.wait(5)
    clock.t += 0.5
    poller.check_hung(clock())
    assert poller.health.errors_total == 0  # within its timeout
    clock.t += 1.0
    poller.check_hung(clock())
    poller.check_hung(clock())
    assert not poller.health.up and poller.health.errors_total == 1
    assert families(exporter.render().text)["gpuwatchd_source_up"].samples[0].value == 0.0
    release.set()
    thread.join(5)
    assert poller.health.up


def test_a_source_part_is_rendered_again_only_when_a_poll_changed_it(setup, monkeypatch):
    clock, source, poller, exporter = setup
    source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 61.0)]
    poller.poll()
    renderer = exporter._renderers["scripted"]
    calls = []
    real = renderer.render
    monkeypatch.setattr(renderer, "render", lambda fams: calls.append(1) or real(fams))
    exporter.render()
    clock.t += 1
    assert len(calls) == 1 and b"} 61.0" in exporter.render().text  # reused
    assert len(calls) == 1
    poller.poll()  # the same value: nothing to render
    exporter.render()
    assert len(calls) == 1
    source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 62.0)]
    poller.poll()
    assert b"} 62.0" in exporter.render().text
    assert len(calls) == 2
    clock.t += 10  # stale: rendered once more, without its series
    assert b"gpuwatchd_gpu_temperature_celsius" not in exporter.render().text
    assert len(calls) == 3


def test_own_and_derived_parts_are_rendered_again_only_when_their_version_changes(setup):
    clock, source, poller, exporter = setup
    version, asked = [0], []

    def rows():
        asked.append(version[0])
        return {"gpuwatchd_gpu_starved": [(("0", "GPU-a"), float(version[0]))]}

    exporter.specs.append(gauge("gpu_starved", "starved", ("gpu", "uuid")))
    exporter.derived.append((lambda: version[0], rows))
    source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 61.0)]
    poller.poll()
    first = exporter.render()
    assert asked == [0] and b'gpuwatchd_gpu_starved{gpu="0",uuid="GPU-a"} 0.0' in first.text
    clock.t += 1
    again = exporter.render()  # nothing changed: the same bytes, a new time
    assert asked == [0] and again.text is first.text and again.rendered_at == clock.t
    version[0] = 1
    assert b"} 1.0" in exporter.render().text and asked == [0, 1]
    poller.poll()  # the source and the daemon's own part (its health) change; not the rules'
    assert exporter.render().text is not first.text and asked == [0, 1]
    version[0] = 2  # a scrape serves the rules' families as the evaluation loop left them
    assert b"} 1.0" in exporter.latest().text and asked == [0, 1]
    exporter.refresh()
    assert b"} 2.0" in exporter.latest().text and asked == [0, 1, 2]


def test_a_scrape_after_many_polls_shows_the_last_values(setup):
    """Between two scrapes a source polls more often than the store's change log spans:
    the scrape catches up with all of it (its changes, or the whole source again)."""
    clock, source, poller, exporter = setup
    for polls in (3, 40):  # within the change log, then past it
        for i in range(polls):
            source.next = [
                Sample("gpuwatchd_gpu_temperature_celsius", (str(gpu), f"GPU-{gpu}"), i + gpu)
                for gpu in range(i % 3 + 1)  # series come and go too
            ]
            poller.poll()
            clock.t += 1
        text = exporter.latest().text
        want = {str(gpu): float(polls - 1 + gpu) for gpu in range((polls - 1) % 3 + 1)}
        got = {
            s.labels["gpu"]: s.value
            for s in families(text)["gpuwatchd_gpu_temperature_celsius"].samples
        }
        assert got == want


def test_a_render_that_fails_serves_the_last_exposition_and_fails_healthz(setup, monkeypatch):
    clock, source, poller, exporter = setup
    with serving(setup) as base:
        good = get(base + "/metrics")[2]
        broken = RuntimeError("a bug")
        monkeypatch.setattr(exporter, "_source_part", lambda *a: (_ for _ in ()).throw(broken))
        source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), 62.0)]
        poller.poll()
        assert get(base + "/metrics")[:3:2] == (200, good)  # the last good bytes
        status, _, body = get(base + "/healthz")
        assert status == 503 and b"failed to render: RuntimeError: a bug" in body
        monkeypatch.undo()
        assert b"} 62.0" in get(base + "/metrics")[2]
        assert get(base + "/healthz")[0] == 200


def test_the_loop_renders_ahead_of_the_next_scrape_once(setup, monkeypatch):
    """Scrapes every 15 s: the evaluation loop renders the sources' families once, in the
    last cycle before the next scrape is due, and that scrape serves it as it is (as
    fresh as a render every cycle was); a scrape that comes early renders for itself."""
    clock, source, poller, exporter = setup
    renders: list[float] = []
    renderer = exporter._renderers["scripted"]
    real = renderer.render
    monkeypatch.setattr(renderer, "render", lambda f: renders.append(clock.t) or real(f))

    def second(t: float) -> None:  # a poll with a new value, then the loop's cycle
        clock.t = t
        source.next = [Sample("gpuwatchd_gpu_temperature_celsius", ("0", "GPU-a"), t)]
        poller.poll()
        exporter.refresh()
        exporter.render_ahead(t, cycle=1.0)

    for t in range(1000, 1016):
        second(float(t))
        if t in (1000, 1015):
            exporter.scrape()
    renders.clear()
    for t in range(1016, 1030):
        second(float(t))
    assert renders == [1029.0]  # 1015 + 15 - 1: the last cycle before the scrape
    clock.t = 1030.0  # the scrape, before the cycle of 1030: served as rendered at 1029
    assert b"} 1029.0" in exporter.scrape().text and renders == [1029.0]
    second(1030.0)
    clock.t = 1033.0  # early (expected at 1045), and the last render is 4 s old
    assert b"} 1030.0" in exporter.scrape().text and renders == [1029.0, 1033.0]
