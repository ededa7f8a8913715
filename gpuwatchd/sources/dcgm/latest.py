"""Reading a watch's latest values: one `dcgmEntitiesGetLatestValues` call, decoded in bulk.

pydcgm's `DcgmGroupSamples.GetLatest_v2` calls `dcgmGetLatestValues_v2`, which hands the
values to a Python callback once per GPU; the callback wraps every value in a
`DcgmFieldValue` (a dozen attribute reads through the bindings' decoding
`__getattribute__`) and files it in dicts of time series. That was most of gpuwatchd's
own CPU in a DCGM poll. `dcgm_agent.dcgmEntitiesGetLatestValues(handle, entities,
fieldIds, flags)` (DCGM 2.x to 4.6, same signature and struct) returns the same latest
cached values (libdcgm serves both from the host engine's one "latest values" request,
entity by entity, field by field) in one array of `dcgmFieldValue_v2`, which carries
each value's entity: it is decoded here with `struct.iter_unpack` at the offsets of the
bindings' own ctypes struct, with no per-value ctypes object.

The decoding is DcgmFieldValue's: a non-OK status, or a value at or above
`DCGM_INT64_BLANK`/`DCGM_FP64_BLANK` (or a "<<<...>>>" text), is blank and left out;
int64 and timestamp values become floats as the source exports them; a text value is
returned as is (a binary one as a description), for the source to report as not a number.

Bindings without `dcgmEntitiesGetLatestValues` or `c_dcgmFieldValue_v2` (none known), or
a libdcgm without the symbol (DCGM_ST_FUNCTION_NOT_FOUND), fall back to
`dcgmGetLatestValues_v2` with a callback of our own (`read_by_callback`), never pydcgm's:
libdcgm calls the callback once per value and stops its walk at a nonzero return, and a
Python callback that raises (pydcgm's, at a blob: "Blobs not handled yet") returns
whatever ctypes left in the result, so every value after it, other GPUs' included, was
lost, with a traceback per poll. Ours decodes each value by the same rules and never
raises: a value it cannot decode is skipped, counted and logged once.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from gpuwatchd.sources.dcgm.fields import FE_GPU

log = logging.getLogger(__package__)

# dcgm_fields.DCGM_FT_*: chars, stored in dcgmFieldValue_v2.fieldType as their code
FT_DOUBLE, FT_INT64, FT_TIMESTAMP, FT_STRING = (ord(c) for c in "dits")

Value = tuple[int, int, Any]  # (DCGM entity id, field id, float | something not a number)
# one value as read: (entity group, entity, field, type, status, int64, double, its buffer,
# its index there)
Record = tuple[int, int, int, int, int, int, float, Any, int]

_CODES = {1: "b", 2: "h", 4: "i", 8: "q"}  # by size; upper case when unsigned


def _code(ctype: Any) -> str | None:
    """The struct module's code for a ctypes integer type (None: not an integer)."""
    kind = getattr(ctype, "_type_", None)
    if not isinstance(kind, str) or len(kind) != 1 or kind.lower() not in "bhilq":
        return None
    code = _CODES.get(ctypes.sizeof(ctype))
    return code.upper() if code and kind.isupper() else code


