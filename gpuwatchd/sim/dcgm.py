"""The simulator's DCGM: a simulated nv-hostengine and a fake libdcgm client library.

Layers, as on a real node:

- `gpuwatchd/sim/fake_dcgm/` is a DCGM Python bindings directory (`pydcgm`,
  `dcgm_structs`, `dcgm_agent`, ...) with the real bindings' module names, classes,
  signatures, ctypes structs and exception classes. Like the real ones it is not a
  package: the modules import each other by bare name, and a consumer loads them
  from the directory (the DCGM source does so without leaving `sys.path` changed).
- Its `dcgm_structs._dcgmInit()` loads the client library. The real one opens
  `libdcgm.so.4` with ctypes; the fake asks its `_sim` module, which returns a
  `FakeDcgmLib` from this module: every DCGM C symbol the bindings call, taking the C
  arguments (`byref(struct)`, `c_void_p` handles, ctypes arrays, enumeration
  callbacks) and returning a `dcgmReturn_t`.
- `SimHostengine` is nv-hostengine for one simulated node: GPU groups, field groups,
  watches, profiling pause, all lost when it restarts. Field values come from the
  scenario's timeline at the node clock's time, sampled on the watch's update interval
  and converted to DCGM's units and blank sentinels.

How the fake finds its node: a `SimHostengine` registers itself in this module under
an address `sim://<n>` (see `register`). The simulated node tells the DCGM source to
connect to that address (context extras `dcgm_hostengine`), and `dcgmConnect_v3`
looks it up here; any other address behaves as a host with nothing listening. The
registry lives in this normally imported module, so every private copy of the fake
bindings reaches the same host engines. Embedded mode (`dcgmStartEmbedded`) attaches to
the host engine passed to `use_for_embedded`.

Scenario values that drive DCGM: the GPU values (profiling ratios, NVLink and PCIe
traffic, power, clocks, memory, clock event reasons, Xids, `lost`) and the host value
`dcgm_hostengine_up`: while it is false, connecting fails and every call on an existing
connection answers DCGM_ST_CONNECTION_NOT_VALID; when it comes back, the host engine is
a new process (a new generation) with no groups, field groups, watches or pause.
A GPU model with `dcgm_profiling: false` answers dcgmProfGetSupportedMetricGroups with
DCGM_ST_PROFILING_NOT_SUPPORTED and refuses watches of profiling fields.

Test hooks on `SimHostengine`: `stop()`/`start()`/`restart()`, `hold_profiling()`
(another profiler holds the counters), `set_value()` (override one field, blanks
included), `inject_xid()`, `unsupported_profiling` ("error" or "empty"), and `calls`.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.sim.clock import SimClock
from gpuwatchd.sim.fake_nvml import gpu_uuid, nvml_bus_id
from gpuwatchd.sim.fakelib import install_symbols, symbol
from gpuwatchd.sim.scenario import Timeline

FAKE_BINDINGS = Path(__file__).resolve().parent / "fake_dcgm"

# Where DCGM installs its Python bindings, relative to the root file system
BINDINGS_DIRS = {
    "4": Path("usr/share/datacenter-gpu-manager-4/bindings/python3"),
    "3": Path("usr/local/dcgm/bindings/python3"),
}
VERSIONS = {"4": "4.2.3", "3": "3.3.9"}

# dcgmReturn_t (dcgm_structs.h)
ST_OK = 0
ST_BADPARAM = -1
ST_GENERIC_ERROR = -3
ST_NOT_CONFIGURED = -5
ST_NOT_SUPPORTED = -6
ST_INIT_ERROR = -7
ST_UNINITIALIZED = -10
ST_VER_MISMATCH = -12
ST_UNKNOWN_FIELD = -13
ST_NO_DATA = -14
ST_NOT_WATCHED = -16
ST_GPU_IS_LOST = -18
ST_CONNECTION_NOT_VALID = -21
ST_MAX_LIMIT = -24
ST_DUPLICATE_KEY = -26
ST_IN_USE = -34
ST_GROUP_IS_EMPTY = -35
ST_PROFILING_NOT_SUPPORTED = -36

# Blank sentinels (dcgmvalue.py / dcgm_structs.h)
INT64_BLANK = 0x7FFFFFFFFFFFFFF0
FP64_BLANK = 140737488355328.0
STR_BLANK = "<<<NULL>>>"
NOT_FOUND, NOT_SUPPORTED, NOT_PERMISSIONED = 1, 2, 3  # offsets from the blank base

FE_GPU = 1
GROUP_DEFAULT = 0
GROUP_EMPTY = 1
GROUP_ALL_GPUS = 0x7FFFFFFF
MAX_STR_LENGTH = 256
MAX_NUM_DEVICES = 32  # DCGM_MAX_NUM_DEVICES: GPUs one host engine handles
MAX_NUM_GROUPS = 64
MAX_FIELD_IDS_PER_FIELD_GROUP = 128
MAX_NUM_FIELD_GROUPS = 64
REAL_TIME_RESOLUTION = 0.05  # real-time clocks: sample times are quantized to this

# Hopper and newer read profiling metrics through GPM: no pause/resume (DCGM_ST_NOT_SUPPORTED)
GPM_PCI_DEVICE_IDS = frozenset({0x2330})
FB_RESERVED_FRACTION = 0.0068  # what the driver keeps for itself (A100 80GB: ~557 MiB)


@dataclass(frozen=True)
class FieldInfo:
    id: int
    tag: str  # as in DCGM's field table
    type: str  # DCGM_FT_*: "d" double, "i" int64, "s" string
    profiling: bool = False


def _fields(*rows: tuple[int, str, str]) -> dict[int, FieldInfo]:
    return {fid: FieldInfo(fid, tag, ft, 1001 <= fid <= 1012) for fid, tag, ft in rows}


FIELDS: dict[int, FieldInfo] = _fields(
    (1, "driver_version", "s"),
    (2, "nvml_version", "s"),
    (4, "device_count", "i"),
    (50, "name", "s"),
    (54, "uuid", "s"),
    (57, "pci_busid", "s"),
    (100, "sm_clock", "i"),
    (101, "memory_clock", "i"),
    (140, "memory_temp", "i"),
    (150, "gpu_temp", "i"),
    (155, "power_usage", "d"),
    (156, "total_energy_consumption", "i"),
    (190, "pstate", "i"),
    (200, "pcie_tx_throughput", "i"),
    (201, "pcie_rx_throughput", "i"),
    (202, "pcie_replay_counter", "i"),
    (203, "gpu_utilization", "i"),
    (204, "mem_copy_utilization", "i"),
    (206, "enc_utilization", "i"),
    (207, "dec_utilization", "i"),
    (230, "xid_errors", "i"),
    (240, "power_violation", "i"),
    (241, "thermal_violation", "i"),
    (242, "sync_boost_violation", "i"),
    (243, "board_limit_violation", "i"),
    (244, "low_util_violation", "i"),
    (245, "reliability_violation", "i"),
    (250, "fb_total", "i"),
    (251, "fb_free", "i"),
    (252, "fb_used", "i"),
    (253, "fb_resv", "i"),
    (310, "ecc_sbe_volatile_total", "i"),
    (311, "ecc_dbe_volatile_total", "i"),
    (312, "ecc_sbe_aggregate_total", "i"),
    (313, "ecc_dbe_aggregate_total", "i"),
    (390, "retired_pages_sbe", "i"),
    (391, "retired_pages_dbe", "i"),
    (392, "retired_pages_pending", "i"),
    (393, "uncorrectable_remapped_rows", "i"),
    (394, "correctable_remapped_rows", "i"),
    (395, "row_remap_failure", "i"),
    (396, "row_remap_pending", "i"),
    (409, "nvlink_flit_crc_error_count_total", "i"),
    (419, "nvlink_data_crc_error_count_total", "i"),
    (429, "nvlink_replay_error_count_total", "i"),
    (439, "nvlink_recovery_error_count_total", "i"),
    (449, "nvlink_throughput_total", "i"),
    (526, "vgpu_instance_license_status", "i"),
    (1001, "gr_engine_active", "d"),
    (1002, "sm_active", "d"),
    (1003, "sm_occupancy", "d"),
    (1004, "tensor_active", "d"),
    (1005, "dram_active", "d"),
    (1006, "fp64_active", "d"),
    (1007, "fp32_active", "d"),
    (1008, "fp16_active", "d"),
    (1009, "pcie_tx_bytes", "i"),
    (1010, "pcie_rx_bytes", "i"),
    (1011, "nvlink_tx_bytes", "i"),
    (1012, "nvlink_rx_bytes", "i"),
)
TAGS = {info.tag: fid for fid, info in FIELDS.items()}

# Profiling metric groups (majorId, minorId, field ids) as an Ampere/Hopper part reports
# them; the minor groups of one major id need separate passes (DCGM multiplexes them).
METRIC_GROUPS: tuple[tuple[int, int, tuple[int, ...]], ...] = (
    (0, 1, (1002, 1003, 1004, 1007)),
    (0, 2, (1006,)),
    (0, 3, (1008,)),
    (1, 0, (1005,)),
    (2, 0, (1009, 1010)),
    (3, 0, (1001,)),
    (4, 0, (1011, 1012)),
)
NVLINK_PROFILING_FIELDS = frozenset({1011, 1012})

# clock event reasons (scenario names) that count as time in each violation field
VIOLATIONS: dict[int, frozenset[str]] = {
    240: frozenset({"sw_power_cap", "hw_power_brake_slowdown"}),
    241: frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"}),
    242: frozenset({"sync_boost"}),
    243: frozenset(),
    244: frozenset({"gpu_idle"}),
    245: frozenset(),
}


def blank(field_type: str, offset: int = 0) -> Any:
    """DCGM's blank sentinel for a field type, plus NOT_FOUND/NOT_SUPPORTED/... offset."""
    if field_type == "d":
        return FP64_BLANK + offset
    if field_type == "s":
        return {0: STR_BLANK, 1: "<<<NOT_FOUND>>>", 2: "<<<NOT_SUPPORTED>>>"}.get(
            offset, "<<<NOT_PERM>>>"
        )
    return INT64_BLANK + offset


