"""The simulated nv-hostengine: groups, field groups, watches and values from the timeline.

A `SimHostengine` registers itself under an address `sim://<n>` (`register`); the fake
client library (library.py) finds it there with `lookup`. The registry lives in this
normally imported module, so every private copy of the fake bindings reaches the same
host engines. Embedded mode (`dcgmStartEmbedded`) attaches to the host engine passed to
`use_for_embedded`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.dcgm.fields import (
    FB_RESERVED_FRACTION,
    FE_GPU,
    FE_GPU_I,
    FIELD_LEVELS,
    FIELDS,
    GPM_PCI_DEVICE_IDS,
    GROUP_ALL_GPUS,
    GROUP_DEFAULT,
    MAX_FIELD_IDS_PER_FIELD_GROUP,
    MAX_NUM_DEVICES,
    MAX_NUM_FIELD_GROUPS,
    MAX_NUM_GROUPS,
    METRIC_GROUPS,
    NOT_FOUND,
    NOT_SUPPORTED,
    NVLINK_LINK_FIELDS,
    NVLINK_MAX_LINKS,
    NVLINK_PROFILING_FIELDS,
    PROFILING_VALUES,
    REAL_TIME_RESOLUTION,
    ST_BADPARAM,
    ST_DUPLICATE_KEY,
    ST_GPU_IS_LOST,
    ST_IN_USE,
    ST_INSTANCE_NOT_FOUND,
    ST_MAX_LIMIT,
    ST_NO_DATA,
    ST_NOT_SUPPORTED,
    ST_NOT_WATCHED,
    ST_OK,
    ST_PROFILING_NOT_SUPPORTED,
    SUPPORTED_CLOCKS_BLOB,
    VBIOS,
    VERSIONS,
    VIOLATIONS,
    FieldInfo,
    Status,
    blank,
    brand,
    nvlink_link_field,
    profiling_defaults,
    serial,
)
from gpuwatchd.sim.dcgm.mig import GpuInstance, gpu_activity, gpu_instances
from gpuwatchd.sim.dcgm.values import Integrals, sample_time
from gpuwatchd.sim.fake_nvml import gpu_uuid, nvml_bus_id
from gpuwatchd.sim.scenario import Timeline

# -- the registry ------------------------------------------------------------------------

_REGISTRY: dict[str, SimHostengine] = {}
_REGISTRY_LOCK = threading.Lock()
_EMBEDDED: list[SimHostengine] = []
_ids = itertools.count(1)


def register(engine: SimHostengine) -> str:
    """Make `engine` reachable at a new `sim://<n>` address; returns the address."""
    with _REGISTRY_LOCK:
        address = f"sim://{next(_ids)}"
        _REGISTRY[address] = engine
    return address


def unregister(address: str) -> None:
    with _REGISTRY_LOCK:
        engine = _REGISTRY.pop(address, None)
        if engine is not None and engine in _EMBEDDED:
            _EMBEDDED.remove(engine)


def lookup(address: str) -> SimHostengine | None:
    """The host engine listening at a dcgmConnect address ("tcp://sim://3", "sim://3")."""
    address = address.removeprefix("tcp://")
    with _REGISTRY_LOCK:
        return _REGISTRY.get(address)


def embedded() -> SimHostengine | None:
    """The host engine dcgmStartEmbedded attaches to, if any."""
    with _REGISTRY_LOCK:
        return _EMBEDDED[0] if _EMBEDDED else None


def use_for_embedded(engine: SimHostengine | None) -> None:
    """dcgmStartEmbedded attaches to `engine` (None: embedded mode fails to start)."""
    with _REGISTRY_LOCK:
        _EMBEDDED.clear()
        if engine is not None:
            _EMBEDDED.append(engine)


# -- the host engine ------------------------------------------------------------------


@dataclass
class Group:
    name: str
    entities: list[tuple[int, int]]  # (entityGroupId, entityId)
    owner: int  # connection id; 0: the host engine's own


@dataclass
class FieldGroup:
    name: str
    field_ids: list[int]
    owner: int


@dataclass
class Watch:
    group: int
    field_group: int
    interval: float  # seconds
    since: float  # elapsed seconds when it was set up
    owner: int


@dataclass
class State:
    """What one run of nv-hostengine holds; a restart starts a new one."""

    generation: int
    groups: dict[int, Group] = field(default_factory=dict)
    field_groups: dict[int, FieldGroup] = field(default_factory=dict)
    watches: dict[tuple[int, int, int], Watch] = field(default_factory=dict)
    profiling_paused: bool = False
    next_group: int = 1
    next_field_group: int = 1
    watched: dict[tuple[int, int], Watch] | None = None  # (gpu, field) -> watch, cached
    watched_gi: dict[tuple[int, int], Watch] = field(default_factory=dict)  # MIG GIs' too


class HostengineDown(Exception):
    pass


@dataclass
class _Plan:
    """SimHostengine.values() for one (entities, fields, live): per value, either its
    answer (an unknown GPU or field, an unwatched field) or what to read."""

    watched: dict[tuple[int, int], Watch]  # valid while these are the watches
    index: dict[int, int]  # and these the GPU ids
    watches: list[Watch | None]  # the watches sampled (None: a live read, now)
    entries: list[tuple[Any, Any]]  # (row, None), or (None, (kind, gpu, nvml index, info,
    # the index of its watch in `watches`))


class SimHostengine:
    """nv-hostengine on a simulated node: groups, watches, and values from the timeline."""

    def __init__(
        self, timeline: Timeline, clock: SimClock, version: str = "4", register_it: bool = True
    ) -> None:
        self.timeline = timeline
        self.clock = clock
        self.node = timeline.scenario.node
        self.model = self.node.model()
        self.version = VERSIONS.get(version, version)
        self.gpu_count = min(self.node.gpu_count, MAX_NUM_DEVICES)  # DCGM's limit per node
        self.uuids = [gpu_uuid(self.node.hostname, i) for i in range(self.gpu_count)]
        self.bus_ids = [nvml_bus_id(timeline.topology.gpu(i).bdf)[0] for i in range(self.gpu_count)]
        self.set_gpu_ids(list(range(self.gpu_count)))
        self.calls: Counter[str] = Counter()
        # CPU seconds values() has taken: nv-hostengine's own work, its process's on a
        # real node (a client's, only when embedded)
        self.cpu_seconds = 0.0
        self.unsupported_profiling = "error"  # or "empty": no metric groups, no error
        self.profiling_held = False  # another profiler (Nsight) holds the counters
        self.connect_timeouts_ms: list[int] = []  # timeoutMs of each connect attempt
        self._overrides: dict[tuple[int | None, int], Any] = {}
        # injected (elapsed, gpu, xid, GI id or None: the whole GPU's)
        self._xids: list[tuple[float, int, int, int | None]] = []
        self._forced: bool | None = None  # stop()/start() override of the timeline
        self._manual_restarts = 0
        self._lock = threading.RLock()
        self._up_changes = self._hostengine_changes()
        self._up_starts = [start for start, _ in self._up_changes]
        self._restarts_in = [  # phase starts where it comes back up, in one pass
            start
            for (start, up), (_, before) in zip(
                self._up_changes[1:], self._up_changes, strict=False
            )
            if up and not before
        ]
        self._plans: dict[tuple[Any, ...], _Plan] = {}  # values(): what each read needs
        self._gis: tuple[float, dict[int, GpuInstance]] | None = None  # at a time, by entity
        self._mig_activity: dict[int, tuple[Any, dict[str, float]]] = {}  # id(layout) ->
        self._state = State(self._generation(0.0))
        self._add_internal_field_groups()
        self._integrals = Integrals(timeline)
        self._getters = self._build_getters()
        self._profiling_supported = {
            fid for _, _, ids in self.supported_profiling_fields(0) for fid in ids
        }
        self.address = register(self) if register_it else ""

    def close(self) -> None:
        if self.address:
            unregister(self.address)

    # -- test hooks -------------------------------------------------------------------

    def stop(self) -> None:
        """nv-hostengine stops (until `start()`), whatever the timeline says."""
        self._forced = False

    def start(self) -> None:
        """nv-hostengine runs again: a new process, nothing of the old one survives."""
        if not self.up(self.now()):
            self._manual_restarts += 1
        self._forced = True

    def restart(self) -> None:
        """Stop and start at once: existing connections become invalid."""
        self._manual_restarts += 1

    def set_gpu_ids(self, ids: list[int]) -> None:
        """Give NVML index i the DCGM GPU id `ids[i]`, as after DCGM re-detected the GPUs and
        kept their ids by UUID while NVML renumbered them (by default the two agree)."""
        if len(ids) != self.gpu_count or len(set(ids)) != len(ids):
            raise ValueError(f"expected {self.gpu_count} distinct DCGM GPU ids, got {ids}")
        self.gpu_ids = list(ids)
        self._index = {gpu_id: i for i, gpu_id in enumerate(ids)}

    def nvml_index(self, gpu_id: int) -> int | None:
        """The NVML index (the scenario's GPU) DCGM's GPU `gpu_id` is; None if no such GPU."""
        return self._index.get(gpu_id)

    def gpus(self) -> list[tuple[int, int]]:
        """(DCGM_FE_GPU, DCGM GPU id) of every GPU, in id order."""
        return [(FE_GPU, gpu_id) for gpu_id in sorted(self.gpu_ids)]

    def gpu_instances(self, t: float | None = None) -> list[GpuInstance]:
        """The MIG GPU-instance entities at t (now): DCGM follows NVML's MIG config change
        events, so they are the scenario's layouts of the moment (mig.py)."""
        t = self.now() if t is None else t
        cached = self._gis
        if cached is None or cached[0] != t:
            values = self.timeline.state(t)[0]
            gis = [
                gi
                for gpu_id in sorted(self.gpu_ids)
                for gi in gpu_instances(
                    gpu_id, self._index[gpu_id], values[self._index[gpu_id]].get("mig")
                )
            ]
            cached = self._gis = (t, {gi.entity: gi for gi in gis})
        return list(cached[1].values())

    def _gi(self, entity: int, t: float) -> GpuInstance | None:
        self.gpu_instances(t)
        assert self._gis is not None
        return self._gis[1].get(entity)

    def is_entity(self, kind: int, entity: int) -> bool:
        """Whether a group may hold (kind, entity): a GPU, or a MIG GPU instance now."""
        if kind == FE_GPU:
            return self.nvml_index(entity) is not None
        return kind == FE_GPU_I and self._gi(entity, self.now()) is not None

    def follow_timeline(self) -> None:
        self._forced = None

    def hold_profiling(self, held: bool = True) -> None:
        """Another profiler takes (or gives back) the counters: blanks, and new watches fail."""
        self.profiling_held = held

    def set_value(self, field_id: int, value: Any, gpu: int | None = None) -> None:
        """Answer `value` (a number, a string or a blank sentinel) for a field of the GPU
        with NVML index `gpu` (None: every GPU). A string arrives as a string value even
        for a numeric field, as from a host engine of another DCGM version than the client."""
        self._overrides[(gpu, field_id)] = value

    def clear_values(self) -> None:
        self._overrides.clear()

    def inject_xid(self, gpu: int, xid: int, gpu_instance: int | None = None) -> None:
        """An Xid on the GPU with NVML index `gpu`; with `gpu_instance`, on that MIG GPU
        instance (its NVML GI id), which DCGM files on the instance's entity only."""
        self._xids.append((self.now(), gpu, xid, gpu_instance))

    @property
    def profiling_paused(self) -> bool:
        return self._state.profiling_paused

    def groups(self) -> dict[str, list[int]]:
        """Group name -> GPU ids, of the current host engine process."""
        return {
            g.name: [e for kind, e in g.entities if kind == FE_GPU]
            for g in self._state.groups.values()
        }

    def field_groups(self) -> dict[str, list[int]]:
        return {fg.name: list(fg.field_ids) for fg in self._state.field_groups.values()}

    def watched_fields(self) -> set[tuple[int, int]]:
        """(gpu, field id) pairs being sampled."""
        return set(self._watched())

    # -- time and lifecycle -------------------------------------------------------------

    def now(self) -> float:
        t = self.clock.elapsed()
        if not self.clock.virtual:
            t = math.floor(t / REAL_TIME_RESOLUTION) * REAL_TIME_RESOLUTION
        return t

    def _hostengine_changes(self) -> list[tuple[float, bool]]:
        """(phase start, host engine up) for one pass of the timeline."""
        return [
            (start, bool(self.timeline.host_state(start).get("dcgm_hostengine_up", True)))
            for start, _ in self.timeline.phases()
        ]

    def _timeline_up(self, t: float) -> bool:
        local = self.timeline._local(t)
        i = bisect.bisect_right(self._up_starts, local) - 1
        return self._up_changes[max(i, 0)][1] if self._up_changes else True

    def up(self, t: float) -> bool:
        return self._forced if self._forced is not None else self._timeline_up(t)

    def _generation(self, t: float) -> int:
        """How many times the host engine has (re)started by time t."""
        changes = self._up_changes
        restarts_in = self._restarts_in
        count = 0
        local = t
        if self.timeline.loop and self.timeline.duration > 0:
            cycles = int(t // self.timeline.duration)
            wrap = 1 if changes and changes[0][1] and not changes[-1][1] else 0
            count += cycles * (len(restarts_in) + wrap)
            local = t - cycles * self.timeline.duration
        count += sum(1 for start in restarts_in if start <= local)
        return count + self._manual_restarts

    def _current(self, t: float) -> State:
        """The running host engine's state at t; raises HostengineDown if it is not running."""
        if not self.up(t):
            raise HostengineDown
        generation = self._generation(t)
        if generation != self._state.generation:
            self._state = State(generation)
            self._add_internal_field_groups()
        return self._state

    def _add_internal_field_groups(self) -> None:
        for name in ("DCGM_INTERNAL_30SEC", "DCGM_INTERNAL_HOURLY", "DCGM_INTERNAL_JOB"):
            self._new_field_group(self._state, name, [150, 155, 203], owner=0)

    def _new_field_group(self, state: State, name: str, ids: list[int], owner: int) -> int:
        fg_id = state.next_field_group
        state.next_field_group += 1
        state.field_groups[fg_id] = FieldGroup(name, ids, owner)
        return fg_id

    # -- the API the client library forwards ----------------------------------------------

    def connect(self, connection: int) -> int:
        """A new client connection: returns the generation it belongs to."""
        with self._lock:
            return self._current(self.now()).generation

    def disconnect(self, connection: int, generation: int, persist: bool) -> None:
        """The client went away: unless it asked to persist, drop what it created."""
        with self._lock:
            state = self._state
            if persist or state.generation != generation:
                return
            state.watches = {k: w for k, w in state.watches.items() if w.owner != connection}
            state.groups = {k: g for k, g in state.groups.items() if g.owner != connection}
            state.field_groups = {
                k: fg for k, fg in state.field_groups.items() if fg.owner != connection
            }
            state.watched = None

    def check(self, generation: int) -> State:
        """The state a connection of `generation` may use (raises HostengineDown)."""
        state = self._current(self.now())
        if state.generation != generation:
            raise HostengineDown
        return state

    def group_entities(self, state: State, group_id: int) -> list[tuple[int, int]] | None:
        if group_id == GROUP_ALL_GPUS:
            return self.gpus()
        group = state.groups.get(group_id)
        return None if group is None else group.entities

    def group_create(self, state: State, kind: int, name: str, owner: int) -> int:
        if len(state.groups) >= MAX_NUM_GROUPS:
            raise Status(ST_MAX_LIMIT)
        group_id = state.next_group
        state.next_group += 1
        entities = self.gpus() if kind == GROUP_DEFAULT else []
        state.groups[group_id] = Group(name, entities, owner)
        return group_id

    def field_group_create(self, state: State, ids: list[int], name: str, owner: int) -> int:
        """As DCGM checks, in its order: the count (the client library: 1 to 127, the
        array's size less one), unknown ids, the number of field groups, the name."""
        if not 0 < len(ids) < MAX_FIELD_IDS_PER_FIELD_GROUP or any(f not in FIELDS for f in ids):
            raise Status(ST_BADPARAM)
        if len(state.field_groups) >= MAX_NUM_FIELD_GROUPS:
            raise Status(ST_MAX_LIMIT)
        if any(fg.name == name for fg in state.field_groups.values()):
            raise Status(ST_DUPLICATE_KEY)
        return self._new_field_group(state, name, list(ids), owner)

    def supported_profiling_fields(self, gpu: int) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        if not self.model.dcgm_profiling:
            return ()
        groups = METRIC_GROUPS
        if self.model.nvlinks == 0:
            groups = tuple(g for g in groups if not set(g[2]) & NVLINK_PROFILING_FIELDS)
        return groups

    def watch(self, state: State, group_id: int, fg_id: int, interval: float, owner: int) -> None:
        entities = self.group_entities(state, group_id)
        fg = state.field_groups.get(fg_id)
        if entities is None or fg is None:
            raise Status(ST_BADPARAM)
        key = (owner, group_id, fg_id)
        state.watches[key] = Watch(group_id, fg_id, max(interval, 0.001), self.now(), owner)
        state.watched = None
        # As DCGM's WatchFieldGroup: the cache manager's watches first, then the profiling
        # module's for the group's profiling fields (is_profiling: 1013+ too); if that
        # refuses, every watch of this group and field group is undone, device fields too.
        try:
            self._watch_profiling(entities, [f for f in fg.field_ids if FIELDS[f].profiling])
        except Status:
            self.unwatch(state, group_id, fg_id, owner)
            raise

    def _watch_profiling(self, entities: list[tuple[int, int]], profiling: list[int]) -> None:
        if not profiling:
            return
        for kind, gpu in entities:
            if kind != FE_GPU:
                continue
            groups = self.supported_profiling_fields(gpu)
            if not groups:
                raise Status(ST_PROFILING_NOT_SUPPORTED)
            supported = {fid for _, _, ids in groups for fid in ids}
            if not set(profiling) <= supported:
                raise Status(ST_NOT_SUPPORTED)
        if self.profiling_held:
            raise Status(ST_IN_USE)

    def unwatch(self, state: State, group_id: int, fg_id: int, owner: int) -> None:
        state.watches.pop((owner, group_id, fg_id), None)
        state.watched = None

    def _watched(self) -> dict[tuple[int, int], Watch]:
        state = self._state
        if state.watched is None:
            watched: dict[tuple[int, int], Watch] = {}
            gis: dict[tuple[int, int], Watch] = {}  # (GPU-instance entity, field)
            for watch in state.watches.values():
                entities = self.group_entities(state, watch.group) or []
                fg = state.field_groups.get(watch.field_group)
                if fg is None:
                    continue
                for kind, gpu in entities:
                    into = watched if kind == FE_GPU else gis if kind == FE_GPU_I else None
                    if into is None:
                        continue
                    for fid in fg.field_ids:
                        best = into.get((gpu, fid))
                        if best is None or watch.interval < best.interval:
                            into[(gpu, fid)] = watch
            state.watched, state.watched_gi = watched, gis
        return state.watched

    def values(
        self, entities: Iterable[tuple[int, int]], field_ids: list[int], live: bool = False
    ) -> list[tuple[int, int, int, str, Any, int, int]]:
        """(entity group, entity, field, type, value, status, ts µs) per entity and field.

        Watched fields answer their latest sample (taken on the watch's interval);
        unwatched ones answer DCGM_ST_NOT_WATCHED, unless `live` (read now).

        What does not depend on the time (which GPU, field and watch each value is, and
        the answers for unknown GPUs and fields or unwatched ones) is planned once per
        (entities, fields) and kept until the watches or the GPU ids change.
        """
        started = time.thread_time()
        try:
            return self._values(entities, field_ids, live)
        finally:
            self.cpu_seconds += time.thread_time() - started

    def _values(
        self, entities: Iterable[tuple[int, int]], field_ids: list[int], live: bool
    ) -> list[tuple[int, int, int, str, Any, int, int]]:
        t = self.now()
        plan = self._plan(tuple(entities), tuple(field_ids), live)
        start_wall = self.clock.start_wall
        quiet = self._state.profiling_paused or self.profiling_held
        ats = [t if w is None else sample_time(t, w.since, w.interval) for w in plan.watches]
        samples = [(at, round((start_wall + at) * 1e6), self.timeline.state(at)[0]) for at in ats]
        out: list[tuple[int, int, int, str, Any, int, int]] = []
        append = out.append
        value_in = self._value_in
        for row, read in plan.entries:
            if read is None:
                append(row)
                continue
            kind, gpu, index, info, slot = read
            at, ts, gpus = samples[slot]
            if kind == FE_GPU_I:  # a MIG GPU instance (`gpu` is its entity id)
                value, status = self._gi_value(gpu, info, at, gpus, quiet)
            else:
                value, status = value_in(index, info, at, gpus, quiet)
            # set_value may give a text or a blob (bytes): a host engine of another version
            ft = "s" if isinstance(value, str) else "b" if isinstance(value, bytes) else info.type
            append((kind, gpu, info.id, ft, value, status, ts))
        return out

    def _plan(self, entities: tuple[Any, ...], field_ids: tuple[int, ...], live: bool) -> _Plan:
        watched, index = self._watched(), self._index
        key = (entities, field_ids, live)
        plan = self._plans.get(key)
        if plan is not None and plan.watched is watched and plan.index is index:
            return plan
        entries: list[tuple[Any, Any]] = []
        slots: dict[int, int] = {}  # id(watch) -> its index in `watches`
        watches: list[Watch | None] = []
        for kind, gpu in entities:
            nvml = self.nvml_index(gpu) if kind == FE_GPU else -1 if kind == FE_GPU_I else None
            watches_of = watched if kind == FE_GPU else self._state.watched_gi
            for fid in field_ids:
                info = FIELDS.get(fid)
                ft = info.type if info is not None else "i"
                if nvml is None or info is None:
                    entries.append(((kind, gpu, fid, ft, blank(ft, NOT_FOUND), ST_OK, 0), None))
                    continue
                watch = watches_of.get((gpu, fid))
                if watch is None and not live:
                    entries.append(((kind, gpu, fid, ft, blank(ft), ST_NOT_WATCHED, 0), None))
                    continue
                slot = slots.get(id(watch))
                if slot is None:
                    slot = slots[id(watch)] = len(watches)
                    watches.append(watch)
                entries.append((None, (kind, gpu, nvml, info, slot)))
        if len(self._plans) >= 64:
            self._plans.clear()
        plan = self._plans[key] = _Plan(watched, index, watches, entries)
        return plan

    # -- values -----------------------------------------------------------------------------

    def _value(self, gpu: int, info: FieldInfo, t: float) -> tuple[Any, int]:
        """Field `info` of the scenario's GPU `gpu` (its NVML index) at t."""
        quiet = self._state.profiling_paused or self.profiling_held
        return self._value_in(gpu, info, t, self.timeline.state(t)[0], quiet)

    def _value_in(
        self, gpu: int, info: FieldInfo, t: float, gpus: list[dict[str, Any]], quiet: bool
    ) -> tuple[Any, int]:
        """`_value`, given the scenario's GPU values at t and whether profiling is paused
        or held (`quiet`)."""
        if self._overrides:
            override = self._overrides.get((gpu, info.id), self._overrides.get((None, info.id)))
            if override is not None:
                return override, ST_OK
        values = gpus[gpu]
        if values.get("lost"):
            return blank(info.type), ST_GPU_IS_LOST
        if info.profiling:
            if quiet:
                return blank(info.type), ST_OK
            if info.id not in self._profiling_supported:
                return blank(info.type, NOT_SUPPORTED), ST_OK
        getter = self._getters.get(info.id)
        value = getter(gpu, values, t) if getter is not None else None
        if value is None:
            return blank(info.type, NOT_SUPPORTED), ST_OK
        if info.type == "i":
            return int(round(value)), ST_OK
        return value, ST_OK

    def _whole_gpu_activity(self, layout: Any) -> dict[str, float]:
        """gpu_activity(layout), once per layout (a phase's)."""
        known = self._mig_activity.get(id(layout))
        if known is None or known[0] is not layout:
            if len(self._mig_activity) >= 64:
                self._mig_activity.clear()
            known = self._mig_activity[id(layout)] = (layout, gpu_activity(layout))
        return known[1]

    def _gi_value(
        self, entity: int, info: FieldInfo, t: float, gpus: list[dict[str, Any]], quiet: bool
    ) -> tuple[Any, int]:
        """What a MIG GPU-instance entity answers for field `info` at t (mig.py)."""
        gi = self._gi(entity, t)
        if gi is None:  # destroyed, MIG disabled, or never one
            return blank(info.type), ST_INSTANCE_NOT_FOUND
        if info.id == 50:  # DCGM_FI_DEV_NAME: the GPU instance's profile
            return gi.profile_name, ST_OK
        if FIELD_LEVELS.get(info.id) is None:
            if info.profiling:  # a GPU-level profiling field: GPM has no instance value
                return blank(info.type), ST_NO_DATA
            return self._value_in(gi.gpu, info, t, gpus, quiet)  # remapped to the GPU
        if gpus[gi.gpu].get("lost"):
            return blank(info.type), ST_GPU_IS_LOST
        if not info.profiling:
            return self._gi_device_value(gi, info, t, gpus)
        if quiet:
            return blank(info.type), ST_OK
        key = PROFILING_VALUES.get(info.id)
        return (gi.activity[key] if key else 0.0), ST_OK

    def _gi_device_value(
        self, gi: GpuInstance, info: FieldInfo, t: float, gpus: list[dict[str, Any]]
    ) -> tuple[Any, int]:
        """A GPU_I/GPU_CI-level device field on a GPU instance: the framebuffer of its MIG
        device (nvmlDeviceGetMemoryInfo_v2 on it: the GI's memory, none reserved) in MiB,
        its own last Xid; the UUID its GPU's (DCGM's is the MIG device's: not modelled)."""
        if info.id == 230:
            return self._last_xid(gi.gpu, t, gi.nvml_id), ST_OK
        layout = gpus[gi.gpu].get("mig")
        total = gi.devices[0].profile.memory_mib
        used = min(total, round(layout.gi_memory_used_mib(gi.nvml_id))) if layout else 0
        answers = {250: total, 251: total - used, 252: used, 253: 0}
        if info.id in answers:
            return answers[info.id], ST_OK
        return self._value_in(gi.gpu, info, t, gpus, False)

    def _build_getters(self) -> dict[int, Callable[[int, dict[str, Any], float], Any]]:
        """Field id -> f(gpu, scenario values at t, t): the value in DCGM's unit, or None
        where this GPU model does not support the field."""
        model, node, integrals = self.model, self.node, self._integrals
        total = model.memory_total_mib
        reserved = round(total * FB_RESERVED_FRACTION)

        def used(v: dict[str, Any]) -> float:
            return min(float(v["memory_used_mib"]), total - reserved)

        def profiling(key: str) -> Callable[[int, dict[str, Any], float], Any]:
            def get(gpu: int, v: dict[str, Any], t: float) -> Any:
                layout = v.get("mig")
                if layout is not None and layout.enabled:  # the instances' activity (mig.py)
                    return self._whole_gpu_activity(layout)[key]
                value = v.get(key)
                return profiling_defaults(v)[key] if value is None else value

            return get

        def rate(key: str, scale: float) -> Callable[[int, dict[str, Any], float], Any]:
            return lambda gpu, v, t: (v.get(key) or 0.0) * scale

        def dcgm_pcie(way: str) -> Callable[[int, dict[str, Any], float], Any]:
            """DCGM's own PCIe bytes where the scenario gives them, else NVML's rate."""

            def get(gpu: int, v: dict[str, Any], t: float) -> Any:
                own = v.get(f"dcgm_pcie_{way}_mb_s")
                return (v.get(f"pcie_{way}_mb_s") or 0.0 if own is None else own) * 1e6

            return get

        def violation(fid: int) -> Callable[[int, dict[str, Any], float], Any]:
            return lambda gpu, v, t: integrals.violation_s(gpu, fid, t) * 1e9  # ns

        def remap(key: str) -> Callable[[int, dict[str, Any], float], Any]:
            # as NVML, which DCGM asks: none on a MIG GPU with instances (nvml.h)
            return lambda gpu, v, t: int(v[key]) if datacenter and not _instances(v) else None

        ecc = "nvmlDeviceGetTotalEccErrors" not in model.unsupported
        datacenter = model.datacenter
        nvlinks = model.nvlinks > 0
        getters: dict[int, Callable[[int, dict[str, Any], float], Any]] = {
            1: lambda gpu, v, t: node.driver_version,
            2: lambda gpu, v, t: f"{node.cuda_driver_version // 1000}.{node.driver_version}",
            4: lambda gpu, v, t: self.gpu_count,
            50: lambda gpu, v, t: model.name,
            51: lambda gpu, v, t: brand(model.datacenter),
            52: lambda gpu, v, t: gpu,  # the NVML index, whatever DCGM's id
            53: lambda gpu, v, t: serial(gpu),
            54: lambda gpu, v, t: self.uuids[gpu],
            57: lambda gpu, v, t: self.bus_ids[gpu],
            85: lambda gpu, v, t: VBIOS,
            100: lambda gpu, v, t: v["sm_clock_mhz"],
            101: lambda gpu, v, t: v["mem_clock_mhz"],
            130: lambda gpu, v, t: SUPPORTED_CLOCKS_BLOB,
            140: lambda gpu, v, t: v["temperature_c"] + 3 if datacenter else None,
            150: lambda gpu, v, t: v["temperature_c"],
            155: lambda gpu, v, t: v["power_w"],
            156: lambda gpu, v, t: integrals.energy_j(gpu, t) * 1000,  # mJ
            190: lambda gpu, v, t: v["pstate"],
            200: rate("pcie_tx_mb_s", 1e6 / 1024),  # KB/s
            201: rate("pcie_rx_mb_s", 1e6 / 1024),
            202: lambda gpu, v, t: v["pcie_replay_count"],
            203: lambda gpu, v, t: v["utilization_gpu"],
            204: lambda gpu, v, t: v["utilization_memory"],
            206: lambda gpu, v, t: 0,
            207: lambda gpu, v, t: 0,
            230: lambda gpu, v, t: self._last_xid(gpu, t),
            250: lambda gpu, v, t: total,
            251: lambda gpu, v, t: total - reserved - used(v),
            252: lambda gpu, v, t: used(v),
            253: lambda gpu, v, t: reserved,
            310: lambda gpu, v, t: v["ecc_corrected_total"] if ecc else None,
            311: lambda gpu, v, t: v["ecc_uncorrected_total"] if ecc else None,
            312: lambda gpu, v, t: v["ecc_corrected_total"] if ecc else None,
            313: lambda gpu, v, t: v["ecc_uncorrected_total"] if ecc else None,
            449: lambda gpu, v, t: integrals.nvlink_bytes(gpu, t) / 1024 if nvlinks else None,
            1009: dcgm_pcie("tx"),  # bytes per second, headers included
            1010: dcgm_pcie("rx"),
            1011: rate("nvlink_tx_mb_s", 1e6),
            1012: rate("nvlink_rx_mb_s", 1e6),
            1013: lambda gpu, v, t: 0.0,  # no integer tensor work in the scenarios
        }
        for fid, key in PROFILING_VALUES.items():
            getters[fid] = profiling(key)
        for fid in VIOLATIONS:
            getters[fid] = violation(fid)
        for fid in range(390, 393):  # retired pages: none on a row-remapping GPU
            getters[fid] = lambda gpu, v, t: 0 if datacenter else None
        # row remapping (Ampere-class and newer): 393 uncorrectable and 394 correctable
        # rows remapped, 395 a failure, 396 a remap pending
        getters[393] = remap("remapped_rows_uncorrectable_total")
        getters[394] = remap("remapped_rows_correctable_total")
        getters[395] = remap("row_remap_failed")
        getters[396] = remap("row_remap_pending")
        for fid in (409, 419, 429, 439):
            getters[fid] = lambda gpu, v, t: 0 if nvlinks else None
        for kind in NVLINK_LINK_FIELDS:  # per link: 0 errors on the model's links
            for link in range(NVLINK_MAX_LINKS):
                count = 0 if link < model.nvlinks else None
                getters[nvlink_link_field(kind, link)] = _constant(count)
        for link in range(model.nvlinks):  # traffic: an equal share of all links'
            getters[nvlink_link_field("nvlink_throughput", link)] = lambda gpu, v, t: (
                integrals.nvlink_bytes(gpu, t) / 1024 / model.nvlinks
            )
        return getters  # 526 (vGPU licence) and anything else: not supported here

    def _last_xid(self, gpu: int, t: float, gpu_instance: int | None = None) -> int:
        """The last Xid DCGM filed on the GPU (`gpu_instance` None: those naming no MIG
        instance) or on one of its GPU instances (RecordXidForGpu/ForGpuInstance)."""
        timeline = self.timeline
        period = timeline.duration if timeline.loop and timeline.duration > 0 else None
        since = max(-1.0, t - period) if period else -1.0
        last: tuple[float, int] = (-math.inf, 0)
        for event in timeline.xid_events(since, t):
            mine = event.gpu == gpu and event.time >= last[0]
            if mine and self._xid_instance(event.time, gpu, event.xid) == gpu_instance:
                last = (event.time, event.xid)
        for at, g, xid, gi in self._xids:
            if g == gpu and gi == gpu_instance and at <= t and at >= last[0]:
                last = (at, xid)
        return last[1]

    def _xid_instance(self, at: float, gpu: int, xid: int) -> int | None:
        """The GI an Xid of the scenario's lands on (as the fake NVML's event names it:
        the MIG device whose `xid` lists it), None for the whole GPU's."""
        layout = self.timeline.state(at)[0][gpu].get("mig")
        if layout is None or not layout.enabled:
            return None
        return next((d.gpu_instance for d in layout.devices if xid in d.xids), None)

    # -- profiling pause ----------------------------------------------------------------------

    def gpm(self) -> bool:
        return self.model.pci_device_id in GPM_PCI_DEVICE_IDS


def _constant(value: Any) -> Callable[[int, dict[str, Any], float], Any]:
    return lambda gpu, v, t: value


def _instances(values: dict[str, Any]) -> bool:
    """Whether the GPU has MIG enabled and a GPU instance."""
    layout = values.get("mig")
    return layout is not None and layout.enabled and bool(layout.devices)
