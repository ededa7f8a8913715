from gpuwatchd.metrics import Sample
from gpuwatchd.store import Store

GPU0 = ("0", "GPU-a")


def util(value: float) -> Sample:
    return Sample("gpuwatchd_gpu_utilization_ratio", GPU0, value)


def test_latest_and_window():
    store = Store(history_seconds=60)
    store.register_source("nvml", stale_after=10)
    for t in range(0, 100, 5):
        store.update("nvml", float(t), [util(t / 100)])
    assert store.get(*util(0)[:2]) == 0.95
    points = store.window("gpuwatchd_gpu_utilization_ratio", GPU0, since=80)
    assert points == [(80.0, 0.8), (85.0, 0.85), (90.0, 0.9), (95.0, 0.95)]


def test_history_is_bounded_by_time_and_points():
    store = Store(history_seconds=30, max_points=4)
    for t in range(1000):
        store.update("nvml", float(t), [util(0.5)])
    assert len(store.window("gpuwatchd_gpu_utilization_ratio", GPU0, since=0)) == 4
    store = Store(history_seconds=30, max_points=10_000)
    for t in range(1000):
        store.update("nvml", float(t), [util(0.5)])
    assert len(store.window("gpuwatchd_gpu_utilization_ratio", GPU0, since=0)) == 31


def test_series_a_source_stops_reporting_disappear():
    store = Store()
    store.update("nvml", 0.0, [util(0.5), Sample("gpuwatchd_gpu_power_watts", GPU0, 300.0)])
    store.update("nvml", 1.0, [util(0.6)])
    assert store.get("gpuwatchd_gpu_power_watts", GPU0) is None
    assert store.series_count() == 1
    assert [key for key, _ in store.latest(1.0)] == [("gpuwatchd_gpu_utilization_ratio", GPU0)]


def test_sources_do_not_clobber_each_other():
    store = Store()
    store.update("nvml", 0.0, [util(0.5)])
    store.update("pcie", 0.0, [Sample("gpuwatchd_pcie_link_width", ("0000:34:00.0",), 16.0)])
    store.update("nvml", 1.0, [util(0.7)])
    assert store.get("gpuwatchd_pcie_link_width", ("0000:34:00.0",)) == 16.0


def test_stale_source_is_left_out_of_latest():
    store = Store()
    store.register_source("nvml", stale_after=3)
    store.update("nvml", 10.0, [util(0.5)])
    assert len(list(store.latest(13.0))) == 1
    assert list(store.latest(13.5)) == []
    assert store.is_stale("never-polled", 0.0)


def test_history_compacts_and_still_answers_windows():
    from gpuwatchd.store import Axis, History

    history = History(Axis(1), 0)
    for t in range(10_000):
        history.axis.append(float(t), (t * 2.0,), horizon=t - 99.5, max_points=10_000)
    assert len(history) == 100
    assert len(history.axis.times) <= 200  # expired points were dropped, not kept forever
    assert history.since(9_997) == [(9997.0, 19994.0), (9998.0, 19996.0), (9999.0, 19998.0)]
    assert history.since(0)[0] == (9900.0, 19800.0)
    assert history.since(20_000) == []


def test_the_same_series_again_reports_exactly_the_values_that_changed():
    store = Store()
    power = ("gpuwatchd_gpu_power_watts", GPU0)
    store.update("nvml", 0.0, [util(0.5), Sample(*power, 300.0)])
    store.update("nvml", 1.0, [util(0.5), Sample(*power, 300.0)])  # nothing moved
    assert store.changes("nvml", 1) == []
    store.update("nvml", 2.0, [util(0.5), Sample(power[0], tuple(GPU0), 310.0)])
    assert store.changes("nvml", 2) == [(power, 310.0)]  # equal labels, another tuple
    store.update("nvml", 3.0, [Sample(*power, 310.0), util(0.5)])  # another order
    assert store.get(*power) == 310.0 and store.get(*util(0)[:2]) == 0.5


