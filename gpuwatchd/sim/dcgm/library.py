"""The fake libdcgm client library: DCGM's C symbols for the fake bindings.

The fake bindings' `dcgm_structs._dcgmInit()` asks their `_sim` module for a library;
that is `load_library` here, which returns a `FakeDcgmLib`: every DCGM C symbol the
bindings call, taking the C arguments (`byref(struct)`, `c_void_p` handles, ctypes
arrays, enumeration callbacks) and returning a `dcgmReturn_t`. Calls on a connection
reach the `SimHostengine` it was opened to.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gpuwatchd.sim.dcgm.fields import (
    FE_GPU,
    FIELD_LEVELS,
    FIELDS,
    MAX_BLOB_LENGTH,
    MAX_STR_LENGTH,
    ST_BADPARAM,
    ST_CONNECTION_NOT_VALID,
    ST_DUPLICATE_KEY,
    ST_INIT_ERROR,
    ST_NO_DATA,
    ST_NOT_CONFIGURED,
    ST_NOT_SUPPORTED,
    ST_OK,
    ST_PROFILING_NOT_SUPPORTED,
    ST_UNINITIALIZED,
    TAGS,
    VBIOS,
    VERSIONS,
    FieldInfo,
    Status,
    brand,
    serial,
)
from gpuwatchd.sim.dcgm.hostengine import (
    FieldGroup,
    Group,
    HostengineDown,
    SimHostengine,
    State,
    embedded,
    lookup,
)
from gpuwatchd.sim.dcgm.mig import MigSymbols
from gpuwatchd.sim.fakelib import install_symbols, symbol

Row = tuple[int, int, int, str, Any, int, int]  # SimHostengine.values(): one value

_LIBRARY: dict[str, bool] = {"missing": False}
STATS_ENV = "GPUWATCHD_SIM_DCGM_STATS"
_WITHOUT: set[str] = set()  # symbols the libraries loaded now lack


@contextmanager
def library_missing() -> Iterator[None]:
    """While active, the fake bindings cannot load libdcgm (as with bindings but no DCGM)."""
    _LIBRARY["missing"] = True
    try:
        yield
    finally:
        _LIBRARY["missing"] = False


@contextmanager
def library_without(*symbols: str) -> Iterator[None]:
    """While active, libdcgm loads without these C symbols (as an older libdcgm would):
    the bindings' `_dcgmGetFunctionPointer` raises DCGM_ST_FUNCTION_NOT_FOUND for them."""
    _WITHOUT.update(symbols)
    try:
        yield
    finally:
        _WITHOUT.difference_update(symbols)


def load_library(lib_path: str | None = None) -> FakeDcgmLib | None:
    """What `CDLL("libdcgm.so.4")` gives the fake bindings; None: not found."""
    if _LIBRARY["missing"]:
        return None
    return FakeDcgmLib(missing=frozenset(_WITHOUT))


# -- the client library ---------------------------------------------------------------------


class _OutputFormat(ctypes.Structure):  # dcgm_field_output_format_t
    _fields_ = [
        ("shortName", ctypes.c_char * 10),
        ("unit", ctypes.c_char * 4),
        ("width", ctypes.c_short),
    ]


class _FieldMeta(ctypes.Structure):  # dcgm_field_meta_t, dcgm_fields.h (3.x and 4.x alike)
    _fields_ = [
        ("fieldId", ctypes.c_ushort),
        ("fieldType", ctypes.c_char),
        ("size", ctypes.c_ubyte),
        ("tag", ctypes.c_char * 48),
        ("scope", ctypes.c_int),
        ("nvmlFieldId", ctypes.c_int),
        ("entityLevel", ctypes.c_int),  # dcgm_field_entity_group_t
        ("valueFormat", ctypes.POINTER(_OutputFormat)),
    ]


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


