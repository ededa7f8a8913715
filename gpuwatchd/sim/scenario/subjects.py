"""What an expectation judges (`expect[].gpus`): GPUs by index, or a MIG GPU instance
as the status page names it, "0/2" (GPU 0's GPU instance 2)."""

from __future__ import annotations

import re
from typing import Literal

Subjects = Literal["all"] | list[int | str]
# a GPU's index and a GI id; "" for the GPU, its MIG instances with it
Subject = tuple[int, str]

_SUBJECT = re.compile(r"([0-9]+)(?:/([0-9]+))?")


def parse_subject(value: int | str) -> Subject:
    """3 -> (3, ""); "0/2" -> (0, "2"); anything else is a ValueError naming the field."""
    if isinstance(value, int) and value >= 0:
        return value, ""
    match = _SUBJECT.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            'gpus: expected GPU indexes (3) or MIG GPU instances as "GPU/GI id" ("0/2"), '
            f"got {value!r}"
        )
    gpu, instance = match.groups()
    return int(gpu), str(int(instance)) if instance is not None else ""


def named_subjects(gpus: Subjects) -> list[Subject]:
    """The subjects a `gpus` list names ([] for "all")."""
    return [] if gpus == "all" else [parse_subject(g) for g in gpus]


def subjects(gpus: Subjects, count: int) -> list[Subject]:
    """What an expectation judges on a node of `count` GPUs."""
    if gpus == "all":
        return [(g, "") for g in range(count)]
    return [s for s in named_subjects(gpus) if s[0] < count]


def subject_label(subject: Subject) -> str:
    """As the page names it: "3", "0/2"."""
    gpu, instance = subject
    return f"{gpu}/{instance}" if instance else str(gpu)
