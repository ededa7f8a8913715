"""MIG GPU instances in DCGM: finding them, watching their profiling fields, reading them.

On a MIG-enabled GPU NVML has no utilization; DCGM's profiling module answers per GPU
instance (entity group DCGM_FE_GPU_I), which is what dcgm-exporter reads there. DCGM
numbers its GPU-instance entities itself (`gpuId * maxGpcs + k`, renumbered when the MIG
layout changes); `dcgm_agent.dcgmGetGpuInstanceHierarchy` (a dcgmMigHierarchy_v2) says
which entity is which: each GPU instance's parent GPU, its NVML id (`nvmlInstanceId`,
nvidia-smi's GI ID, dcgm-exporter's GPU_I_ID) and slices. Its profile ("1g.10gb",
dcgm-exporter's GPU_I_PROFILE) is DCGM_FI_DEV_NAME read live on the entity, as
dcgm-exporter reads it.

The GPU instances go in one group of their own with one field group: the configured
profiling fields their GPU watches that DCGM's metadata puts at the GPU_I/GPU_CI level
(`fields.instance_level`); the others (PCIe/NVLink bytes) and every device field are the
GPU's only (DCGM would answer a GPU-level device field on a GPU instance with its GPU's
value, a GPU-level profiling field with no data). Each GI value becomes the instance form
of its family (`gpuwatchd_gpu_instance_*{gpu,uuid,gpu_instance,profile}`).

Finding them again is cheap: the hierarchy is read when connecting, every `MIG_EVERY`
polls on a node without GPU instances (MIG enabled at run time), every poll on a node
with some (DCGM renumbers the entities when the layout changes: an entity id read a poll
later may be another tenant's GPU instance, and its read still succeeds), and at once
when a GPU instance's read answers an error (destroyed, or MIG disabled:
DCGM_ST_INSTANCE_NOT_FOUND). The group and field group are rebuilt only when the
hierarchy changed (an entity, its GPU, GI id, slices or profile id: a GI destroyed and
made again with the same id as another profile of as many slices is another instance).
The hierarchy is read at the start of a poll, before any value becomes a row, so a GPU's
compat rows move to its instances (or back) in the poll that saw the change.
"""

from __future__ import annotations

import logging
from typing import Any

from gpuwatchd.sources.dcgm.fields import (
    FE_GPU,
    FE_GPU_I,
    FIELD_MAPS,
    INSTANCE_SPECS,
    INSTANCE_UTILIZATION,
)
from gpuwatchd.sources.dcgm.model import Host, Instance, Row, Watch

GR_ENGINE_FIELD = 1001  # DCGM_FI_PROF_GR_ENGINE_ACTIVE

log = logging.getLogger(__package__)

MIG_EVERY = 6  # polls between two hierarchy reads (30 s at the default 5 s interval)
NAME = 50  # DCGM_FI_DEV_NAME: a GPU instance's profile
_NO_MIG = (  # the hierarchy cannot be had here: no MIG reading, said once
    "DCGM_ST_FUNCTION_NOT_FOUND",
    "DCGM_ST_NOT_SUPPORTED",
    "DCGM_ST_REQUIRES_ROOT",
    "DCGM_ST_NVML_NOT_LOADED",
)