def profiling_defaults(values: dict[str, Any]) -> dict[str, float]:
    """Profiling ratios the scenario left unset, derived from NVML's utilization.

    gr_engine_active follows utilization_gpu, sm_active is 90 % of it and sm_occupancy
    half of that, dram_active follows utilization_memory; pipes stay at 0. Scenarios
    about kernels (a hung collective, a memory-bound job) set these values explicitly.
    """
    gr = float(values.get("utilization_gpu") or 0.0) / 100
    sm = 0.9 * gr
    return {
        "gr_engine_active": gr,
        "sm_active": sm,
        "sm_occupancy": 0.5 * sm,
        "tensor_active": 0.0,
        "dram_active": float(values.get("utilization_memory") or 0.0) / 100,
        "fp64_active": 0.0,
        "fp32_active": 0.0,
        "fp16_active": 0.0,
    }


PROFILING_VALUES = {
    1001: "gr_engine_active",
    1002: "sm_active",
    1003: "sm_occupancy",
    1004: "tensor_active",
    1005: "dram_active",
    1006: "fp64_active",
    1007: "fp32_active",
    1008: "fp16_active",
}

# -- the registry ------------------------------------------------------------------------

_REGISTRY: dict[str, SimHostengine] = {}
_REGISTRY_LOCK = threading.Lock()
_EMBEDDED: list[SimHostengine] = []
_LIBRARY: dict[str, bool] = {"missing": False}
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


def use_for_embedded(engine: SimHostengine | None) -> None:
    """dcgmStartEmbedded attaches to `engine` (None: embedded mode fails to start)."""
    with _REGISTRY_LOCK:
        _EMBEDDED.clear()
        if engine is not None:
            _EMBEDDED.append(engine)


@contextmanager
def library_missing() -> Iterator[None]:
    """While active, the fake bindings cannot load libdcgm (as with bindings but no DCGM)."""
    _LIBRARY["missing"] = True
    try:
        yield
    finally:
        _LIBRARY["missing"] = False


def load_library(lib_path: str | None = None) -> FakeDcgmLib | None:
    """What `CDLL("libdcgm.so.4")` gives the fake bindings; None: not found."""
    if _LIBRARY["missing"]:
        return None
    return FakeDcgmLib()