def _pairs(entities: Any, count: int) -> list[tuple[int, int]]:
    """(entityGroupId, entityId) of the first `count` dcgmGroupEntityPair_t of an array."""
    if ctypes.sizeof(getattr(entities, "_type_", ctypes.c_char)) == 8:  # two uint32
        view = memoryview(entities).cast("B")[: 8 * count]
        return list(struct.iter_unpack("=II", view))
    get = ctypes.Structure.__getattribute__
    return [(get(p, "entityGroupId"), get(p, "entityId")) for p in entities[:count]]


def _text(arg: Any) -> str:
    value = getattr(arg, "value", arg)
    if isinstance(value, bytes):
        return value.decode()
    return str(value or "")


_CODES = {1: "b", 2: "h", 4: "i", 8: "q"}  # struct codes by size; upper case: unsigned
_HEADER = ("version", "entityGroupId", "entityId", "fieldId", "fieldType", "status", "unused", "ts")
GROUP_MAX_ENTITIES = 1024  # DCGM_GROUP_MAX_ENTITIES_V2
MAX_FIELD_IDS = 128  # DCGM_MAX_FIELD_IDS_PER_FIELD_GROUP


class _ValueWriter:
    """Writes values into the caller's array of dcgmFieldValue_v1/_v2 as libdcgm does:
    bytes at the struct's offsets (`struct.pack_into`), no ctypes attribute per member.

    The layout is read off the bindings' ctypes struct (each private copy of the
    bindings has its own class, so one writer per class)."""

    def __init__(self, struct_type: Any, version: int) -> None:
        kinds = {name: kind for name, kind, *_ in struct_type._fields_}
        self.stride = ctypes.sizeof(struct_type)
        self.version = self.stride | (version << 24)  # make_dcgm_version
        self.v2 = "entityId" in kinds
        members = [(getattr(struct_type, m).offset, m) for m in _HEADER if m in kinds]
        if [m for _, m in sorted(members)] != [m for _, m in members]:
            raise TypeError(f"{struct_type.__name__}: members out of order")
        codes = [(offset, self._code(kinds[m])) for offset, m in members]
        self.value_offset = struct_type.value.offset
        self.head = self._struct(codes)
        self.ints = self._struct([*codes, (self.value_offset, "q")])
        self.doubles = self._struct([*codes, (self.value_offset, "d")])

    @staticmethod
    def _code(kind: Any) -> str:
        code = _CODES[ctypes.sizeof(kind)]
        return code.upper() if str(kind._type_).isupper() else code

    @staticmethod
    def _struct(members: list[tuple[int, str]]) -> struct.Struct:
        fmt, at = "=", 0
        for offset, code in members:
            fmt += (f"{offset - at}x" if offset > at else "") + code
            at = offset + struct.calcsize("=" + code)
        return struct.Struct(fmt)

    def write(self, out: Any, index: int, row: Row) -> None:
        """Row `row` of SimHostengine.values() into out[index]."""
        kind, entity, fid, ft, value, status, ts = row
        if self.v2:
            head: tuple[Any, ...] = (self.version, kind, entity, fid, ord(ft), status, 0, ts)
        else:
            head = (self.version, fid, ord(ft), status, ts)
        at = index * self.stride
        if ft == "d":
            self.doubles.pack_into(out, at, *head, float(value))
        elif ft == "s":
            self.head.pack_into(out, at, *head)
            text = str(value).encode()[: MAX_STR_LENGTH - 1] + b"\0"
            ctypes.memmove(ctypes.addressof(out) + at + self.value_offset, text, len(text))
        elif ft == "b":
            self.head.pack_into(out, at, *head)
            if isinstance(value, bytes):
                size = min(len(value), MAX_BLOB_LENGTH)
                ctypes.memmove(ctypes.addressof(out) + at + self.value_offset, value, size)
        else:
            number = int(value)
            if not -(2**63) <= number < 2**63:  # C truncates to int64, as ctypes does
                number = ctypes.c_int64(number).value
            self.ints.pack_into(out, at, *head, number)


