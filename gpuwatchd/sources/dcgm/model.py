"""What a DCGM session (session.py) and its MIG part (mig.py) share: the records of a GPU,
a MIG GPU instance and a watch, and the session as the MIG part sees it (`Host`).

Both import this module and the session imports the MIG part; nothing here imports
either, so each arrow runs one way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gpuwatchd.metrics import Sample
from gpuwatchd.sources.dcgm.fields import FE_GPU

if TYPE_CHECKING:
    from gpuwatchd.config import DcgmConfig
    from gpuwatchd.sources.dcgm.bindings import Bindings
    from gpuwatchd.sources.dcgm.fields import FieldPlan
    from gpuwatchd.sources.dcgm.latest import LatestValues

Row = tuple[str, tuple[str, ...], float]  # a value becomes (metric, labels, scale)


@dataclass
class Gpu:
    id: int  # DCGM's GPU id
    uuid: str
    name: str
    compat: tuple[str, ...]  # dcgm-exporter's labels
    index: int | None = None  # NVML's index (None: DCGM did not say; DCGM's id stands in)
    profiling: str = "refused"  # one of PROFILING_STATES; refused until watched
    why: str = ""  # why profiling is not active
    fields: frozenset[int] = frozenset()  # profiling fields DCGM supports on this GPU
    emit: dict[int, list[Row]] = field(default_factory=dict)
    state_samples: dict[str, list[Sample]] = field(default_factory=dict)
    instances: list[Instance] = field(default_factory=list)  # its MIG GPU instances (mig.py)

    @property
    def labels(self) -> tuple[str, str]:
        return (str(self.id if self.index is None else self.index), self.uuid)

    @property
    def label(self) -> int:
        return self.id if self.index is None else self.index


@dataclass
class Instance:
    """A MIG GPU instance as DCGM names it, and what its values become."""

    entity: int  # DCGM's DCGM_FE_GPU_I id
    gpu: Gpu  # its GPU
    gi: str  # its NVML id (GPU_I_ID)
    profile: str  # its profile (GPU_I_PROFILE)
    emit: dict[int, list[Row]] = field(default_factory=dict)

    @property
    def labels(self) -> tuple[str, ...]:
        return (*self.gpu.labels, self.gi, self.profile)

    @property
    def compat(self) -> tuple[str, ...]:
        """dcgm-exporter's labels: its GPU's, with GPU_I_PROFILE and GPU_I_ID set."""
        c = self.gpu.compat
        return (*c[:5], self.profile, self.gi, *c[7:])


Owner = Gpu | Instance  # whose rows a value of an entity becomes


@dataclass
class Watch:
    group: Any  # pydcgm.DcgmGroup
    field_group: Any  # pydcgm.DcgmFieldGroup
    gpus: list[int]
    fields: list[int]  # the field group's ids
    profiling: bool
    indices: bool = False  # holds DCGM_FI_DEV_NVML_INDEX
    entity_group: int = FE_GPU  # `gpus` are GPUs, or (FE_GPU_I) MIG GPU instances
    # what its last read became (session.Made), kept for the next
    made: Any = field(default=None, compare=False, repr=False)


class Host(Protocol):
    """The session (session.Session) as its MIG part reads and uses it."""

    bindings: Bindings
    handle: Any  # pydcgm.DcgmHandle
    config: DcgmConfig
    prefix: str
    plan: FieldPlan
    gpus: dict[int, Gpu]
    latest: LatestValues
    profiling_paused: bool

    def prepare(self, gpu: Gpu) -> None: ...

    def instance_fields(self, ids: frozenset[int]) -> frozenset[int]: ...

    def watch_entities(
        self, name: str, kind: int, entities: list[int], ids: list[int], profiling: bool = True
    ) -> Watch: ...

    def drop(self, watch: Watch) -> None: ...

    def emit_watch(self, watch: Watch, owners: Mapping[int, Owner], out: list[Sample]) -> None: ...
