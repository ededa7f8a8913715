"""One GPU main process, read per poll: /proc/PID/*, its threads, children and cgroup.

`MainProcessReader` reads the files listed under "The main process" in
gpuwatchd.sources.processes into a `Facts` record, and keeps in `_Known` what the next
poll needs for rates (CPU ticks of the process, its threads and children) and the facts
read once (the CUDA runtime); `_cgroup` finds the tightest CPU limit and its throttling.
A mixin of ProcessesSource, which sets the state it declares. Every file goes through
the package's `_read` (gpuwatchd.sources.processes), looked up at each call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatchd.config import ProcessesConfig
from gpuwatchd.sources import processes as package
from gpuwatchd.sources.cpu import parse_pressure
from gpuwatchd.sources.processes.procfs import (
    CLK_TCK,
    MAX_MAPS_BYTES,
    _Gone,
    _is_count,
    cpu_cgroup,
    in_container,
    parse_cfs_quota,
    parse_cgroup,
    parse_children,
    parse_cpu_max,
    parse_cpulist,
    parse_cudart,
    parse_flat_keyed,
    parse_stat,
    status_value,
    thread_times,
)
from gpuwatchd.sources.procio import JobIo

log = logging.getLogger("gpuwatchd.sources.processes")


@dataclass
class _Known:
    """A process read at an earlier poll: enough to compute rates and keep slow facts."""

    start: int
    at: float
    ticks: int
    name: str  # comm when first read: gpu_process_info's label, one series per process
    threads: dict[int, tuple[int, int]] = field(default_factory=dict)  # tid -> (start, ticks)
    children: dict[int, tuple[int, int]] = field(default_factory=dict)
    other_children: set[int] = field(default_factory=set)  # children of non-main threads
    capped: bool = False  # more threads than max_threads
    cudart: str | None = None
    maps_read_at: int | None = None  # poll of the last maps read


@dataclass
class Facts:
    """One main process, this poll."""

    pid: int
    name: str
    threads: int
    ppid: int = 0
    workers: int | None = None
    cpu: float | None = None
    busiest: float | None = None
    workers_cpu: float | None = None
    cpus: frozenset[int] | None = None
    container: bool | None = None
    quota: float | None = None  # CPUs; None: no limit, or not known
    throttled_ratio: float | None = None
    throttled_seconds: float | None = None
    memory_pressure: float | None = None  # its cgroup's PSI memory some avg60, 0-1
    cudart: str | None = None
    age: float | None = None  # seconds since it started


@dataclass
class _CgroupReading:
    quota: float | None  # CPUs; None: no limit
    stat_path: str = ""  # the cpu.stat throttling is read from
    seconds: float | None = None  # throttled time, cumulative
    ratio: float | None = None  # throttled share of periods since the last poll
    memory_pressure: float | None = None  # the process's own cgroup (v2): PSI some avg60


class MainProcessReader:
    """ProcessesSource's reading of one main process."""

    settings: ProcessesConfig
    polls: int
    _proc: str
    _cgroup_root: str
    _uptime: float | None
    _known: dict[int, _Known]
    _cgroups: dict[str, tuple[float, int, int]]
    _children_file: bool
    _ppid_children: dict[int, list[int]]
    _cpulists: dict[str, frozenset[int]]
    _io: JobIo
    _read_now: dict[int, tuple[bytes, bytes]]
    _complain: Callable[[str, str], None]
    _scan: Callable[[], None]

    def _facts(
        self, pid: int, now: float, scanning: bool, memo: dict[str, _CgroupReading | None]
    ) -> Facts | None:
        base = f"{self._proc}/{pid}"
        try:
            return self._read_facts(pid, base, now, scanning, memo)
        except _Gone:
            log.debug("processes: pid %d exited while being read", pid)
        except ValueError as e:  # the other parsers' errors are handled where they feed
            self._complain("stat", f"{base}/stat: {e}")
        except OSError as e:
            self._complain("proc", f"{base}: {e}")
        self._known.pop(pid, None)
        return None

    def _read_facts(
        self, pid: int, base: str, now: float, scanning: bool,
        memo: dict[str, _CgroupReading | None],
    ) -> Facts:  # fmt: skip
        raw_stat = package._proc_read(f"{base}/stat")
        stat = parse_stat(raw_stat)
        known = self._known.get(pid)
        if known is not None and known.start != stat.starttime:
            known = None  # the pid was reused
        dt = now - known.at if known is not None else 0.0
        rated = known is not None and dt > 0
        # a process renaming itself (prctl PR_SET_NAME) every poll must not add a series
        # each time: the name is the one it had when first read (pid + start time)
        name = known.name if known is not None else stat.comm
        facts = Facts(pid, name, stat.threads, stat.ppid)
        if self._uptime is not None:
            facts.age = max(0.0, self._uptime - stat.starttime / CLK_TCK)
        state = _Known(stat.starttime, now, stat.ticks, name)
        if known is not None:
            state.cudart, state.maps_read_at = known.cudart, known.maps_read_at
            state.other_children = known.other_children
        if rated:
            assert known is not None
            facts.cpu = max(0, stat.ticks - known.ticks) / CLK_TCK / dt

        # threads: the busiest one (the hot loop: one small read and split per thread)
        tids = self._tids(pid, base)
        state.capped = len(tids) > self.settings.max_threads
        threads = state.threads
        remembered = known.threads if known is not None else {}
        before = remembered if rated else None
        count_new = known is not None and not known.capped
        busiest = -1
        for tid in tids[: self.settings.max_threads]:
            try:
                ticks, start = thread_times(package._read(f"{base}/task/{tid}/stat", 4096))
            except (OSError, ValueError):
                # exited, or unreadable this once: remember it as known with no reading
                # (ticks -1), so that next poll neither takes it for a new thread (all
                # its CPU time at once) nor spreads two intervals' time over one
                if tid in remembered:
                    threads[tid] = (remembered[tid][0], -1)
                continue
            threads[tid] = (start, ticks)
            if before is None:
                continue
            seen = before.get(tid)
            if seen is not None and seen[0] == start:
                if seen[1] < 0:
                    continue
                delta = ticks - seen[1]
            elif count_new:
                delta = ticks  # born since the last poll
            else:
                continue
            if delta > busiest:
                busiest = delta
        if before is not None and busiest >= 0:
            facts.busiest = busiest / CLK_TCK / dt

        # children (DataLoader workers)
        children = self._children(pid, base, tids, state, scanning)
        stats = {pid: raw_stat}  # read once a poll, for procio too
        if children is not None:
            workers, spent = 0, 0
            for child in children:
                try:
                    raw = stats[child] = package._read(f"{self._proc}/{child}/stat", 4096)
                    cstat = parse_stat(raw)
                except (OSError, ValueError):
                    if known is not None and child in known.children:
                        state.children[child] = (known.children[child][0], -1)  # as threads
                    continue
                if cstat.ppid != pid or cstat.state in "ZX":
                    continue
                workers += 1
                state.children[child] = (cstat.starttime, cstat.ticks)
                if rated:
                    assert known is not None
                    last = known.children.get(child)
                    if last is not None and last[0] == cstat.starttime:
                        if last[1] >= 0:
                            spent += max(0, cstat.ticks - last[1])
                    else:
                        spent += cstat.ticks  # forked since the last poll
            facts.workers = workers
            if rated:
                facts.workers_cpu = spent / CLK_TCK / dt
        self._io.read(pid, children or [], scanning, stats)

        # affinity
        try:
            text = status_value(package._proc_read(f"{base}/status"), b"Cpus_allowed_list")
            facts.cpus = None if text is None else self._cpulist(text)
            if facts.cpus is None:
                self._complain("status", f"{base}/status: no valid Cpus_allowed_list")
        except _Gone:
            raise
        except OSError as e:
            self._complain("status", f"{base}/status: {e}")

        # cgroup: container, CPU limit, throttling
        read_now: tuple[bytes, bytes] | None = None  # for the owners' reader, if it lives
        try:
            raw_cgroup = package._proc_read(f"{base}/cgroup")
            lines = parse_cgroup(raw_cgroup)
        except _Gone:
            raise
        except (OSError, ValueError) as e:
            self._complain("cgroup", f"{base}/cgroup: {e}")
        else:
            read_now = (raw_stat, raw_cgroup)
            facts.container = in_container(lines)
            where = cpu_cgroup(lines)
            if where is not None:
                key = f"{where[0]}:{where[1]}:{where[2]}"
                if key not in memo:
                    memo[key] = self._cgroup(*where, now)
                reading = memo[key]
                if reading is not None:
                    facts.quota = reading.quota
                    facts.throttled_ratio = reading.ratio
                    facts.throttled_seconds = reading.seconds
                    facts.memory_pressure = reading.memory_pressure

        # CUDA runtime, from the memory maps: once, or at each scan until found; "" when
        # the maps were read and map none (yet), None while they could not be read
        if not state.cudart and (state.maps_read_at is None or scanning):
            state.maps_read_at = self.polls
            try:
                maps = package._proc_read(f"{base}/maps", MAX_MAPS_BYTES)
                state.cudart = parse_cudart(maps) or ""
            except _Gone:
                raise
            except OSError as e:
                self._complain("maps", f"{base}/maps: {e} (the CUDA runtime needs root or "
                               "CAP_SYS_PTRACE to be read)")  # fmt: skip
        facts.cudart = state.cudart

        self._known[pid] = state
        if read_now is not None:  # not for a process gone before its last read
            self._read_now[pid] = read_now
        return facts

    @staticmethod
    def _tids(pid: int, base: str) -> list[int]:
        """The process's threads, the main thread first."""
        try:
            entries = os.listdir(f"{base}/task")
        except (FileNotFoundError, ProcessLookupError) as e:
            raise _Gone(base) from e
        tids = sorted(int(e) for e in entries if _is_count(e) and int(e) != pid)
        return [pid, *tids]

    def _children(
        self, pid: int, base: str, tids: list[int], state: _Known, scanning: bool
    ) -> list[int] | None:
        """Child pids: the main thread's children file every poll, other threads' at scans."""
        if not self._children_file:
            return self._ppid_children.get(pid, [])
        try:
            children = parse_children(package._read(f"{base}/task/{pid}/children", 1 << 20))
        except FileNotFoundError:
            if os.path.exists(f"{base}/task/{pid}/stat"):
                log.info(
                    "processes: this kernel has no /proc/PID/task/*/children; DataLoader "
                    "workers are found by a scan of every process's ppid every %d polls",
                    self.settings.scan_every,
                )
                self._children_file = False
                self._scan()
                return self._ppid_children.get(pid, [])
            raise _Gone(base) from None
        except ProcessLookupError:
            raise _Gone(base) from None
        except (OSError, ValueError) as e:
            self._complain("children", f"{base}/task/{pid}/children: {e}")
            return None
        if scanning:
            state.other_children = set()
            for tid in tids[1 : self.settings.max_threads]:
                try:
                    data = package._read(f"{base}/task/{tid}/children", 1 << 20)
                    state.other_children.update(parse_children(data))
                except (OSError, ValueError):
                    continue
        if state.other_children:
            children = sorted(set(children) | state.other_children)
        return children

    def _cgroup(self, version: int, hierarchy: str, path: str, now: float) -> _CgroupReading | None:
        """The tightest CPU limit from `path` up to the root, and that cgroup's throttling."""
        root = os.path.join(self._cgroup_root, hierarchy) if hierarchy else self._cgroup_root
        parts = [p for p in path.split("/") if p]
        leaf = os.path.join(root, *parts)
        if not os.path.isdir(leaf):
            self._complain("cgroupfs", f"{leaf}: no such cgroup (is the host's cgroup "
                           f"filesystem mounted at {self._cgroup_root}?)")  # fmt: skip
            return None
        reading = _CgroupReading(quota=None)
        if version == 2:  # the job's own memory stalls, not the node's (the root has none)
            reading.memory_pressure = self._memory_pressure(leaf)
        binding = leaf
        for depth in range(len(parts), 0, -1):
            directory = os.path.join(root, *parts[:depth])
            try:
                if version == 2:
                    text = package._text(os.path.join(directory, "cpu.max"))
                    quota = None if text is None else parse_cpu_max(text)
                else:
                    q = package._text(os.path.join(directory, "cpu.cfs_quota_us"))
                    p = package._text(os.path.join(directory, "cpu.cfs_period_us"))
                    quota = None if q is None or p is None else parse_cfs_quota(q, p)
            except ValueError as e:
                self._complain("cpu.max", f"{directory}: {e}")
                continue
            if quota is not None and (reading.quota is None or quota < reading.quota):
                reading.quota, binding = quota, directory
        stat_path = reading.stat_path = os.path.join(binding, "cpu.stat")
        text = package._text(stat_path)
        if text is None:
            return reading
        values = parse_flat_keyed(text)
        periods, throttled = values.get("nr_periods"), values.get("nr_throttled")
        if version == 2 and "throttled_usec" in values:
            reading.seconds = values["throttled_usec"] / 1e6
        elif version == 1 and "throttled_time" in values:
            reading.seconds = values["throttled_time"] / 1e9
        if periods is None or throttled is None:
            return reading
        before = self._cgroups.get(stat_path)
        self._cgroups[stat_path] = (now, periods, throttled)
        if before is not None and now > before[0]:
            d_periods, d_throttled = periods - before[1], throttled - before[2]
            if d_periods > 0 and d_throttled >= 0:
                reading.ratio = min(1.0, d_throttled / d_periods)
            elif d_periods == 0:
                reading.ratio = 0.0
        return reading

    def _memory_pressure(self, cgroup: str) -> float | None:
        """`some` avg60 of a v2 cgroup's memory.pressure as a ratio; None without PSI."""
        path = os.path.join(cgroup, "memory.pressure")
        text = package._text(path)
        if text is None:
            return None
        try:
            some = parse_pressure(text).get("some")
        except ValueError as e:
            self._complain("memory.pressure", f"{path}: {e}")
            return None
        return None if some is None else some.avg60 / 100

    def _cpulist(self, text: str) -> frozenset[int] | None:
        """parse_cpulist, remembered: processes share a few affinity lists."""
        cpus = self._cpulists.get(text)
        if cpus is None:
            try:
                cpus = parse_cpulist(text)
            except ValueError:
                return None
            if len(self._cpulists) >= 64:
                self._cpulists.clear()
            self._cpulists[text] = cpus
        return cpus