# -- the host engine ------------------------------------------------------------------


@dataclass
class _Group:
    name: str
    entities: list[tuple[int, int]]  # (entityGroupId, entityId)
    owner: int  # connection id; 0: the host engine's own


@dataclass
class _FieldGroup:
    name: str
    field_ids: list[int]
    owner: int


@dataclass
class _Watch:
    group: int
    field_group: int
    interval: float  # seconds
    since: float  # elapsed seconds when it was set up
    owner: int


@dataclass
class _State:
    """What one run of nv-hostengine holds; a restart starts a new one."""

    generation: int
    groups: dict[int, _Group] = field(default_factory=dict)
    field_groups: dict[int, _FieldGroup] = field(default_factory=dict)
    watches: dict[tuple[int, int, int], _Watch] = field(default_factory=dict)
    profiling_paused: bool = False
    next_group: int = 1
    next_field_group: int = 1
    watched: dict[tuple[int, int], _Watch] | None = None  # (gpu, field) -> watch, cached


class _HostengineDown(Exception):
    pass


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
        self.calls: Counter[str] = Counter()
        self.unsupported_profiling = "error"  # or "empty": no metric groups, no error
        self.profiling_held = False  # another profiler (Nsight) holds the counters
        self.connect_timeouts_ms: list[int] = []  # timeoutMs of each connect attempt
        self._overrides: dict[tuple[int | None, int], Any] = {}
        self._xids: list[tuple[float, int, int]] = []  # injected (elapsed, gpu, xid)
        self._forced: bool | None = None  # stop()/start() override of the timeline
        self._manual_restarts = 0
        self._lock = threading.RLock()
        self._up_changes = self._hostengine_changes()
        self._state = _State(self._generation(0.0))
        self._add_internal_field_groups()
        self._integrals = _Integrals(timeline)
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

    def follow_timeline(self) -> None:
        self._forced = None

    def hold_profiling(self, held: bool = True) -> None:
        """Another profiler takes (or gives back) the counters: blanks, and new watches fail."""
        self.profiling_held = held

    def set_value(self, field_id: int, value: Any, gpu: int | None = None) -> None:
        """Answer `value` (a number, a string or a blank sentinel) for a field."""
        self._overrides[(gpu, field_id)] = value

    def clear_values(self) -> None:
        self._overrides.clear()

    def inject_xid(self, gpu: int, xid: int) -> None:
        self._xids.append((self.now(), gpu, xid))

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
        starts = [s for s, _ in self._up_changes]
        i = bisect.bisect_right(starts, local) - 1
        return self._up_changes[max(i, 0)][1] if self._up_changes else True

    def up(self, t: float) -> bool:
        return self._forced if self._forced is not None else self._timeline_up(t)

    def _generation(self, t: float) -> int:
        """How many times the host engine has (re)started by time t."""
        changes = self._up_changes
        restarts_in = [
            start
            for (start, up), (_, before) in zip(changes[1:], changes, strict=False)
            if up and not before
        ]
        count = 0
        local = t
        if self.timeline.loop and self.timeline.duration > 0:
            cycles = int(t // self.timeline.duration)
            wrap = 1 if changes and changes[0][1] and not changes[-1][1] else 0
            count += cycles * (len(restarts_in) + wrap)
            local = t - cycles * self.timeline.duration
        count += sum(1 for start in restarts_in if start <= local)
        return count + self._manual_restarts

    def _current(self, t: float) -> _State:
        """The running host engine's state at t; raises _HostengineDown if it is not running."""
        if not self.up(t):
            raise _HostengineDown
        generation = self._generation(t)
        if generation != self._state.generation:
            self._state = _State(generation)
            self._add_internal_field_groups()
        return self._state

    def _add_internal_field_groups(self) -> None:
        for name in ("DCGM_INTERNAL_30SEC", "DCGM_INTERNAL_HOURLY", "DCGM_INTERNAL_JOB"):
            self._new_field_group(self._state, name, [150, 155, 203], owner=0)

    def _new_field_group(self, state: _State, name: str, ids: list[int], owner: int) -> int:
        fg_id = state.next_field_group
        state.next_field_group += 1
        state.field_groups[fg_id] = _FieldGroup(name, ids, owner)
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

    def check(self, generation: int) -> _State:
        """The state a connection of `generation` may use (raises _HostengineDown)."""
        state = self._current(self.now())
        if state.generation != generation:
            raise _HostengineDown
        return state

    def group_entities(self, state: _State, group_id: int) -> list[tuple[int, int]] | None:
        if group_id == GROUP_ALL_GPUS:
            return [(FE_GPU, i) for i in range(self.gpu_count)]
        group = state.groups.get(group_id)
        return None if group is None else group.entities

    def group_create(self, state: _State, kind: int, name: str, owner: int) -> int:
        if len(state.groups) >= MAX_NUM_GROUPS:
            raise _Status(ST_MAX_LIMIT)
        group_id = state.next_group
        state.next_group += 1
        entities = [(FE_GPU, i) for i in range(self.gpu_count)] if kind == GROUP_DEFAULT else []
        state.groups[group_id] = _Group(name, entities, owner)
        return group_id

    def field_group_create(self, state: _State, ids: list[int], name: str, owner: int) -> int:
        if any(fg.name == name for fg in state.field_groups.values()):
            raise _Status(ST_DUPLICATE_KEY)
        if not ids or len(ids) > MAX_FIELD_IDS_PER_FIELD_GROUP:
            raise _Status(ST_BADPARAM)
        if any(fid not in FIELDS for fid in ids):
            raise _Status(ST_UNKNOWN_FIELD)
        if len(state.field_groups) >= MAX_NUM_FIELD_GROUPS:
            raise _Status(ST_MAX_LIMIT)
        return self._new_field_group(state, name, list(ids), owner)

    def supported_profiling_fields(self, gpu: int) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        if not self.model.dcgm_profiling:
            return ()
        groups = METRIC_GROUPS
        if self.model.nvlinks == 0:
            groups = tuple(g for g in groups if not set(g[2]) & NVLINK_PROFILING_FIELDS)
        return groups

    def watch(self, state: _State, group_id: int, fg_id: int, interval: float, owner: int) -> None:
        entities = self.group_entities(state, group_id)
        fg = state.field_groups.get(fg_id)
        if entities is None or fg is None:
            raise _Status(ST_BADPARAM)
        profiling = [fid for fid in fg.field_ids if FIELDS[fid].profiling]
        if profiling:
            for kind, gpu in entities:
                if kind != FE_GPU:
                    continue
                groups = self.supported_profiling_fields(gpu)
                if not groups:
                    raise _Status(ST_PROFILING_NOT_SUPPORTED)
                supported = {fid for _, _, ids in groups for fid in ids}
                if not set(profiling) <= supported:
                    raise _Status(ST_NOT_SUPPORTED)
            if self.profiling_held:
                raise _Status(ST_IN_USE)
        key = (owner, group_id, fg_id)
        state.watches[key] = _Watch(group_id, fg_id, max(interval, 0.001), self.now(), owner)
        state.watched = None

    def unwatch(self, state: _State, group_id: int, fg_id: int, owner: int) -> None:
        state.watches.pop((owner, group_id, fg_id), None)
        state.watched = None

    def _watched(self) -> dict[tuple[int, int], _Watch]:
        state = self._state
        if state.watched is None:
            watched: dict[tuple[int, int], _Watch] = {}
            for watch in state.watches.values():
                entities = self.group_entities(state, watch.group) or []
                fg = state.field_groups.get(watch.field_group)
                if fg is None:
                    continue
                for kind, gpu in entities:
                    if kind != FE_GPU:
                        continue
                    for fid in fg.field_ids:
                        best = watched.get((gpu, fid))
                        if best is None or watch.interval < best.interval:
                            watched[(gpu, fid)] = watch
            state.watched = watched
        return state.watched

    def values(
        self, entities: Iterable[tuple[int, int]], field_ids: list[int], live: bool = False
    ) -> list[tuple[int, int, int, str, Any, int, int]]:
        """(entity group, entity, field, type, value, status, ts µs) per entity and field.

        Watched fields answer their latest sample (taken on the watch's interval);
        unwatched ones answer DCGM_ST_NOT_WATCHED, unless `live` (read now).
        """
        t = self.now()
        watched = self._watched()
        out = []
        for kind, gpu in entities:
            for fid in field_ids:
                info = FIELDS.get(fid)
                ft = info.type if info is not None else "i"
                if kind != FE_GPU or not 0 <= gpu < self.gpu_count or info is None:
                    out.append((kind, gpu, fid, ft, blank(ft, NOT_FOUND), ST_OK, 0))
                    continue
                watch = watched.get((gpu, fid))
                if watch is None and not live:
                    out.append((kind, gpu, fid, ft, blank(ft), ST_NOT_WATCHED, 0))
                    continue
                at = t if watch is None else _sample_time(t, watch)
                value, status = self._value(gpu, info, at)
                ts = round((self.clock.start_wall + at) * 1e6)
                out.append((kind, gpu, fid, ft, value, status, ts))
        return out

    # -- values -----------------------------------------------------------------------------

    def _value(self, gpu: int, info: FieldInfo, t: float) -> tuple[Any, int]:
        if self._overrides:
            override = self._overrides.get((gpu, info.id), self._overrides.get((None, info.id)))
            if override is not None:
                return override, ST_OK
        values = self.timeline.state(t)[0][gpu]
        if values.get("lost"):
            return blank(info.type), ST_GPU_IS_LOST
        if info.profiling:
            if self._state.profiling_paused or self.profiling_held:
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
                value = v.get(key)
                return profiling_defaults(v)[key] if value is None else value

            return get

        def rate(key: str, scale: float) -> Callable[[int, dict[str, Any], float], Any]:
            return lambda gpu, v, t: (v.get(key) or 0.0) * scale

        def violation(fid: int) -> Callable[[int, dict[str, Any], float], Any]:
            return lambda gpu, v, t: integrals.violation_s(gpu, fid, t) * 1e9  # ns

        ecc = "nvmlDeviceGetTotalEccErrors" not in model.unsupported
        datacenter = model.datacenter
        nvlinks = model.nvlinks > 0
        getters: dict[int, Callable[[int, dict[str, Any], float], Any]] = {
            1: lambda gpu, v, t: node.driver_version,
            2: lambda gpu, v, t: f"{node.cuda_driver_version // 1000}.{node.driver_version}",
            4: lambda gpu, v, t: self.gpu_count,
            50: lambda gpu, v, t: model.name,
            54: lambda gpu, v, t: self.uuids[gpu],
            57: lambda gpu, v, t: self.bus_ids[gpu],
            100: lambda gpu, v, t: v["sm_clock_mhz"],
            101: lambda gpu, v, t: v["mem_clock_mhz"],
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
            1009: rate("pcie_tx_mb_s", 1e6),  # bytes per second
            1010: rate("pcie_rx_mb_s", 1e6),
            1011: rate("nvlink_tx_mb_s", 1e6),
            1012: rate("nvlink_rx_mb_s", 1e6),
        }
        for fid, key in PROFILING_VALUES.items():
            getters[fid] = profiling(key)
        for fid in VIOLATIONS:
            getters[fid] = violation(fid)
        for fid in range(390, 397):  # retired pages and row remapping: Ampere-class and newer
            getters[fid] = lambda gpu, v, t: 0 if datacenter else None
        for fid in (409, 419, 429, 439):
            getters[fid] = lambda gpu, v, t: 0 if nvlinks else None
        return getters  # 526 (vGPU licence) and anything else: not supported here

    def _last_xid(self, gpu: int, t: float) -> int:
        timeline = self.timeline
        period = timeline.duration if timeline.loop and timeline.duration > 0 else None
        since = max(-1.0, t - period) if period else -1.0
        last: tuple[float, int] = (-math.inf, 0)
        for event in timeline.xid_events(since, t):
            if event.gpu == gpu and event.time >= last[0]:
                last = (event.time, event.xid)
        for at, g, xid in self._xids:
            if g == gpu and at <= t and at >= last[0]:
                last = (at, xid)
        return last[1]

    # -- profiling pause ----------------------------------------------------------------------

    def gpm(self) -> bool:
        return self.model.pci_device_id in GPM_PCI_DEVICE_IDS


def _sample_time(t: float, watch: _Watch) -> float:
    """The latest sample of a watch at t: on the watch's interval grid, not before the watch."""
    return max(watch.since, math.floor(t / watch.interval + 1e-9) * watch.interval)


class _Integrals:
    """Energy, violation time and NVLink traffic integrated exactly over the timeline.

    Within a phase every value is constant or a linear ramp, so a phase's integral is
    its length times the value at its midpoint; the current phase adds the part up to t.
    """

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.gpus = timeline.scenario.node.gpu_count
        self._rates_cache: tuple[float, list[tuple[float, ...]]] | None = None
        phases = timeline.phases()
        self._starts = [start for start, _ in phases]
        self._durations = [phase.duration for _, phase in phases]
        self._cumulative: list[list[tuple[float, ...]]] = []  # per phase start, per GPU
        totals = [self._zero() for _ in range(self.gpus)]
        for start, duration in zip(self._starts, self._durations, strict=True):
            self._cumulative.append([tuple(x) for x in totals])
            rates = self._rates(start + duration / 2)
            totals = [
                [a + r * duration for a, r in zip(acc, rate, strict=True)]
                for acc, rate in zip(totals, rates, strict=True)
            ]
        self._cycle = [tuple(x) for x in totals]

    @staticmethod
    def _zero() -> list[float]:
        return [0.0] * (2 + len(VIOLATIONS))

    def _rates(self, t: float) -> list[tuple[float, ...]]:
        cached = self._rates_cache
        if cached is not None and cached[0] == t:
            return cached[1]
        out = []
        for v in self.timeline.state(t)[0]:
            reasons = set(v.get("clock_event_reasons") or ())
            nvlink = (v.get("nvlink_tx_mb_s") or 0.0) + (v.get("nvlink_rx_mb_s") or 0.0)
            out.append(
                (
                    float(v["power_w"]),
                    nvlink * 1e6,
                    *(1.0 if reasons & why else 0.0 for why in VIOLATIONS.values()),
                )
            )
        self._rates_cache = (t, out)
        return out

    def _total(self, gpu: int, index: int, t: float) -> float:
        timeline = self.timeline
        duration = timeline.duration
        cycles, local = 0, t
        if timeline.loop and duration > 0:
            cycles = int(t // duration)
            local = t - cycles * duration
        total = cycles * self._cycle[gpu][index]
        if not self._starts:
            return total
        if not timeline.loop and local >= duration:  # after the end, values stay frozen
            rate = self._rates(duration)[gpu][index]
            return total + self._cycle[gpu][index] + rate * (local - duration)
        p = max(0, bisect.bisect_right(self._starts, local) - 1)
        start = self._starts[p]
        elapsed = local - start
        rate = self._rates(start + elapsed / 2)[gpu][index] if elapsed > 0 else 0.0
        return total + self._cumulative[p][gpu][index] + rate * elapsed

    def energy_j(self, gpu: int, t: float) -> float:
        return self._total(gpu, 0, t)

    def nvlink_bytes(self, gpu: int, t: float) -> float:
        return self._total(gpu, 1, t)

    def violation_s(self, gpu: int, field_id: int, t: float) -> float:
        return self._total(gpu, 2 + list(VIOLATIONS).index(field_id), t)


# -- the client library ---------------------------------------------------------------------


class _Status(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class _Connection:
    engine: SimHostengine
    generation: int
    persist: bool
    embedded: bool


def _int(arg: Any) -> int:
    """An integer argument as C sees it (ctypes scalar, c_void_p, or Python int)."""
    value = getattr(arg, "value", arg)
    return int(value or 0)


def _text(arg: Any) -> str:
    value = getattr(arg, "value", arg)
    if isinstance(value, bytes):
        return value.decode()
    return str(value or "")


class FakeDcgmLib:
    """libdcgm.so's symbols as Python callables with the C signatures (a DCGM client)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._initialized = 0
        self._connections: dict[int, _Connection] = {}
        self._next_handle = 0x5000
        self._keep: list[Any] = []  # field metadata handed out by pointer
        self._version = VERSIONS["4"]
        self._symbols = install_symbols(self)

    def symbols(self) -> list[str]:
        return sorted(self._symbols)

    def _invoke(self, name: str, impl: Callable[..., Any], kind: str, args: tuple[Any, ...]) -> Any:
        self.calls[name] += 1
        if kind == "noinit":
            return impl(*args)
        if not self._initialized:
            return ST_UNINITIALIZED
        if kind == "lib":
            return impl(*args)
        conn = self._connections.get(_int(args[0]))
        if conn is None:
            return ST_BADPARAM
        conn.engine.calls[name] += 1
        with conn.engine._lock:
            try:
                state = (
                    conn.engine.check(conn.generation)
                    if not conn.embedded
                    else (conn.engine._state)
                )
                return impl(conn, state, *args[1:])
            except _HostengineDown:
                return ST_CONNECTION_NOT_VALID
            except _Status as e:
                return e.code

    # -- init and connections ------------------------------------------------------------

    @symbol("noinit")
    def _dcgmInit(self, handle: Any = None) -> int:
        self._initialized += 1
        return ST_OK

    @symbol("lib")
    def _dcgmShutdown(self) -> int:
        self._initialized = max(0, self._initialized - 1)
        return ST_OK

    def _new_handle(self, out: Any, conn: _Connection) -> int:
        self._next_handle += 1
        self._connections[self._next_handle] = conn
        out._obj.value = self._next_handle
        self._version = conn.engine.version
        return ST_OK

    def _connect(self, address: str, params: Any, out: Any) -> int:
        engine = lookup(address)
        timeout = int(getattr(params._obj, "timeoutMs", 0) or 0) if params is not None else 0
        persist = bool(getattr(params._obj, "persistAfterDisconnect", 0)) if params else False
        if engine is None:
            return ST_CONNECTION_NOT_VALID
        engine.calls["dcgmConnect"] += 1
        engine.connect_timeouts_ms.append(timeout)
        try:
            generation = engine.connect(self._next_handle + 1)
        except _HostengineDown:
            return ST_CONNECTION_NOT_VALID
        return self._new_handle(out, _Connection(engine, generation, persist, embedded=False))

    @symbol("lib")
    def _dcgmConnect(self, address: Any, out: Any) -> int:
        return self._connect(_text(address), None, out)

    @symbol("lib")
    def _dcgmConnect_v2(self, address: Any, params: Any, out: Any) -> int:
        text = _text(address)
        if getattr(params._obj, "addressIsUnixSocket", 0):
            text = "unix://" + text
        return self._connect(text, params, out)

    @symbol("lib")
    def _dcgmConnect_v3(self, address: Any, params: Any, out: Any) -> int:
        return self._connect(_text(address), params, out)

    @symbol("lib")
    def _dcgmStartEmbedded(self, op_mode: Any, out: Any) -> int:
        with _REGISTRY_LOCK:
            engine = _EMBEDDED[0] if _EMBEDDED else None
        if engine is None:
            return ST_INIT_ERROR
        generation = engine._state.generation
        return self._new_handle(out, _Connection(engine, generation, False, embedded=True))

    @symbol("lib")
    def _dcgmStopEmbedded(self, handle: Any) -> int:
        return self._dcgmDisconnect(handle)

    @symbol("lib")
    def _dcgmDisconnect(self, handle: Any) -> int:
        conn = self._connections.pop(_int(handle), None)
        if conn is None:
            return ST_BADPARAM
        conn.engine.disconnect(_int(handle), conn.generation, conn.persist)
        return ST_OK

    @symbol("noinit")
    def _dcgmErrorString(self, result: Any) -> bytes:
        return f"DCGM error {_int(result)}".encode()

    @symbol("noinit")
    def _dcgmVersionInfo(self, out: Any) -> int:
        out._obj.rawBuildInfoString = (
            f"version:{self._version};arch:x86_64;buildtype:Release;buildid:sim;"
            f"commit:sim;branch:rel_dcgm_{self._version.split('.')[0]};buildplatform:Linux;"
        ).encode()
        return ST_OK

    @symbol("handle")
    def _dcgmHostengineIsHealthy(self, conn: _Connection, state: _State, out: Any) -> int:
        out._obj.overallHealth = 0
        return ST_OK

    # -- field metadata (DcgmFieldGetById and friends live in libdcgm too) ---------------------

    @symbol("noinit")
    def _DcgmFieldsInit(self) -> int:
        return ST_OK

    def _meta(self, restype: Any, info: FieldInfo | None) -> Any:
        if info is None:
            return None
        struct_type = getattr(restype, "_type_", None)
        if struct_type is None:
            return None
        meta = struct_type()
        meta.fieldId = info.id
        meta.fieldType = info.type.encode()
        meta.size = 8 if info.type != "s" else 0
        meta.tag = info.tag.encode()
        meta.scope = 1
        meta.entityLevel = FE_GPU
        self._keep.append(meta)
        return ctypes.pointer(meta)

    def _DcgmFieldGetById(self, field_id: Any) -> Any:  # wrapped below (needs restype)
        return self._meta(self._symbols["DcgmFieldGetById"].restype, FIELDS.get(_int(field_id)))

    def _DcgmFieldGetByTag(self, tag: Any) -> Any:
        fid = TAGS.get(_text(tag))
        return self._meta(self._symbols["DcgmFieldGetByTag"].restype, FIELDS.get(fid or -1))

    symbol("noinit")(_DcgmFieldGetById)
    symbol("noinit")(_DcgmFieldGetByTag)

    # -- discovery ----------------------------------------------------------------------------

    def _device_list(self, conn: _Connection, ids: Any, count: Any) -> int:
        for i in range(conn.engine.gpu_count):
            ids[i] = i
        count._obj.value = conn.engine.gpu_count
        return ST_OK

    @symbol("handle")
    def _dcgmGetAllDevices(self, conn: _Connection, state: _State, ids: Any, count: Any) -> int:
        return self._device_list(conn, ids, count)

    @symbol("handle")
    def _dcgmGetAllSupportedDevices(
        self, conn: _Connection, state: _State, ids: Any, count: Any
    ) -> int:
        return self._device_list(conn, ids, count)

    @symbol("handle")
    def _dcgmGetDeviceAttributes(
        self, conn: _Connection, state: _State, gpu_id: Any, out: Any
    ) -> int:
        engine, gpu = conn.engine, _int(gpu_id)
        if not 0 <= gpu < engine.gpu_count:
            return ST_BADPARAM
        attrs = out._obj
        model = engine.model
        ident = attrs.identifiers
        ident.brandName = b"NVIDIA" if model.datacenter else b"GeForce"
        ident.deviceName = model.name.encode()
        ident.pciBusId = engine.bus_ids[gpu].encode()
        ident.serial = f"{1560000000000 + gpu}".encode()
        ident.uuid = engine.uuids[gpu].encode()
        ident.vbios = b"92.00.45.00.03"
        ident.pciDeviceId = (model.pci_device_id << 16) | 0x10DE
        ident.pciSubSystemId = (model.pci_device_id << 16) | 0x10DE
        ident.driverVersion = engine.node.driver_version.encode()
        attrs.powerLimits.enforcedPowerLimit = round(model.power_limit_w)
        attrs.powerLimits.defaultPowerLimit = round(model.power_limit_w)
        attrs.memoryUsage.fbTotal = model.memory_total_mib
        attrs.settings.persistenceModeEnabled = 1
        return ST_OK

    # -- groups ---------------------------------------------------------------------------------

    @symbol("handle")
    def _dcgmGroupCreate(
        self, conn: _Connection, state: _State, kind: Any, name: Any, out: Any
    ) -> int:
        owner = self._owner(conn)
        out._obj.value = conn.engine.group_create(state, _int(kind), _text(name), owner)
        return ST_OK

    def _owner(self, conn: _Connection) -> int:
        return next(h for h, c in self._connections.items() if c is conn)

    def _group(self, state: _State, group_id: Any) -> _Group:
        group = state.groups.get(_int(group_id))
        if group is None:
            raise _Status(ST_NOT_CONFIGURED)
        return group

    @symbol("handle")
    def _dcgmGroupDestroy(self, conn: _Connection, state: _State, group_id: Any) -> int:
        self._group(state, group_id)
        del state.groups[_int(group_id)]
        state.watches = {k: w for k, w in state.watches.items() if w.group != _int(group_id)}
        state.watched = None
        return ST_OK

    @symbol("handle")
    def _dcgmGroupAddDevice(self, conn: _Connection, state: _State, group_id: Any, gpu: Any) -> int:
        return self._add_entity(conn, state, group_id, FE_GPU, _int(gpu))

    @symbol("handle")
    def _dcgmGroupAddEntity(
        self, conn: _Connection, state: _State, group_id: Any, kind: Any, entity: Any
    ) -> int:
        return self._add_entity(conn, state, group_id, _int(kind), _int(entity))

    def _add_entity(
        self, conn: _Connection, state: _State, group_id: Any, kind: int, entity: int
    ) -> int:
        group = self._group(state, group_id)
        if kind != FE_GPU or not 0 <= entity < conn.engine.gpu_count:
            return ST_BADPARAM
        if (kind, entity) in group.entities:
            return ST_DUPLICATE_KEY
        group.entities.append((kind, entity))
        state.watched = None
        return ST_OK

    @symbol("handle")
    def _dcgmGroupGetInfo(self, conn: _Connection, state: _State, group_id: Any, out: Any) -> int:
        entities = conn.engine.group_entities(state, _int(group_id))
        if entities is None:
            return ST_NOT_CONFIGURED
        info = out._obj
        group = state.groups.get(_int(group_id))
        info.groupName = (group.name if group else "DCGM_ALL_SUPPORTED_GPUS").encode()
        info.count = len(entities)
        for i, (kind, entity) in enumerate(entities):
            info.entityList[i].entityGroupId = kind
            info.entityList[i].entityId = entity
        return ST_OK

    @symbol("handle")
    def _dcgmGroupGetAllIds(self, conn: _Connection, state: _State, ids: Any, count: Any) -> int:
        for i, group_id in enumerate(state.groups):
            ids[i] = group_id
        count._obj.value = len(state.groups)
        return ST_OK

    # -- field groups --------------------------------------------------------------------------

    @symbol("handle")
    def _dcgmFieldGroupCreate(
        self, conn: _Connection, state: _State, count: Any, ids: Any, name: Any, out: Any
    ) -> int:
        array = getattr(ids, "_obj", ids)
        field_ids = [int(array[i]) for i in range(_int(count))]
        owner = self._owner(conn)
        out._obj.value = conn.engine.field_group_create(state, field_ids, _text(name), owner)
        return ST_OK

    @symbol("handle")
    def _dcgmFieldGroupDestroy(self, conn: _Connection, state: _State, fg_id: Any) -> int:
        if state.field_groups.pop(_int(fg_id), None) is None:
            return ST_NO_DATA
        state.watches = {k: w for k, w in state.watches.items() if w.field_group != _int(fg_id)}
        state.watched = None
        return ST_OK

    def _fill_field_group(self, info: Any, fg_id: int, fg: _FieldGroup) -> None:
        info.fieldGroupId = fg_id
        info.fieldGroupName = fg.name.encode()
        info.numFieldIds = len(fg.field_ids)
        for i, fid in enumerate(fg.field_ids):
            info.fieldIds[i] = fid

    @symbol("handle")
    def _dcgmFieldGroupGetInfo(self, conn: _Connection, state: _State, out: Any) -> int:
        info = out._obj
        fg = state.field_groups.get(_int(info.fieldGroupId))
        if fg is None:
            return ST_NO_DATA
        self._fill_field_group(info, _int(info.fieldGroupId), fg)
        return ST_OK

    @symbol("handle")
    def _dcgmFieldGroupGetAll(self, conn: _Connection, state: _State, out: Any) -> int:
        info = out._obj
        info.numFieldGroups = len(state.field_groups)
        for i, (fg_id, fg) in enumerate(state.field_groups.items()):
            self._fill_field_group(info.fieldGroups[i], fg_id, fg)
        return ST_OK

    # -- watches and values ----------------------------------------------------------------------

    @symbol("handle")
    def _dcgmWatchFields(
        self,
        conn: _Connection,
        state: _State,
        group_id: Any,
        fg_id: Any,
        update_freq: Any,
        max_keep_age: Any,
        max_keep_samples: Any,
    ) -> int:
        interval = _int(update_freq) / 1e6
        conn.engine.watch(state, _int(group_id), _int(fg_id), interval, self._owner(conn))
        return ST_OK

    @symbol("handle")
    def _dcgmUnwatchFields(
        self, conn: _Connection, state: _State, group_id: Any, fg_id: Any
    ) -> int:
        conn.engine.unwatch(state, _int(group_id), _int(fg_id), self._owner(conn))
        return ST_OK

    @symbol("handle")
    def _dcgmUpdateAllFields(self, conn: _Connection, state: _State, wait: Any) -> int:
        return ST_OK  # samples exist from the moment a watch is set

    def _latest(
        self, conn: _Connection, state: _State, group_id: Any, fg_id: Any
    ) -> list[tuple[int, int, int, str, Any, int, int]]:
        entities = conn.engine.group_entities(state, _int(group_id))
        fg = state.field_groups.get(_int(fg_id))
        if entities is None or fg is None:
            raise _Status(ST_BADPARAM)
        return conn.engine.values(entities, fg.field_ids)

    @staticmethod
    def _fill_value(fv: Any, row: tuple[int, int, int, str, Any, int, int]) -> None:
        """Write one value into the caller's struct, as C does: no Python-level setters."""
        _, _, fid, ft, value, status, ts = row
        put = ctypes.Structure.__setattr__
        put(fv, "fieldId", fid)
        put(fv, "fieldType", ord(ft))
        put(fv, "status", status)
        put(fv, "ts", ts)
        union = ctypes.Structure.__getattribute__(fv, "value")
        if ft == "d":
            ctypes.Union.__setattr__(union, "dbl", float(value))
        elif ft == "s":
            ctypes.Union.__setattr__(union, "str", str(value).encode()[: MAX_STR_LENGTH - 1])
        else:
            ctypes.Union.__setattr__(union, "i64", int(value))

    def _enumerate(self, callback: Any, user_data: Any, rows: list[Any], per_entity: bool) -> int:
        """Call the enumeration callback once per entity, as libdcgm does."""
        struct_type = callback.argtypes[2 if per_entity else 1]._type_
        version = ctypes.sizeof(struct_type) | (1 << 24)  # dcgmFieldValue_version1
        address = id(getattr(user_data, "value", user_data))
        by_entity: dict[tuple[int, int], list[Any]] = {}
        for row in rows:
            by_entity.setdefault((row[0], row[1]), []).append(row)
        for (kind, entity), entity_rows in by_entity.items():
            array = (struct_type * len(entity_rows))()
            for fv, row in zip(array, entity_rows, strict=True):
                ctypes.Structure.__setattr__(fv, "version", version)
                self._fill_value(fv, row)
            if per_entity:
                callback(kind, entity, array, len(entity_rows), address)
            else:
                callback(entity, array, len(entity_rows), address)
        return ST_OK

    @symbol("handle")
    def _dcgmGetLatestValues(
        self, conn: _Connection, state: _State, group_id: Any, fg_id: Any, cb: Any, data: Any
    ) -> int:
        return self._enumerate(cb, data, self._latest(conn, state, group_id, fg_id), False)

    @symbol("handle")
    def _dcgmGetLatestValues_v2(
        self, conn: _Connection, state: _State, group_id: Any, fg_id: Any, cb: Any, data: Any
    ) -> int:
        return self._enumerate(cb, data, self._latest(conn, state, group_id, fg_id), True)

    @symbol("handle")
    def _dcgmGetValuesSince_v2(
        self,
        conn: _Connection,
        state: _State,
        group_id: Any,
        fg_id: Any,
        since: Any,
        next_since: Any,
        cb: Any,
        data: Any,
    ) -> int:
        rows = [r for r in self._latest(conn, state, group_id, fg_id) if r[6] > _int(since)]
        next_since._obj.value = max([r[6] for r in rows], default=_int(since)) + 1
        return self._enumerate(cb, data, rows, True)

    @symbol("handle")
    def _dcgmEntityGetLatestValues(
        self,
        conn: _Connection,
        state: _State,
        kind: Any,
        entity: Any,
        ids: Any,
        count: Any,
        out: Any,
    ) -> int:
        field_ids = [int(ids[i]) for i in range(_int(count))]
        rows = conn.engine.values([(_int(kind), _int(entity))], field_ids)
        for i, row in enumerate(rows):
            self._fill_value(out[i], row)
        return ST_OK

    @symbol("handle")
    def _dcgmEntitiesGetLatestValues(
        self,
        conn: _Connection,
        state: _State,
        entities: Any,
        entity_count: Any,
        ids: Any,
        id_count: Any,
        flags: Any,
        out: Any,
    ) -> int:
        pairs = [
            (int(entities[i].entityGroupId), int(entities[i].entityId))
            for i in range(_int(entity_count))
        ]
        field_ids = [int(ids[i]) for i in range(_int(id_count))]
        rows = conn.engine.values(pairs, field_ids, live=bool(_int(flags) & 1))
        for i, row in enumerate(rows):
            fv = out[i]
            fv.entityGroupId, fv.entityId = row[0], row[1]
            self._fill_value(fv, row)
        return ST_OK

    # -- profiling ------------------------------------------------------------------------------

    @symbol("handle")
    def _dcgmProfGetSupportedMetricGroups(self, conn: _Connection, state: _State, out: Any) -> int:
        engine, msg = conn.engine, out._obj
        gpu = int(msg.gpuId)
        if not 0 <= gpu < engine.gpu_count:
            return ST_BADPARAM
        groups = engine.supported_profiling_fields(gpu)
        if not groups and engine.unsupported_profiling == "error":
            return ST_PROFILING_NOT_SUPPORTED
        msg.numMetricGroups = len(groups)
        for i, (major, minor, ids) in enumerate(groups):
            group = msg.metricGroups[i]
            group.majorId, group.minorId, group.numFieldIds = major, minor, len(ids)
            for j, fid in enumerate(ids):
                group.fieldIds[j] = fid
        return ST_OK

    @symbol("handle")
    def _dcgmProfPause(self, conn: _Connection, state: _State) -> int:
        if conn.engine.gpm():
            return ST_NOT_SUPPORTED
        state.profiling_paused = True
        return ST_OK

    @symbol("handle")
    def _dcgmProfResume(self, conn: _Connection, state: _State) -> int:
        if conn.engine.gpm():
            return ST_NOT_SUPPORTED
        state.profiling_paused = False
        return ST_OK


class SimDcgm:
    """DCGM as installed on one simulated node: bindings under its root, and a host engine.

    `node.dcgm` "4" or "3" puts the fake bindings where that DCGM version installs them
    (a symlink under `root`) and starts a host engine; "none" installs nothing.
    """

    def __init__(self, timeline: Timeline, clock: SimClock, root: Path) -> None:
        version = timeline.scenario.node.dcgm
        self.root = root
        self.hostname = timeline.scenario.node.hostname
        self.hostengine: SimHostengine | None = None
        if version != "none":
            self.hostengine = SimHostengine(timeline, clock, version)
            bindings = root / BINDINGS_DIRS[version]
            bindings.parent.mkdir(parents=True, exist_ok=True)
            if not bindings.exists():
                bindings.symlink_to(FAKE_BINDINGS, target_is_directory=True)

    def context_extras(self) -> dict[str, Any]:
        """What the DCGM source needs to find this node's DCGM (see sources/dcgm.py)."""
        address = self.hostengine.address if self.hostengine else "sim://not-installed"
        return {"rootfs": self.root, "dcgm_hostengine": address, "hostname": self.hostname}

    def close(self) -> None:
        if self.hostengine is not None:
            self.hostengine.close()


__all__ = [
    "BINDINGS_DIRS",
    "FAKE_BINDINGS",
    "FIELDS",
    "FakeDcgmLib",
    "SimDcgm",
    "SimHostengine",
    "blank",
    "library_missing",
    "load_library",
    "lookup",
    "profiling_defaults",
    "register",
    "unregister",
    "use_for_embedded",
]
