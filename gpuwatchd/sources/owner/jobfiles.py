"""Per-GPU job files written by a scheduler's prolog, in dcgm-exporter's HPC convention
(`--hpc-job-mapping-dir`): a directory with one file per GPU named by its index ("0",
"1", …), or by index and MIG GPU instance id ("2.0": GPU 2's GPU instance 0, as
dcgm-exporter's hpcMapper keys a MIG series by its GPU and GPU_I_ID), each line of which
is the ID of a job on that GPU or instance. The prolog writes the file when a job starts
and the epilog removes it. A MIG instance's job is its own file's only: a whole GPU's
file on a MIG-enabled GPU names no instance.

Only the first word of a line is taken: Princeton's jobstats writes "<job> <uid>" in the
same place, and a job ID has no space. Other names and subdirectories are skipped.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpuwatchd.sources.base import read_file

_NAME = re.compile(r"([0-9]{1,4})(?:\.([0-9]{1,4}))?")
_JOB = re.compile(r"[\w.:@+-]{1,64}")


def read_job_files(directory: Path) -> dict[int, list[str]]:
    """GPU index -> the job IDs its files list, its own file's before its MIG instances'
    (in instance order); {} when the directory is missing (no job has run yet)."""
    jobs: dict[int, list[str]] = {}
    for (gpu, _), ids in read_job_map(directory).items():
        jobs.setdefault(gpu, []).extend(ids)
    return jobs


def read_job_map(directory: Path) -> dict[tuple[int, int], list[str]]:
    """(GPU index, MIG GPU instance id or -1 for the whole GPU's file) -> the job IDs of
    that file, in that order; {} when the directory is missing."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    named = [(key, e) for e in entries if (key := _key(e.name)) is not None]
    jobs: dict[tuple[int, int], list[str]] = {}
    for key, entry in sorted(named, key=lambda item: item[0]):
        try:
            if not entry.is_file():
                continue
            text = read_file(entry.path, 4096).decode("utf-8", "replace")
        except OSError:
            continue  # removed by an epilog while listed
        words = [line.split()[0] for line in text.splitlines() if line.strip()]
        ids = [word for word in words if _JOB.fullmatch(word)]
        if ids:
            jobs[key] = ids
    return jobs


def _key(name: str) -> tuple[int, int] | None:
    """(GPU index, MIG instance or -1) for a job file's name; None for other names."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), int(match[2]) if match[2] else -1