@contextmanager
def _callback_errors() -> Iterator[list[Any]]:
    """The exceptions enumeration callbacks raise in this thread meanwhile (ctypes hands
    them to sys.unraisablehook, which still reports them)."""
    raised: list[Any] = []
    previous, thread = sys.unraisablehook, threading.get_ident()

    def hook(unraisable: Any) -> None:
        if threading.get_ident() == thread:
            raised.append(unraisable)
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield raised
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


class FakeDcgmLib(MigSymbols):
    """libdcgm.so's symbols as Python callables with the C signatures (a DCGM client)."""

    def __init__(self, missing: frozenset[str] = frozenset()) -> None:
        self.calls: Counter[str] = Counter()
        self._initialized = 0
        self._connections: dict[int, _Connection] = {}
        self._next_handle = 0x5000
        self._metas: dict[int, _FieldMeta] = {}  # field metadata handed out by pointer
        self._version = VERSIONS["4"]
        self._writers: dict[tuple[type, int], _ValueWriter] = {}
        self._symbols = install_symbols(self, missing)
        self._stats_path = os.environ.get(STATS_ENV) or None
        self._standalone: dict[int, SimHostengine] = {}  # engines connected to, by id

    def _writer(self, array_type: Any, version: int) -> _ValueWriter:
        """The writer for arrays of `array_type`'s element struct (dcgmFieldValue_v<version>)."""
        struct_type = getattr(array_type, "_type_", array_type)
        writer = self._writers.get((struct_type, version))
        if writer is None:
            writer = self._writers[(struct_type, version)] = _ValueWriter(struct_type, version)
        return writer

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
            except HostengineDown:
                return ST_CONNECTION_NOT_VALID
            except Status as e:
                return e.code
            finally:
                if self._stats_path is not None:
                    self._write_stats(self._stats_path)

    def _write_stats(self, path: str) -> None:
        cpu = sum(engine.cpu_seconds for engine in self._standalone.values())
        with open(f"{path}.tmp", "w") as f:
            f.write(f"{time.monotonic():.6f} {sum(self.calls.values())} {cpu:.6f}\n")
        os.replace(f"{path}.tmp", path)

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
        except HostengineDown:
            return ST_CONNECTION_NOT_VALID
        self._standalone[id(engine)] = engine
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
        engine = embedded()
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
    def _dcgmHostengineIsHealthy(self, conn: _Connection, state: State, out: Any) -> int:
        out._obj.overallHealth = 0
        return ST_OK

    # -- field metadata (DcgmFieldGetById and friends live in libdcgm too) ---------------------

    @symbol("noinit")
    def _DcgmFieldsInit(self) -> int:
        return ST_OK

    def _meta(self, restype: Any, info: FieldInfo | None) -> Any:
        """A pointer to the field's dcgm_field_meta_t as libdcgm lays it out (every DCGM
        from 2.x to 4.6: the entity level included), typed as the bindings' restype. The
        bindings copy sizeof(their own struct) from it: DCGM 3.x's Python struct has no
        nvmlFieldId or entityLevel (and reads those bytes as its inline valueFormat)."""
        if info is None:
            return None
        meta = self._metas.get(info.id)  # libdcgm's table: one struct per field, kept
        if meta is None:
            meta = self._metas[info.id] = self._new_meta(info)
        pointer = ctypes.pointer(meta)
        return ctypes.cast(pointer, restype) if hasattr(restype, "contents") else pointer

    @staticmethod
    def _new_meta(info: FieldInfo) -> _FieldMeta:
        meta = _FieldMeta()
        meta.fieldId = info.id
        meta.fieldType = info.type.encode()
        meta.size = 8 if info.type != "s" else 0
        meta.tag = info.tag.encode()
        meta.scope = 1
        meta.entityLevel = FIELD_LEVELS.get(info.id, FE_GPU)
        meta.valueFormat = ctypes.pointer(_OutputFormat(info.tag[:9].encode(), b"", 10))
        return meta

    def _DcgmFieldGetById(self, field_id: Any) -> Any:  # wrapped below (needs restype)
        return self._meta(self._symbols["DcgmFieldGetById"].restype, FIELDS.get(_int(field_id)))

    def _DcgmFieldGetByTag(self, tag: Any) -> Any:
        fid = TAGS.get(_text(tag))
        return self._meta(self._symbols["DcgmFieldGetByTag"].restype, FIELDS.get(fid or -1))

    symbol("noinit")(_DcgmFieldGetById)
    symbol("noinit")(_DcgmFieldGetByTag)

    # -- discovery ----------------------------------------------------------------------------

    def _device_list(self, conn: _Connection, ids: Any, count: Any) -> int:
        gpus = conn.engine.gpus()
        for i, (_, gpu_id) in enumerate(gpus):
            ids[i] = gpu_id
        count._obj.value = len(gpus)
        return ST_OK

    @symbol("handle")
    def _dcgmGetAllDevices(self, conn: _Connection, state: State, ids: Any, count: Any) -> int:
        return self._device_list(conn, ids, count)

    @symbol("handle")
    def _dcgmGetAllSupportedDevices(
        self, conn: _Connection, state: State, ids: Any, count: Any
    ) -> int:
        return self._device_list(conn, ids, count)

    @symbol("handle")
    def _dcgmGetDeviceAttributes(
        self, conn: _Connection, state: State, gpu_id: Any, out: Any
    ) -> int:
        engine = conn.engine
        gpu = engine.nvml_index(_int(gpu_id))
        if gpu is None:
            return ST_BADPARAM
        attrs = out._obj
        model = engine.model
        ident = attrs.identifiers
        ident.brandName = brand(model.datacenter).encode()
        ident.deviceName = model.name.encode()
        ident.pciBusId = engine.bus_ids[gpu].encode()
        ident.serial = serial(gpu).encode()
        ident.uuid = engine.uuids[gpu].encode()
        ident.vbios = VBIOS.encode()
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
        self, conn: _Connection, state: State, kind: Any, name: Any, out: Any
    ) -> int:
        owner = self._owner(conn)
        out._obj.value = conn.engine.group_create(state, _int(kind), _text(name), owner)
        return ST_OK

    def _owner(self, conn: _Connection) -> int:
        return next(h for h, c in self._connections.items() if c is conn)

    def _group(self, state: State, group_id: Any) -> Group:
        group = state.groups.get(_int(group_id))
        if group is None:
            raise Status(ST_NOT_CONFIGURED)
        return group

    @symbol("handle")
    def _dcgmGroupDestroy(self, conn: _Connection, state: State, group_id: Any) -> int:
        self._group(state, group_id)
        del state.groups[_int(group_id)]
        state.watches = {k: w for k, w in state.watches.items() if w.group != _int(group_id)}
        state.watched = None
        return ST_OK

    @symbol("handle")
    def _dcgmGroupAddDevice(self, conn: _Connection, state: State, group_id: Any, gpu: Any) -> int:
        return self._add_entity(conn, state, group_id, FE_GPU, _int(gpu))

    @symbol("handle")
    def _dcgmGroupAddEntity(
        self, conn: _Connection, state: State, group_id: Any, kind: Any, entity: Any
    ) -> int:
        return self._add_entity(conn, state, group_id, _int(kind), _int(entity))

    def _add_entity(
        self, conn: _Connection, state: State, group_id: Any, kind: int, entity: int
    ) -> int:
        group = self._group(state, group_id)
        if not conn.engine.is_entity(kind, entity):  # a GPU, or a MIG GPU instance now
            return ST_BADPARAM
        if (kind, entity) in group.entities:
            return ST_DUPLICATE_KEY
        group.entities.append((kind, entity))
        state.watched = None
        return ST_OK

    @symbol("handle")
    def _dcgmGroupGetInfo(self, conn: _Connection, state: State, group_id: Any, out: Any) -> int:
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
    def _dcgmGroupGetAllIds(self, conn: _Connection, state: State, ids: Any, count: Any) -> int:
        for i, group_id in enumerate(state.groups):
            ids[i] = group_id
        count._obj.value = len(state.groups)
        return ST_OK

    # -- field groups --------------------------------------------------------------------------

    @symbol("handle")
    def _dcgmFieldGroupCreate(
        self, conn: _Connection, state: State, count: Any, ids: Any, name: Any, out: Any
    ) -> int:
        array = getattr(ids, "_obj", ids)
        field_ids = [int(array[i]) for i in range(_int(count))]
        owner = self._owner(conn)
        out._obj.value = conn.engine.field_group_create(state, field_ids, _text(name), owner)
        return ST_OK

    @symbol("handle")
    def _dcgmFieldGroupDestroy(self, conn: _Connection, state: State, fg_id: Any) -> int:
        if state.field_groups.pop(_int(fg_id), None) is None:
            return ST_NO_DATA
        state.watches = {k: w for k, w in state.watches.items() if w.field_group != _int(fg_id)}
        state.watched = None
        return ST_OK

    def _fill_field_group(self, info: Any, fg_id: int, fg: FieldGroup) -> None:
        info.fieldGroupId = fg_id
        info.fieldGroupName = fg.name.encode()
        info.numFieldIds = len(fg.field_ids)
        for i, fid in enumerate(fg.field_ids):
            info.fieldIds[i] = fid

    @symbol("handle")
    def _dcgmFieldGroupGetInfo(self, conn: _Connection, state: State, out: Any) -> int:
        info = out._obj
        fg = state.field_groups.get(_int(info.fieldGroupId))
        if fg is None:
            return ST_NO_DATA
        self._fill_field_group(info, _int(info.fieldGroupId), fg)
        return ST_OK

    @symbol("handle")
    def _dcgmFieldGroupGetAll(self, conn: _Connection, state: State, out: Any) -> int:
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
        state: State,
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
    def _dcgmUnwatchFields(self, conn: _Connection, state: State, group_id: Any, fg_id: Any) -> int:
        conn.engine.unwatch(state, _int(group_id), _int(fg_id), self._owner(conn))
        return ST_OK

    @symbol("handle")
    def _dcgmUpdateAllFields(self, conn: _Connection, state: State, wait: Any) -> int:
        return ST_OK  # samples exist from the moment a watch is set

    def _latest(self, conn: _Connection, state: State, group_id: Any, fg_id: Any) -> list[Row]:
        entities = conn.engine.group_entities(state, _int(group_id))
        fg = state.field_groups.get(_int(fg_id))
        if entities is None or fg is None:
            raise Status(ST_BADPARAM)
        return conn.engine.values(entities, fg.field_ids)

    def _enumerate(self, callback: Any, user_data: Any, rows: list[Row], per_entity: bool) -> bool:
        """Call the enumeration callback once per value, as libdcgm's helperGetLatestValues
        does (a dcgmFieldValue_v1 array of one), and stop at the first nonzero return;
        True if the walk ended. A Python callback that raised returns whatever ctypes left
        in the result (ctypes reports the exception through sys.unraisablehook): libdcgm
        reads garbage, which stopped the walk under the real bindings; so does the fake."""
        array_type = callback.argtypes[2 if per_entity else 1]
        writer = self._writer(array_type, 1)
        address = id(getattr(user_data, "value", user_data))
        array = (array_type._type_ * 1)()
        with _callback_errors() as raised:
            for row in rows:
                kind, entity = row[0], row[1]
                writer.write(array, 0, row)
                if per_entity:
                    result = callback(kind, entity, array, 1, address)
                else:
                    result = callback(entity, array, 1, address)
                if result or raised:
                    return False
        return True

    @symbol("handle")
    def _dcgmGetLatestValues(
        self, conn: _Connection, state: State, group_id: Any, fg_id: Any, cb: Any, data: Any
    ) -> int:
        rows = [r for r in self._latest(conn, state, group_id, fg_id) if r[0] == FE_GPU]
        self._enumerate(cb, data, rows, False)
        return ST_OK  # a callback that asked to stop is no error

    @symbol("handle")
    def _dcgmGetLatestValues_v2(
        self, conn: _Connection, state: State, group_id: Any, fg_id: Any, cb: Any, data: Any
    ) -> int:
        self._enumerate(cb, data, self._latest(conn, state, group_id, fg_id), True)
        return ST_OK

    @symbol("handle")
    def _dcgmGetValuesSince_v2(
        self,
        conn: _Connection,
        state: State,
        group_id: Any,
        fg_id: Any,
        since: Any,
        next_since: Any,
        cb: Any,
        data: Any,
    ) -> int:
        rows = [r for r in self._latest(conn, state, group_id, fg_id) if r[6] > _int(since)]
        if self._enumerate(cb, data, rows, True):  # a stopped walk leaves the timestamp
            next_since._obj.value = max([r[6] for r in rows], default=_int(since)) + 1
        return ST_OK

    @symbol("handle")
    def _dcgmEntityGetLatestValues(
        self,
        conn: _Connection,
        state: State,
        kind: Any,
        entity: Any,
        ids: Any,
        count: Any,
        out: Any,
    ) -> int:
        field_ids = [int(ids[i]) for i in range(_int(count))]
        rows = conn.engine.values([(_int(kind), _int(entity))], field_ids)
        writer = self._writer(type(out), 1)
        for i, row in enumerate(rows):
            writer.write(out, i, row)
        return ST_OK

    @symbol("handle")
    def _dcgmEntitiesGetLatestValues(
        self,
        conn: _Connection,
        state: State,
        entities: Any,
        entity_count: Any,
        ids: Any,
        id_count: Any,
        flags: Any,
        out: Any,
    ) -> int:
        """dcgmEntitiesGetLatestValues: entityCount x fieldCount values, entity by entity and
        field by field, into `out` (dcgmFieldValue_v2), as libdcgm's one request for the
        latest values (cached; live with DCGM_FV_FLAG_LIVE_DATA)."""
        n_entities, n_ids = _int(entity_count), _int(id_count)
        if entities is None or ids is None or out is None or n_entities < 1 or n_ids < 1:
            return ST_BADPARAM
        if n_entities > GROUP_MAX_ENTITIES or n_ids > MAX_FIELD_IDS:
            return ST_BADPARAM
        pairs = _pairs(entities, n_entities)
        field_ids = list(ids[:n_ids])
        rows = conn.engine.values(pairs, field_ids, live=bool(_int(flags) & 1))
        writer = self._writer(type(out), 2)
        for i, row in enumerate(rows):
            writer.write(out, i, row)
        return ST_OK

    # -- profiling ------------------------------------------------------------------------------

    @symbol("handle")
    def _dcgmProfGetSupportedMetricGroups(self, conn: _Connection, state: State, out: Any) -> int:
        engine, msg = conn.engine, out._obj
        gpu = engine.nvml_index(int(msg.gpuId))
        if gpu is None:
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
    def _dcgmProfPause(self, conn: _Connection, state: State) -> int:
        if conn.engine.gpm():
            return ST_NOT_SUPPORTED
        state.profiling_paused = True
        return ST_OK

    @symbol("handle")
    def _dcgmProfResume(self, conn: _Connection, state: State) -> int:
        if conn.engine.gpm():
            return ST_NOT_SUPPORTED
        state.profiling_paused = False
        return ST_OK
