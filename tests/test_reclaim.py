"""Swapping and background reclaim (sources/reclaim.py), and the job's major faults
(procio), on real files and through the simulator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_process import DETAIL

from gpuwatchd.cli import main
from gpuwatchd.sources.reclaim import PAGE_SIZE, Reclaim, kthread_times, vmstat_value

FIXTURES = Path(__file__).parent / "fixtures" / "reclaim"


def test_vmstat_on_the_real_file() -> None:
    data = (FIXTURES / "vmstat").read_bytes()
    assert vmstat_value(data, b"pswpin") == 0
    assert vmstat_value(data, b"pgmajfault") == 13988
    assert vmstat_value(data, b"nr_free_pages") == 1743195  # the first line
    assert vmstat_value(data, b"pswp") is None  # a prefix of a row is no row
    assert vmstat_value(b"pswpin x\n", b"pswpin") is None


def test_kswapd_is_a_kernel_thread_by_its_parent_not_its_name() -> None:
    assert kthread_times((FIXTURES / "kswapd0.stat").read_bytes(), b"kswapd") == 0
    assert kthread_times((FIXTURES / "bash.stat").read_bytes(), b"kswapd") is None
    # a tenant's process may call itself kswapd0 (prctl): its parent is not kthreadd (2)
    impostor = b"4242 (kswapd0) R 1 4242 4242 0 -1 4194560 0 0 0 0 500 20 0 0 20 0 1 0 9"
    assert kthread_times(impostor, b"kswapd") is None
    # pid 2 of a container's pid namespace is an ordinary process: no PF_KTHREAD flag
    child_of_2 = b"77 (kswapd0) S 2 77 77 0 -1 4194560 0 0 0 0 5 1 0 0 20 0 1 0 9"
    assert kthread_times(child_of_2, b"kswapd") is None
    busy = b"47 (kswapd0) R 2 0 0 0 -1 2230336 0 0 0 0 0 1234 0 0 20 0 1 0 39"
    assert kthread_times(busy, b"kswapd") == 1234


def _kswapd(proc: Path, pid: int, ticks: int) -> None:
    (proc / str(pid)).mkdir(exist_ok=True)
    line = f"{pid} (kswapd0) S 2 0 0 0 -1 2230336 0 0 0 0 0 {ticks} 0 0 20 0 1 0 39\n"
    (proc / str(pid) / "stat").write_text(line)


def test_swap_in_rate_and_kswapd_cpu_between_polls(tmp_path: Path) -> None:
    now = [100.0]
    (tmp_path / "vmstat").write_text("pgpgin 10\npswpin 1000\npswpout 0\n")
    _kswapd(tmp_path, 47, 500)
    (tmp_path / "self").mkdir()  # not a pid: skipped by the scan
    reclaim = Reclaim(str(tmp_path), lambda: now[0])
    assert reclaim.samples() == []  # a rate needs two readings
    now[0] += 2
    (tmp_path / "vmstat").write_text("pgpgin 10\npswpin 1500\npswpout 0\n")
    _kswapd(tmp_path, 47, 600)  # 100 ticks in 2 s: half a core
    got = {s.name: s.value for s in reclaim.samples()}
    assert got == {
        "gpuwatchd_memory_swap_in_bytes_per_second": 250 * PAGE_SIZE,
        "gpuwatchd_kswapd_cpu_ratio": pytest.approx(0.5),
    }
    # kswapd restarted under another pid (a memory node brought online): found again
    (tmp_path / "47" / "stat").unlink()
    now[0] += 1
    assert [s.name for s in reclaim.samples()] == ["gpuwatchd_memory_swap_in_bytes_per_second"]
    _kswapd(tmp_path, 48, 0)
    now[0] += 1
    reclaim.samples()  # the scan, a first reading
    now[0] += 1
    _kswapd(tmp_path, 48, 10)
    assert {s.name: s.value for s in reclaim.samples()}["gpuwatchd_kswapd_cpu_ratio"] == (
        pytest.approx(0.1))


def test_without_vmstat_or_kswapd_the_series_are_absent(tmp_path: Path) -> None:
    """A container without the host's /proc: no kswapd to see, nothing exported."""
    reclaim = Reclaim(str(tmp_path), lambda: 1.0)
    assert reclaim.samples() == [] and reclaim.samples() == []


def test_a_swapping_node_as_the_sources_read_it() -> None:
    """swapping-dataloader-workers-4xa100 at 400 s: 130 MB/s swapped in, kswapd at 0.85
    of a core, each rank's 8 workers at 350 major faults/s and its main process at 25."""
    result = CliRunner().invoke(
        main,
        ["simulate", "swapping-dataloader-workers-4xa100", "--until", "400", "--metrics", *DETAIL],
    )
    assert result.exit_code == 0, result.output

    def values(name: str) -> list[float]:
        pattern = rf"^gpuwatchd_{name}(?:{{[^}}]*}})? (\S+)$"
        return [float(v) for v in re.findall(pattern, result.output, re.M)]

    assert values("memory_swap_in_bytes_per_second") == [pytest.approx(130e6, rel=1e-3)]
    assert values("kswapd_cpu_ratio") == [pytest.approx(0.85, abs=0.02)]
    faults = values("gpu_process_major_faults_per_second")
    assert len(faults) == 4
    assert all(8 * 350 + 25 - 250 < f < 8 * 350 + 25 + 250 for f in faults)  # 2 ranks jittered
