"""One connection to nv-hostengine: our GPU and field groups, their watches, reading them.

Groups and field groups are named `gpuwatchd_<pid>...` so that a dcgm-exporter (or a
second gpuwatchd) can share the host engine. The device fields are watched in field
groups of at most 127 (DCGM's limit), the first also holding DCGM_FI_DEV_NVML_INDEX;
profiling fields get field groups of their own (DCGM drops the whole watch when the
profiling module refuses), watched only on GPUs whose supported metric groups have them.

Each watch is read in one dcgmEntitiesGetLatestValues call (latest.py).

The `gpu` label is the GPU's NVML index, as the NVML source's: DCGM keeps a GPU's id
across re-detection (by UUID) while NVML renumbers, so the two can differ. The index is
read live when connecting and followed on every poll. dcgm-exporter's labels keep DCGM's
id, as dcgm-exporter does.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpuwatchd.config import DcgmConfig
from gpuwatchd.metrics import Sample
from gpuwatchd.sources.dcgm.bindings import Bindings
from gpuwatchd.sources.dcgm.fields import (
    FE_GPU,
    FIELD_MAPS,
    GENERIC,
    NVML_INDEX,
    PROFILING_STATE,
    PROFILING_STATES,
    FieldPlan,
    instance_level,
)
from gpuwatchd.sources.dcgm.latest import Columns, LatestValues, Plan, Value
from gpuwatchd.sources.dcgm.mig import MigInstances
from gpuwatchd.sources.dcgm.model import Gpu, Owner, Row, Watch
from gpuwatchd.sources.dcgm.xid import UNKNOWN_XID, XID_MESSAGES

log = logging.getLogger(__package__)

_UNSUPPORTED_PROFILING = (
    "DCGM_ST_PROFILING_NOT_SUPPORTED",
    "DCGM_ST_NOT_SUPPORTED",
    "DCGM_ST_MODULE_NOT_LOADED",
    "DCGM_ST_REQUIRES_ROOT",
    "DCGM_ST_GROUP_IS_EMPTY",
)
_XID = FIELD_MAPS[230].compat  # dcgm-exporter's Xid family carries the code and its text


class Session:
    """Our groups and watches on one connection (a pydcgm.DcgmHandle), and reading them."""

    def __init__(
        self,
        bindings: Bindings,
        handle: Any,
        config: DcgmConfig,
        hostname: str,
        prefix: str,
        latest: LatestValues | None = None,
    ) -> None:
        self.bindings = bindings
        self.handle = handle
        self.system = handle.GetSystem()
        self.config = config
        self.hostname = hostname
        self.prefix = prefix  # of our group names: gpuwatchd_<pid>
        self.plan = FieldPlan.of(())
        self.version = ""
        self.gpus: dict[int, Gpu] = {}  # by DCGM id
        self.watches: list[Watch] = []
        self.profiling_paused = False
        self.pause_unsupported = False
        self.profiling_retry_at: float | None = None
        self._changes: dict[tuple[str, str, str], list[Gpu]] = {}  # profiling states to log
        self._not_numbers: set[int] = set()  # fields that gave something else, logged
        self.latest = latest or LatestValues(bindings)  # reads each watch in one call
        self.mig = MigInstances(self)
        self._instance_fields: dict[frozenset[int], frozenset[int]] = {}

    # -- setting up -----------------------------------------------------------------------

    def setup(self, plan: FieldPlan, now: float) -> None:
        self.plan = plan
        with contextlib.suppress(self.bindings.structs.DCGMError):
            self.version = _version(self.bindings.agent.dcgmVersionInfo().rawBuildInfoString)
        self._discover()
        if self.gpus:
            self._watch_device()
            self._watch_profiling(now, list(self.gpus.values()))
            self.mig.refresh()
            self.system.UpdateAllFields(1)
        for gpu in self.gpus.values():
            self.prepare(gpu)

    def _discover(self) -> None:
        ids = [int(i) for i in self.system.discovery.GetAllSupportedGpuIds()]
        indices = self._nvml_indices(ids)
        for gpu_id in ids:
            attrs = self.system.discovery.GetGpuAttributes(gpu_id).identifiers
            uuid, model = str(attrs.uuid), str(attrs.deviceName)
            bus, driver = str(attrs.pciBusId), str(attrs.driverVersion)
            # dcgm-exporter's labels; GPU_I_PROFILE and GPU_I_ID empty: a whole GPU
            compat = (str(gpu_id), uuid, bus, f"nvidia{gpu_id}", model, "", "", self.hostname,
                      driver)  # fmt: skip
            self.gpus[gpu_id] = Gpu(gpu_id, uuid, model, compat, indices.get(gpu_id))
        moved = [f"DCGM {g.id} = NVML {g.index}" for g in self.gpus.values() if g.label != g.id]
        if moved:
            log.info("dcgm: GPU ids are not NVML's (%s); labelled by NVML's", ", ".join(moved))

    def _nvml_indices(self, ids: list[int]) -> dict[int, int]:
        """DCGM GPU id -> NVML index, read live (DCGM_FI_DEV_NVML_INDEX)."""
        if not ids:
            return {}
        structs, agent = self.bindings.structs, self.bindings.agent
        pairs = [structs.c_dcgmGroupEntityPair_t(FE_GPU, i) for i in ids]
        try:
            values = agent.dcgmEntitiesGetLatestValues(
                self.handle.handle, pairs, [NVML_INDEX], structs.DCGM_FV_FLAG_LIVE_DATA
            )
        except structs.DCGMError as e:  # then DCGM's ids stand in until a watch says
            log.info("dcgm: reading the GPUs' NVML indices failed: %s", self.bindings.describe(e))
            return {}
        blank = self.bindings.value.DCGM_INT64_IS_BLANK
        return {
            int(v.entityId): int(v.value.i64)
            for v in values
            if v.status == structs.DCGM_ST_OK and not blank(v.value.i64)
        }

    def _field_group(self, name: str, ids: list[int]) -> Any:
        """A field group called `name`, replacing a stale one of ours with that name.

        Field group names are unique in a host engine; one of ours can outlive us (a
        persisting connection, a crash). pydcgm only deletes groups the same object
        created, so the stale one is destroyed through the C API.
        """
        stale = self.system.GetFieldGroupIdByName(name)
        if stale is not None:
            self.bindings.agent.dcgmFieldGroupDestroy(self.handle.handle, stale)
        return self.bindings.pydcgm.DcgmFieldGroup(self.handle, name, ids)

    def _watch(
        self, name: str, gpus: list[int], ids: list[int], profiling: bool, indices: bool = False
    ) -> None:
        group = self.system.GetGroupWithGpuIds(name, gpus)
        field_group = None
        try:
            field_group = self._field_group(name, ids)
            interval = self.config.interval
            group.samples.WatchFields(field_group, int(interval * 1e6), max(30.0, 3 * interval), 2)
        except Exception:  # a DCGMError, or bindings of another version: nothing left behind
            if field_group is not None:  # else pydcgm keeps it (and a retry makes another)
                self.bindings.delete(field_group)
            self._quietly(group.Delete)
            raise
        self.watches.append(Watch(group, field_group, gpus, list(ids), profiling, indices))

    def watch_entities(
        self, name: str, kind: int, entities: list[int], ids: list[int], profiling: bool = True
    ) -> Watch:
        """Watch `ids` on entities of another entity group (MIG GPU instances)."""
        group = self.system.GetEmptyGroup(name)
        field_group = None
        try:
            for entity in entities:
                group.AddEntity(kind, entity)
            field_group = self._field_group(name, ids)
            interval = self.config.interval
            group.samples.WatchFields(field_group, int(interval * 1e6), max(30.0, 3 * interval), 2)
        except Exception:
            if field_group is not None:
                self.bindings.delete(field_group)
            self._quietly(group.Delete)
            raise
        watch = Watch(group, field_group, list(entities), list(ids), profiling, entity_group=kind)
        self.watches.append(watch)
        return watch

    def drop(self, watch: Watch) -> None:
        """Unwatch and remove one watch of ours (its group and field group)."""
        if watch in self.watches:
            self.watches.remove(watch)
        self._quietly(watch.group.samples.UnwatchFields, watch.field_group)
        self.bindings.delete(watch.field_group)
        self._quietly(watch.group.Delete)

    def instance_fields(self, ids: frozenset[int]) -> frozenset[int]:
        """Those of `ids` a MIG GPU instance answers itself (DCGM's field metadata)."""
        known = self._instance_fields.get(ids)
        if known is None:
            known = self._instance_fields[ids] = instance_level(self.bindings.fields, ids)
        return known

    def _watch_device(self) -> None:
        gpus = sorted(self.gpus)
        for n, ids in enumerate(self.plan.device_groups()):
            self._watch(f"{self.prefix}{f'_{n + 1}' if n else ''}", gpus, ids, False, n == 0)

    def _watch_profiling(self, now: float, gpus: list[Gpu]) -> None:
        """Watch the profiling fields each GPU supports, one field group per set of them."""
        if not self.plan.profiling:
            for gpu in gpus:
                gpu.profiling, gpu.why = "unsupported", "no profiling fields configured"
            return
        by_fields: dict[frozenset[int], list[int]] = {}
        for gpu in gpus:
            wanted = self._supported_profiling(gpu)
            if wanted:
                gpu.fields = wanted
                by_fields.setdefault(wanted, []).append(gpu.id)
        structs = self.bindings.structs
        for fields, gpu_ids in sorted(by_fields.items(), key=lambda kv: kv[1]):
            try:
                self._watch(f"{self.prefix}_prof{min(gpu_ids)}", gpu_ids, sorted(fields), True)
            except structs.DCGMError as e:
                if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                    raise
                for gpu_id in gpu_ids:
                    self._profiling_state(self.gpus[gpu_id], "refused", self.bindings.describe(e))
                self.profiling_retry_at = now + self.config.profiling_retry
                continue
            for gpu_id in gpu_ids:
                self._profiling_state(self.gpus[gpu_id], "active", "")

    def _supported_profiling(self, gpu: Gpu) -> frozenset[int]:
        """The configured profiling fields DCGM can watch on `gpu` (none: unsupported)."""
        structs = self.bindings.structs
        try:
            groups = self.bindings.agent.dcgmProfGetSupportedMetricGroups(
                self.handle.handle, gpu.id
            )
        except structs.DCGMError as e:
            if e.value not in {getattr(structs, n, None) for n in _UNSUPPORTED_PROFILING}:
                raise
            self._profiling_state(gpu, "unsupported", self.bindings.describe(e))
            return frozenset()
        supported = {
            int(groups.metricGroups[i].fieldIds[j])
            for i in range(groups.numMetricGroups)
            for j in range(groups.metricGroups[i].numFieldIds)
        }
        configured = self.plan.profiling
        wanted = frozenset(f for f in configured if f in supported)
        if not wanted:
            why = "DCGM reports no supported profiling metric groups for the configured fields"
            self._profiling_state(gpu, "unsupported", why)
        elif len(wanted) < len(configured) and gpu.profiling != "active":
            missing = sorted(set(configured) - wanted)
            log.info(
                "dcgm: GPU %d: profiling fields %s not supported; watching %s",
                gpu.label,
                missing,
                sorted(wanted),
            )
        return wanted

    def _profiling_state(self, gpu: Gpu, state: str, why: str) -> None:
        if (gpu.profiling, gpu.why) != (state, why):
            self._changes.setdefault((state, why, gpu.name), []).append(gpu)
        gpu.profiling, gpu.why = state, why
        if state not in ("active", "paused"):
            gpu.fields = frozenset()

    def log_profiling_changes(self) -> None:
        """One line per new (state, reason, model), naming the GPUs: logged once per change."""
        for (state, why, model), gpus in self._changes.items():
            level = logging.INFO if state in ("active", "paused") else logging.WARNING
            log.log(
                level,
                "dcgm: profiling %s on GPUs [%s] (%s)%s",
                state,
                ranges(g.label for g in gpus),
                model,
                f": {why}" if why else "",
            )
        self._changes.clear()

    def retry_profiling(self, now: float) -> None:
        retry = self.profiling_retry_at
        if retry is None or now < retry:
            return
        self.profiling_retry_at = None
        refused = [g for g in self.gpus.values() if g.profiling == "refused"]
        if refused:
            self._watch_profiling(now, refused)
            self.log_profiling_changes()
            for gpu in refused:
                self.prepare(gpu)
            if any(g.instances for g in refused):
                self.mig.invalidate()  # their instances' watch, with the fields now watched

    def apply_pause(self, wanted: bool) -> None:
        """Pause (or resume) DCGM profiling host-wide, unless it already is or cannot be."""
        if wanted == self.profiling_paused or self.pause_unsupported:
            return
        structs = self.bindings.structs
        try:
            if wanted:
                self.system.profiling.Pause()
            else:
                self.system.profiling.Resume()
        except structs.DCGMError as e:
            if e.value != structs.DCGM_ST_NOT_SUPPORTED:
                raise
            self.pause_unsupported = True
            log.info(
                "dcgm: profiling pause not supported by this DCGM/GPU (%s); profilers "
                "can run beside DCGM here (GPM)",
                self.bindings.describe(e),
            )
            return
        self.profiling_paused = wanted
        for gpu in self.gpus.values():
            if wanted and gpu.profiling == "active":
                self._profiling_state(gpu, "paused", "paused on request")
            elif not wanted and gpu.profiling == "paused":
                self._profiling_state(gpu, "active", "")
        self.log_profiling_changes()

    # -- reading --------------------------------------------------------------------------

    def prepare(self, gpu: Gpu) -> None:
        """Precompute every (metric, labels, scale) a value of each field becomes."""
        compat = self.config.exporter_compat
        labels = gpu.labels
        gpu.emit = {}
        for fid in self.plan.watched:
            rows: list[Row] = []
            mapping = FIELD_MAPS.get(fid)
            if fid in self.plan.native:
                if mapping is not None and mapping.spec is not None:
                    rows.append((mapping.spec.name, labels + mapping.extra, mapping.scale))
                else:
                    rows.append((GENERIC.name, labels + (str(fid),), 1.0))
            if compat and mapping is not None and mapping.compat:
                rows.extend(self._compat_rows(gpu, fid, mapping.compat))
            gpu.emit[fid] = rows
        for instance in gpu.instances:
            self.mig.prepare(instance)
        states = PROFILING_STATES
        gpu.state_samples = {
            s: [Sample(PROFILING_STATE.name, labels + (t,), float(s == t)) for t in states]
            for s in states
        }

    def _compat_rows(self, gpu: Gpu, fid: int, name: str) -> list[Row]:
        """dcgm-exporter's rows of a GPU's field. On a GPU with MIG GPU instances it
        shows (in its default "flex" mode) the instances only: a device field once per
        instance with the GPU's value (what DCGM answers there), a profiling field and a
        device field DCGM answers per instance (framebuffer, last Xid) from the
        instances' own reads (mig.py), none for the GPU itself."""
        if not gpu.instances:
            return [(name, gpu.compat, 1.0)]
        if fid in self.plan.profiling_ids or fid in self.mig.device_fields:
            return []  # read on the instances themselves
        return [(name, instance.compat, 1.0) for instance in gpu.instances]

    def read(self) -> list[Sample]:
        out: list[Sample] = []
        self.mig.update()  # the MIG layout first: the rows below follow it
        for watch in self.watches:
            if watch.profiling and self.profiling_paused:
                continue  # blank while paused
            if watch.entity_group != FE_GPU:
                continue  # MIG GPU instances: read by self.mig
            self.emit_watch(watch, self.gpus, out)
        self.mig.poll(out)
        return out

    def emit_watch(self, watch: Watch, owners: Mapping[int, Owner], out: list[Sample]) -> None:
        """The watch's latest values as samples into `out`, by the rows (`prepare`) of
        their entities' `owners` (GPUs, or MIG GPU instances)."""
        read = self.read_watch(watch)
        if not isinstance(read, Columns):  # read one by one
            if watch.indices:
                self._follow_indices(read)
            self._emit(read, owners, out)
            return
        if watch.indices:
            self._follow_index_columns(read)
        made = watch.made
        if not isinstance(made, Made) or not made.fits(read.plan, owners):
            made = watch.made = Made(read.plan, owners)
        made.samples(read.values, out)

    def read_watch(self, watch: Watch) -> Columns | list[Value]:
        """(DCGM GPU id, field id, number or not) of the watch's non-blank latest values:
        all in one dcgmEntitiesGetLatestValues call (as `Columns` where all are numbers),
        or, where libdcgm lacks it, through dcgmGetLatestValues_v2 with our own callback
        (latest.py: never pydcgm's)."""
        latest = self.latest
        handle = self.handle.handle
        if latest.available:
            structs = self.bindings.structs
            last = watch.made.plan if isinstance(watch.made, Made) else None
            try:
                return latest.columns(handle, watch.gpus, watch.fields, watch.entity_group, 0, last)
            except structs.DCGMError as e:
                if e.value != structs.DCGM_ST_FUNCTION_NOT_FOUND:
                    raise
                latest.unavailable(self.bindings.describe(e))
        group, field_group = watch.group.GetId(), watch.field_group.fieldGroupId
        return latest.read_by_callback(
            handle, group, field_group, watch.gpus, watch.fields, watch.entity_group
        )

    def _emit(self, values: list[Value], owners: Mapping[int, Owner], out: list[Sample]) -> None:
        sample = self.sample
        for entity, fid, number in values:
            owner = owners.get(entity)
            rows = owner.emit.get(fid) if owner is not None else None
            if rows:
                sample(fid, number, rows, out)

    def sample(self, fid: int, number: Any, rows: list[Row], out: list[Sample]) -> None:
        """The samples one value of field `fid` becomes (`rows`: prepare)."""
        if type(number) is not float:
            self._not_a_number(fid, number)
            return
        for name, labels, scale in rows:
            if name == _XID:
                labels = _xid_labels(labels, number)
            out.append(Sample(name, labels, number * scale))

    def _follow_indices(self, values: list[Value]) -> None:
        """Relabel a GPU whose NVML index changed while connected."""
        for gpu_id, fid, number in values:
            gpu = self.gpus.get(gpu_id) if fid == NVML_INDEX else None
            if gpu is not None and type(number) is float and int(number) != gpu.label:
                self._relabel(gpu, int(number))

    def _follow_index_columns(self, read: Columns) -> None:
        """`_follow_indices` over a read's columns."""
        numbers, limits = read.values, read.plan.limits
        for j, gpu_id in read.plan.find(NVML_INDEX):
            gpu = self.gpus.get(gpu_id)
            if gpu is not None and not numbers[j] >= limits[j]:
                index = int(float(numbers[j]))
                if index != gpu.label:
                    self._relabel(gpu, index)

    def _relabel(self, gpu: Gpu, index: int) -> None:
        gpu.index = index
        log.info("dcgm: DCGM GPU %d is NVML GPU %d now", gpu.id, gpu.index)
        self.prepare(gpu)

    def _not_a_number(self, fid: int, value: Any) -> None:
        if fid not in self._not_numbers:
            self._not_numbers.add(fid)
            log.warning(
                "dcgm: field %d gave %r, not a number: its values are left out (are the "
                "bindings and nv-hostengine of different DCGM versions?)",
                fid,
                value,
            )

    # -- teardown -------------------------------------------------------------------------

    def close(self, tidy: bool) -> None:
        """Disconnect. `tidy` (the connection works): first give the counters back and
        remove our groups; else only make pydcgm forget them."""
        if tidy and self.profiling_paused:
            self._quietly(self.system.profiling.Resume)
        for watch in self.watches:
            if tidy:
                self._quietly(watch.group.samples.UnwatchFields, watch.field_group)
                self.bindings.delete(watch.field_group)
                self._quietly(watch.group.Delete)
            else:
                self.bindings.forget(watch.field_group)
        self.watches.clear()
        self.mig.forget()
        self.bindings.disconnect(self.handle)

    def _quietly(self, function: Callable[..., Any], *args: Any) -> None:
        try:
            function(*args)
        except self.bindings.structs.DCGMError as e:
            log.debug("dcgm: %s failed: %s", getattr(function, "__name__", function), e)


def _version(raw: str) -> str:
    match = re.search(r"(?:^|;)version:([^;]+)", raw)
    return match.group(1) if match else raw.strip()[:32]


def ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6"."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(ids):
        if run and i != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def _xid_labels(labels: tuple[str, ...], number: float) -> tuple[str, ...]:
    """dcgm-exporter's Xid row: its labels, with the code and its text."""
    code = int(number)
    return labels + (str(code), XID_MESSAGES.get(code, UNKNOWN_XID))


# Sample._make without its Python frame (a namedtuple's __new__ is Python)
_make_sample: Callable[[tuple[Any, ...]], Sample] = functools.partial(tuple.__new__, Sample)


def _tables(plan: Plan, owners: Mapping[int, Owner]) -> list[dict[int, list[Row]] | None]:
    """The rows (`emit`) of each entity's owner in `plan`, None where it has none."""
    found = map(owners.get, plan.entities)
    return list(map(getattr, found, itertools.repeat("emit"), itertools.repeat(None)))


class Made:
    """What a watch's read (`Columns`) becomes: a sample per row of each value's owner
    (`prepare`), made without a Python call a value. Kept while the read's plan and the
    owners' rows are the same objects (`prepare` makes new ones)."""

    def __init__(self, plan: Plan, owners: Mapping[int, Owner]) -> None:
        self.plan = plan
        self.tables = _tables(plan, owners)
        self.index: list[int] = []  # the value each sample is made of
        self.names: list[str] = []
        self.labels: list[tuple[str, ...]] = []
        self.scales: list[float] = []
        self.xids: list[tuple[int, int, tuple[str, ...]]] = []  # (sample, value, labels)
        tables = dict(zip(plan.entities, self.tables, strict=True))
        for j, (entity, fid) in enumerate(plan.keys):
            table = tables[entity]
            for name, labels, scale in (table.get(fid) or ()) if table is not None else ():
                if name == _XID:
                    self.xids.append((len(self.index), j, labels))
                self.index.append(j)
                self.names.append(name)
                self.labels.append(labels)
                self.scales.append(float(scale))  # a float sample, as number * scale was

    def fits(self, plan: Plan, owners: Mapping[int, Owner]) -> bool:
        return plan is self.plan and all(map(operator.is_, _tables(plan, owners), self.tables))

    def samples(self, numbers: tuple[float, ...], out: list[Sample]) -> None:
        """`sample` over every value, blanks left out, in one pass of C calls."""
        kept = list(map(operator.not_, map(operator.ge, numbers, self.plan.limits)))
        labels = self.labels
        if self.xids:
            labels = labels.copy()
            for at, j, base in self.xids:
                if kept[j]:
                    labels[at] = _xid_labels(base, float(numbers[j]))
        values = map(operator.mul, map(numbers.__getitem__, self.index), self.scales)
        made = map(_make_sample, zip(self.names, labels, values, strict=True))
        out.extend(itertools.compress(made, map(kept.__getitem__, self.index)))