def test_history_follows_keep_history_between_polls_of_the_same_series():
    store = Store()
    store.update("nvml", 0.0, [util(0.1), Sample("gpuwatchd_gpu_power_watts", GPU0, 1.0)])
    store.keep_history(["gpuwatchd_gpu_power_watts"])  # utilization's history dropped
    for t in (1.0, 2.0):
        store.update("nvml", t, [util(t), Sample("gpuwatchd_gpu_power_watts", GPU0, t)])
    assert store.window("gpuwatchd_gpu_utilization_ratio", GPU0, since=0) == []
    power = store.window("gpuwatchd_gpu_power_watts", GPU0, since=0)
    assert power == [(0.0, 1.0), (1.0, 1.0), (2.0, 2.0)]
    store.keep_history(["gpuwatchd_gpu_utilization_ratio"])
    store.update("nvml", 3.0, [util(3.0), Sample("gpuwatchd_gpu_power_watts", GPU0, 3.0)])
    assert store.window("gpuwatchd_gpu_utilization_ratio", GPU0, since=0) == [(3.0, 3.0)]
    assert store.window("gpuwatchd_gpu_power_watts", GPU0, since=0) == []


def gpu_samples(t: float, gpus: list[str]) -> list[Sample]:
    return [Sample("gpuwatchd_gpu_power_watts", (gpu,), t * 10 + int(gpu)) for gpu in gpus]


def power(store: Store, gpu: str) -> list[tuple[float, float]]:
    return store.window("gpuwatchd_gpu_power_watts", (gpu,), since=0)


def test_histories_made_by_one_update_share_one_time_axis():
    store = Store(history_seconds=3, max_points=10)
    for t in range(6):
        store.update("nvml", float(t), gpu_samples(t, ["0", "1", "2"]))
    ((axis, _),) = store._sources["nvml"].axes  # one append an update, not one a series
    assert {id(store._series[("gpuwatchd_gpu_power_watts", (g,))].history.axis) for g in "012"} == {
        id(axis)
    }
    assert power(store, "1") == [(2.0, 21.0), (3.0, 31.0), (4.0, 41.0), (5.0, 51.0)]
    assert store.window_values("gpuwatchd_gpu_power_watts", ("2",), since=4.5)[:2] == (5.0, 5.0)
    assert list(store.window_values("gpuwatchd_gpu_power_watts", ("2",), 4.5)[2]) == [52.0]


def test_windows_stay_exact_as_series_come_and_go():
    store = Store(max_points=3)
    store.update("nvml", 0.0, gpu_samples(0, ["0", "1", "2", "3"]))
    store.update("nvml", 1.0, gpu_samples(1, ["0", "2", "3"]))  # 1 gone
    store.update("nvml", 2.0, gpu_samples(2, ["3", "0", "2", "1"]))  # 1 back, a new series
    assert power(store, "1") == [(2.0, 21.0)]
    assert power(store, "0") == [(0.0, 0.0), (1.0, 10.0), (2.0, 20.0)]
    store.update("nvml", 3.0, gpu_samples(3, ["2", "1"]))  # half of the first axis gone
    assert power(store, "2") == [(1.0, 12.0), (2.0, 22.0), (3.0, 32.0)]
    assert power(store, "1") == [(2.0, 21.0), (3.0, 31.0)]
    assert power(store, "0") == []
    widths = sorted(axis.width for axis, _ in store._sources["nvml"].axes)
    assert widths == [1, 1]  # the gone series' points were dropped with them


def test_a_series_twice_in_one_update_takes_a_point_for_each():
    store = Store()
    for t in (0.0, 1.0):
        store.update("nvml", t, gpu_samples(t, ["0", "1"]) + gpu_samples(t + 0.5, ["0"]))
    assert power(store, "0") == [(0.0, 0.0), (0.0, 5.0), (1.0, 10.0), (1.0, 15.0)]
    assert power(store, "1") == [(0.0, 1.0), (1.0, 11.0)]


def test_no_two_sources_declare_one_family():
    """A series is one source's: its history shares a time axis with the others its
    source's update made, and its changes are told in that source's log. The built-in
    sources' families are disjoint."""
    from gpuwatchd.sources import load_builtin_sources

    owner: dict[str, str] = {}
    sources = load_builtin_sources()
    for name, source in sources.items():
        for spec in source.metrics:
            assert owner.setdefault(spec.name, name) == name, spec.name
    assert len(sources) >= 10 and len(owner) > 100