class Layout:
    """Where dcgmFieldValue_v2's members are, read off the bindings' own ctypes struct:
    two `struct.Struct`s, one per record, reading (entityGroupId, entityId, fieldId,
    fieldType, status, value as int64) and (value as double)."""

    MEMBERS = ("entityGroupId", "entityId", "fieldId", "fieldType", "status")
    V1_MEMBERS = ("fieldId", "fieldType", "status")  # dcgmFieldValue_v1: no entity

    def __init__(self, struct_type: Any, members_read: tuple[str, ...] = MEMBERS) -> None:
        types = {name: kind for name, kind, *_ in struct_type._fields_}
        self.stride = ctypes.sizeof(struct_type)
        members = [(getattr(struct_type, m).offset, _code(types[m])) for m in members_read]
        if any(code is None for _, code in members):
            raise TypeError(f"{struct_type.__name__} members are not the expected integers")
        value = struct_type.value
        text = getattr(types["value"], "str", None)
        self.text = (value.offset + (text.offset if text else 0), text.size if text else 256)
        self.ints = self._struct([*members, (value.offset, "q")])
        self.doubles = self._struct([(value.offset, "d")])
        self.value_offset = value.offset
        self._head = self._struct(members).format[1:]  # one record's members, padded
        self._heads: dict[int, struct.Struct] = {}

    def heads(self, count: int) -> struct.Struct:
        """Reads the members (not the value) of `count` records in one call."""
        heads = self._heads.get(count)
        if heads is None:
            if len(self._heads) >= 16:
                self._heads.clear()
            heads = self._heads[count] = struct.Struct("=" + self._head * count)
        return heads

    def _struct(self, members: list[tuple[int, str | None]]) -> struct.Struct:
        fmt, at = "=", 0
        for offset, code in sorted(members):
            assert code is not None
            if offset < at:
                raise TypeError("overlapping dcgmFieldValue members")
            fmt += f"{offset - at}x" if offset > at else ""
            fmt += code
            at = offset + struct.calcsize("=" + code)
        if at > self.stride:
            raise TypeError("dcgmFieldValue is shorter than its members")
        return struct.Struct(fmt + (f"{self.stride - at}x" if self.stride > at else ""))


class Plan:
    """What an array whose records have these members (`head`: entity group, entity, field,
    type, status, record by record) holds, by `_decode`'s rules: the numbers of entity group
    `wanted` (`keys`: their (entity, field)), read by `values` in one call, with a number at
    or above its `limits` blank; `values` None: text or blobs, decoded one by one. Kept
    while the records' members read the same (the same watch, fields, GPUs and statuses)."""

    def __init__(self, owner: LatestValues, layout: Layout, head: tuple[int, ...], wanted: int):
        self.head = head
        self.keys: list[tuple[int, int]] = []
        self.watched = False
        self.failed: set[int] = set()
        members: list[tuple[int, str | None]] = []
        limits: list[float] = []
        numbers = {FT_DOUBLE: ("d", owner.fp64_blank), FT_INT64: ("q", owner.int64_blank)}
        numbers[FT_TIMESTAMP] = numbers[FT_INT64]
        bulk = True
        records = zip(*(head[m::5] for m in range(5)), strict=True)
        for k, (group, entity, fid, kind, status) in enumerate(records):
            if status != owner.ok:
                self.watched = self.watched or status != owner.not_watched
                if status not in owner._quiet_statuses:
                    self.failed.add(entity)
                continue
            self.watched = True
            if group != wanted:
                continue
            code, limit = numbers.get(kind, (None, 0.0))
            bulk = bulk and code is not None
            self.keys.append((entity, fid))
            members.append((k * layout.stride + layout.value_offset, code))
            limits.append(limit)
        self.limits = tuple(limits)
        self.values = _values_struct(members) if bulk else None
        self.entities = list(dict.fromkeys(entity for entity, _ in self.keys))
        self._found: dict[int, list[tuple[int, int]]] = {}

    def find(self, field: int) -> list[tuple[int, int]]:
        """(index in the values, entity) of the values of `field`."""
        found = self._found.get(field)
        if found is None:
            keys = enumerate(self.keys)
            found = self._found[field] = [(j, e) for j, (e, f) in keys if f == field]
        return found


class Columns(NamedTuple):
    """One read's numbers as its plan reads them (blanks in; `Plan.limits` tell them)."""

    plan: Plan
    values: tuple[float, ...]


def _values_struct(members: list[tuple[int, str | None]]) -> struct.Struct:
    fmt, at = "=", 0
    for offset, code in members:  # in the records' order: offsets rise
        assert code is not None
        fmt += (f"{offset - at}x" if offset > at else "") + code
        at = offset + 8
    return struct.Struct(fmt)


