"""What one GPU's poll does, worked out once: its field-values batch (`FieldPlan`) and its
reads (`ReadPlan`), so that the poll itself makes its samples without deciding again,
per field and per read, what the tables say.

A `FieldPlan` is made with the batch (`NvmlSource._ask`); it serves a poll whose fields
all answered SUCCESS with a number, the usual case (any other: the loop over the
fields). A `ReadPlan` is made from the GPU's reads, disabled reads and call choices, and
made again when one of them changes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from gpuwatchd.sources.nvml.reads import EVERY_POLL, NVLINK_STATE, ONCE, Read, _Entry

# (to the SLOW samples?, first position, past the last, metrics, labels, scales, the
# byte counter's entry): a run of plain fields, or (with the entry) one rate field
FieldRun = tuple[
    bool, int, int, tuple[str, ...], tuple[tuple[str, ...], ...], tuple[float, ...], _Entry | None
]


class FieldPlan(NamedTuple):
    ok: tuple[int, ...]  # every field's nvmlReturn where all answered SUCCESS
    runs: tuple[FieldRun, ...]  # the fields other than the NVLink states, in order
    links: slice  # the NVLink states' positions ...
    scopes: tuple[int, ...]  # ... and their links


def field_plan(entries: list[_Entry], success: int) -> FieldPlan | None:
    """None where the NVLink states are not one run of the batch (a field asked again
    after a MIG change is appended after them): such a batch is read by the loop."""
    at = [i for i, e in enumerate(entries) if e.field is NVLINK_STATE]
    if at and at[-1] - at[0] + 1 != len(at):
        return None
    runs: list[FieldRun] = []
    for i, entry in enumerate(entries):
        field = entry.field
        if field is NVLINK_STATE:
            continue
        slow = field.every != EVERY_POLL
        last = runs[-1] if runs else None
        if field.rate:
            runs.append((slow, i, i + 1, (), (), (), entry))
        elif last is not None and last[6] is None and last[0] == slow and last[2] == i:
            _, start, _, metrics, labels, scales, _ = last
            runs[-1] = (
                slow,
                start,
                i + 1,
                (*metrics, field.metric),
                (*labels, entry.labels),
                (*scales, field.scale),
                None,
            )
        else:
            runs.append((slow, i, i + 1, (field.metric,), (entry.labels,), (field.scale,), None))
    links = slice(at[0], at[-1] + 1) if at else slice(0, 0)
    scopes = tuple(entries[i].scope for i in at)
    return FieldPlan((success,) * len(entries), tuple(runs), links, scopes)


# One step of a read plan: (read, function, args, keep, keys). A read due this poll:
# its call (function None: the binding lacks it, `_read` says so) and whether its
# samples are kept; or a run of reads not due (`keys`, `read` their tuple): their kept
# samples, where all have some.
ReadStep = tuple[Any, Any, tuple[Any, ...], bool, tuple[str, ...] | None]


class ReadPlan:
    """A GPU's reads at each phase of their cadence (`period` polls), for its reads,
    disabled reads and call choices as they were when it was made."""

    def __init__(
        self,
        reads: list[Read],
        disabled: set[str],
        choice: dict[str, int],
        calls: dict[str, list[tuple[str, Any, tuple[Any, ...]]]],
    ) -> None:
        self.reads = list(reads)
        self.disabled = set(disabled)
        self.choice = dict(choice)
        self.calls = calls
        self.period = math.lcm(*{r.every for r in reads if r.every != ONCE} or {EVERY_POLL})
        self.phases: dict[int, list[ReadStep]] = {}

    def fits(self, reads: list[Read], disabled: set[str], choice: dict[str, int]) -> bool:
        """Whether it was made from these (the calls: a GPU's are those NVML started with)."""
        return reads == self.reads and disabled == self.disabled and choice == self.choice

    def steps(self, polls: int) -> list[ReadStep]:
        phase = polls % self.period
        steps = self.phases.get(phase)
        if steps is None:
            steps = self.phases[phase] = self._steps(phase)
        return steps

    def _steps(self, phase: int) -> list[ReadStep]:
        """A read is due where its cadence says so (every poll, or every `every` polls);
        one not due gives its kept samples, or is read where it has none. A disabled read
        is left out: asked, it would give nothing and drop what it kept, and it kept
        nothing (its samples and process list went as it was found unsupported, MIG's
        disabled utilization's as MIG disabled it)."""
        steps: list[ReadStep] = []
        idle: list[Read] = []
        for read in self.reads:
            if read.key in self.disabled:
                continue
            if read.every == ONCE or phase % read.every:
                idle.append(read)
                continue
            if idle:
                steps.append((tuple(idle), None, (), False, tuple(r.key for r in idle)))
                idle = []
            _, function, args = self.calls[read.key][self.choice.get(read.key, 0)]
            steps.append((read, function, args, read.every != EVERY_POLL, None))
        if idle:
            steps.append((tuple(idle), None, (), False, tuple(r.key for r in idle)))
        return steps