class MigInstances:
    """A session's MIG GPU instances: discovery, their watch, their values."""

    def __init__(self, session: Host) -> None:
        self.session = session
        self.instances: dict[int, Instance] = {}  # by entity id
        self.watch: Watch | None = None  # their profiling fields
        self.fields: frozenset[int] = frozenset()  # those a GPU instance answers itself
        self.device_watch: Watch | None = None  # exporter_compat's instance-level device fields
        self.device_fields: frozenset[int] = frozenset()  # watched there: not the GPU's rows
        self._signature: tuple[Any, ...] = ()
        self._polls = 0
        self._stale = False
        self._off = False  # this DCGM cannot say (logged once)

    # -- discovery --------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the hierarchy; rebuild the instances and their watch if it changed."""
        if self._off:
            return
        rows = self._hierarchy()
        self._stale = False
        if rows is None:
            return  # unknown this time: the instances as they were, asked again later
        signature = tuple(rows)
        if signature == self._signature:
            return
        self._signature = signature
        self._unwatch()
        gpus = self.session.gpus
        found = {
            entity: (gpus[gpu_id], str(gi)) for entity, gpu_id, gi, *_ in rows if gpu_id in gpus
        }
        profiles = self._profiles(sorted(found))
        self.instances = {
            entity: Instance(entity, gpu, gi, profiles.get(entity, ""))
            for entity, (gpu, gi) in found.items()
        }
        before = {g.id for g in gpus.values() if g.instances}
        for gpu in gpus.values():
            gpu.instances = [i for i in self.instances.values() if i.gpu is gpu]
        self._watch()
        for gpu in gpus.values():
            if gpu.instances or gpu.id in before:
                self.session.prepare(gpu)  # its compat rows move to (or from) its instances
        log.info(
            "dcgm: MIG GPU instances: %s",
            ", ".join(f"GPU {i.gpu.label} GI {i.gi} ({i.profile})" for i in self.instances.values())
            or "none",
        )

    def _hierarchy(self) -> list[tuple[int, int, int, int, int]] | None:
        """(entity, parent GPU id, NVML GI id, slices, profile id) of every GPU instance;
        None if DCGM could not say this time."""
        bindings, structs = self.session.bindings, self.session.bindings.structs
        get = getattr(bindings.agent, "dcgmGetGpuInstanceHierarchy", None)
        try:
            if get is None:
                raise structs.DCGMError(getattr(structs, "DCGM_ST_FUNCTION_NOT_FOUND", -37))
            hierarchy = get(self.session.handle.handle)
        except structs.DCGMError as e:
            if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                raise
            if e.value not in {getattr(structs, n, None) for n in _NO_MIG}:
                log.debug("dcgm: reading the MIG hierarchy failed: %s", bindings.describe(e))
                return None
            self._off = True
            log.info("dcgm: no MIG GPU instances read (%s)", bindings.describe(e))
            return []
        rows = []
        for k in range(hierarchy.count):
            row = hierarchy.entityList[k]
            if row.entity.entityGroupId == FE_GPU_I and row.parent.entityGroupId == FE_GPU:
                info = row.info
                rows.append(
                    (
                        int(row.entity.entityId),
                        int(row.parent.entityId),
                        int(info.nvmlInstanceId),
                        int(info.nvmlProfileSlices),
                        int(info.nvmlMigProfileId),  # a GI made again as another profile
                    )
                )
        return rows

    def _profiles(self, entities: list[int]) -> dict[int, str]:
        """Each GPU instance's profile: DCGM_FI_DEV_NAME read live on it."""
        if not entities or not self.session.latest.available:
            return {}
        session, structs = self.session, self.session.bindings.structs
        live = getattr(structs, "DCGM_FV_FLAG_LIVE_DATA", 1)
        try:
            values = session.latest.read(session.handle.handle, entities, [NAME], FE_GPU_I, live)
        except structs.DCGMError as e:
            if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                raise
            log.info("dcgm: MIG profile names unreadable: %s", session.bindings.describe(e))
            return {}
        return {entity: str(name) for entity, _, name in values}

    # -- the watch ----------------------------------------------------------------------

    def _watch(self) -> None:
        """The instances' watches: their profiling fields, and dcgm-exporter's device
        fields that a GPU instance answers itself (`exporter_compat`)."""
        session = self.session
        entities = [i.entity for i in self.instances.values() if i.gpu.fields]
        wanted = frozenset().union(*(self.instances[e].gpu.fields for e in entities))
        self.fields = session.instance_fields(wanted)
        if entities and self.fields:
            self.watch = self._watch_group("_mig", entities, self.fields, True)
        plan = session.plan
        compat = frozenset(
            f
            for f in plan.watched
            if f not in plan.profiling_ids and (m := FIELD_MAPS.get(f)) is not None and m.compat
        )
        fields = session.instance_fields(compat) if session.config.exporter_compat else frozenset()
        if self.instances and fields:
            self.device_watch = self._watch_group("_migdev", list(self.instances), fields, False)
            self.device_fields = fields if self.device_watch is not None else frozenset()
        for instance in self.instances.values():
            self.prepare(instance)

    def _watch_group(
        self, suffix: str, entities: list[int], fields: frozenset[int], profiling: bool
    ) -> Watch | None:
        """One group of `entities` (GPU instances) watching `fields`; None if refused."""
        session = self.session
        structs = session.bindings.structs
        try:
            return session.watch_entities(
                session.prefix + suffix, FE_GPU_I, entities, sorted(fields), profiling
            )
        except structs.DCGMError as e:
            if e.value == structs.DCGM_ST_CONNECTION_NOT_VALID:
                raise
            log.warning(
                "dcgm: watching the MIG GPU instances failed (%s); retried when they change",
                session.bindings.describe(e),
            )
            return None

    def _unwatch(self) -> None:
        for watch in (self.watch, self.device_watch):
            if watch is not None:
                self.session.drop(watch)
        self.watch = self.device_watch = None
        self.device_fields = frozenset()

    def invalidate(self) -> None:
        """Rebuild the instances and their watch at the next poll."""
        self._signature, self._stale = (), True

    def forget(self) -> None:
        """The session closes: its watches go with it (Session.close)."""
        self.watch = self.device_watch = None

    # -- reading ------------------------------------------------------------------------

    def update(self) -> None:
        """The hierarchy again when due: at the start of a poll, before any row is made
        (a GPU's compat rows move to its instances, or back, in the poll that saw it)."""
        self._polls += 1
        if self._stale or self.instances or self._polls % MIG_EVERY == 0:
            self.refresh()

    def poll(self, out: list[Any]) -> None:
        """This poll's GPU-instance values into `out` (after `update`)."""
        session = self.session
        for watch in (self.device_watch, None if session.profiling_paused else self.watch):
            if watch is None:
                continue
            session.emit_watch(watch, self.instances, out)
            if session.latest.failed & set(self.instances):
                self._stale = True  # one is gone: find out what is left at the next poll

    def prepare(self, instance: Instance) -> None:
        """Precompute what each of the instance's values becomes."""
        plan, compat = self.session.plan, self.session.config.exporter_compat
        instance.emit = {}
        for fid in self.device_fields:  # dcgm-exporter's row only (the GPU's are native)
            instance.emit[fid] = [(FIELD_MAPS[fid].compat, instance.compat, 1.0)]
        for fid in self.fields:
            rows: list[Row] = []
            spec = INSTANCE_SPECS.get(fid)
            if fid in plan.native and spec is not None:
                rows.append((spec.name, instance.labels, FIELD_MAPS[fid].scale))
                if fid == GR_ENGINE_FIELD:
                    rows.append((INSTANCE_UTILIZATION.name, instance.labels, FIELD_MAPS[fid].scale))
            mapping = FIELD_MAPS.get(fid)
            if compat and mapping is not None and mapping.compat:
                rows.append((mapping.compat, instance.compat, 1.0))
            instance.emit[fid] = rows