class LatestValues:
    """Reads watches' latest values through `dcgmEntitiesGetLatestValues` (see above)."""

    def __init__(self, bindings: Any) -> None:
        structs, value = bindings.structs, bindings.value
        self.structs = structs
        self.fetch: Callable[..., Any] | None = getattr(
            bindings.agent, "dcgmEntitiesGetLatestValues", None
        )
        self.layout: Layout | None = None
        try:
            self.layout = Layout(structs.c_dcgmFieldValue_v2)
        except (AttributeError, KeyError, TypeError) as e:
            log.info("dcgm: not reading values in bulk (dcgmFieldValue_v2: %s)", e)
        self.pair: Any = getattr(structs, "c_dcgmGroupEntityPair_t", None)
        self.ok = structs.DCGM_ST_OK
        self.not_watched = getattr(structs, "DCGM_ST_NOT_WATCHED", -16)
        self.int64_blank = value.DCGM_INT64_BLANK
        self.fp64_blank = value.DCGM_FP64_BLANK
        self._pairs: dict[tuple[int, ...], list[Any]] = {}
        # entities of the last read that answered an error (a MIG GPU instance destroyed:
        # DCGM_ST_INSTANCE_NOT_FOUND), other than "not watched" and "no data"
        self.failed: set[int] = set()
        self._quiet_statuses = {
            self.not_watched,
            getattr(structs, "DCGM_ST_NO_DATA", -14),
            getattr(structs, "DCGM_ST_NOT_SUPPORTED", -6),
            getattr(structs, "DCGM_ST_GPU_IS_LOST", -18),  # the GPU's own state says it
        }
        # the fallback: dcgmGetLatestValues_v2 and our own callback (see the module's doc)
        self._agent = bindings.agent
        self._v1 = Layout(structs.c_dcgmFieldValue_v1, Layout.V1_MEMBERS)
        self._callback = bindings.agent.dcgmFieldValueEntityEnumeration_f(self._on_values)
        self._records: list[Record] = []
        self.callback_errors = 0  # values the callback could not decode (logged once)

    @property
    def available(self) -> bool:
        return self.fetch is not None and self.layout is not None and self.pair is not None

    def unavailable(self, why: str) -> None:
        log.info("dcgm: reading values with dcgmGetLatestValues_v2 instead (%s)", why)
        self.fetch = None

    def read(
        self,
        handle: Any,
        gpus: list[int],
        field_ids: list[int],
        group: int = FE_GPU,
        flags: int = 0,
    ) -> list[Value]:
        """The non-blank latest values of `field_ids` on the entities `gpus` (DCGM ids) of
        entity group `group` (GPUs; FE_GPU_I: MIG GPU instances), in the order DCGM
        returns them. Raises DCGMError; DCGM_ST_NOT_WATCHED when every value says so: our
        watch is gone (another client removed our group or field group)."""
        read = self.columns(handle, gpus, field_ids, group, flags)
        if not isinstance(read, Columns):
            return read
        plan = read.plan
        rows = zip(plan.keys, read.values, plan.limits, strict=True)
        # a NaN is not blank
        return [(e, fid, float(n)) for (e, fid), n, limit in rows if not n >= limit]

    def columns(
        self,
        handle: Any,
        gpus: list[int],
        field_ids: list[int],
        group: int = FE_GPU,
        flags: int = 0,
        last: Plan | None = None,
    ) -> Columns | list[Value]:
        """`read`'s values as `Columns`, blanks in (`last`: the plan of this watch's last
        read, kept if the records read the same); where the array holds text or blobs,
        `read`'s list."""
        assert self.fetch is not None and self.layout is not None
        key = (group, *gpus)
        pairs = self._pairs.get(key)
        if pairs is None:
            if len(self._pairs) >= 64:  # MIG layouts come and go: keep the cache small
                self._pairs.clear()
            pairs = self._pairs[key] = [self.pair(group, gpu) for gpu in gpus]
        array = self.fetch(handle, pairs, field_ids, flags)
        layout = self.layout
        head = layout.heads(len(array)).unpack_from(array)
        plan = last if last is not None and last.head == head else Plan(self, layout, head, group)
        self.failed = plan.failed
        if not plan.watched and field_ids and gpus:
            raise self.structs.DCGMError(self.not_watched)
        if plan.values is None:
            ints, doubles = layout.ints.iter_unpack(array), layout.doubles.iter_unpack(array)
            rows = zip(ints, doubles, strict=True)
            records = (
                (group, entity, fid, kind, status, i64, dbl, array, k)
                for k, ((group, entity, fid, kind, status, i64), (dbl,)) in enumerate(rows)
            )
            return self._decode(layout, records, bool(field_ids and gpus), group)
        return Columns(plan, plan.values.unpack_from(array))

    def read_by_callback(
        self,
        handle: Any,
        group_id: Any,
        field_group_id: Any,
        gpus: list[int],
        field_ids: list[int],
        group: int = FE_GPU,
    ) -> list[Value]:
        """`read`, through dcgmGetLatestValues_v2 on our group and field group (a libdcgm
        without dcgmEntitiesGetLatestValues): the same values, by the same rules."""
        self._records = []
        try:
            self._agent.dcgmGetLatestValues_v2(
                handle, group_id, field_group_id, self._callback, None
            )
            records = self._records
        finally:
            self._records = []
        return self._decode(self._v1, records, bool(field_ids and gpus), group)

    def _on_values(self, group: int, entity: int, values: Any, count: int, _: Any) -> int:
        """libdcgm's enumeration callback: keeps each value's record. It must never raise
        (see the module's doc), so it always returns 0: go on."""
        try:
            v1 = self._v1
            address = ctypes.cast(values, ctypes.c_void_p).value or 0
            for k in range(count):
                raw = ctypes.string_at(address + k * v1.stride, v1.stride)
                fid, kind, status, i64 = v1.ints.unpack(raw)
                (dbl,) = v1.doubles.unpack(raw)
                self._records.append((group, entity, fid, kind, status, i64, dbl, raw, 0))
        except Exception as e:  # noqa: BLE001 - raising here would stop libdcgm's walk
            self.callback_errors += 1
            if self.callback_errors == 1:
                log.warning("dcgm: a DCGM value could not be decoded; left out (%r)", e)
        return 0

    def _decode(
        self, layout: Layout, records: Iterable[Record], expected: bool, wanted: int = FE_GPU
    ) -> list[Value]:
        """DcgmFieldValue's rules (see the module's doc) over (entity group, entity, field,
        type, status, int64, double, buffer, index in it) records of entity group `wanted`."""
        ok, int64_blank, fp64_blank = self.ok, self.int64_blank, self.fp64_blank
        out: list[Value] = []
        append = out.append
        watched = False
        self.failed = failed = set()
        for group, entity, fid, kind, status, i64, dbl, buffer, k in records:
            if status != ok:
                watched = watched or status != self.not_watched
                if status not in self._quiet_statuses:
                    failed.add(entity)
                continue
            watched = True
            if group != wanted:
                continue
            if kind == FT_DOUBLE:
                if not dbl >= fp64_blank:  # DCGM_FP64_IS_BLANK: a NaN is not blank
                    append((entity, fid, dbl))
            elif kind in (FT_INT64, FT_TIMESTAMP):
                if i64 < int64_blank:
                    append((entity, fid, float(i64)))
            elif kind == FT_STRING:
                text = _text(layout, buffer, k)
                if not (text.startswith("<<<") and ">>>" in text):  # DCGM_STR_IS_BLANK
                    append((entity, fid, text))
            else:  # a blob (or a type this DCGM added): not a number either
                append((entity, fid, f"<a value of DCGM type {chr(kind)!r}>"))
        if not watched and expected:
            raise self.structs.DCGMError(self.not_watched)
        return out


def _text(layout: Layout, buffer: Any, k: int) -> str:
    offset, size = layout.text
    start = k * layout.stride + offset
    raw = bytes(memoryview(buffer).cast("B")[start : start + size])
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
