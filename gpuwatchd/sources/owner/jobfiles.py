"""Per-GPU job files written by a scheduler's prolog, in dcgm-exporter's HPC convention
(`--hpc-job-mapping-dir`): a directory with one file per GPU named by its index ("0",
"1", …), or by index and MIG GPU instance id ("2.0": GPU 2's GPU instance 0, as
dcgm-exporter's hpcMapper keys a MIG series by its GPU and GPU_I_ID), each line of which
is the ID of a job on that GPU or instance. The prolog writes the file when a job starts
and the epilog removes it. A MIG instance's job is its own file's only: a whole GPU's
file on a MIG-enabled GPU names no instance.

A line's first word is the job; a second, where it is a number, the uid of the job's
owner (Princeton's jobstats writes "<job> <uid>" in the same place): under the shipped
unit's PrivateUsers=yes the kernel shows 65534 for other users, and Slurm's cgroup v2
paths name no uid, so this is how a Slurm v2 job's user is known (issue 41). Other names
and subdirectories are skipped.

These files say who owns a GPU, so only a directory no tenant can write in is read: owned
by root or the daemon's user and not writable by others (world-writable, sticky or not,
is refused and logged once), as the probe socket's is (issue 41, item 5).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from gpuwatchd.sources.base import read_file

log = logging.getLogger(__name__)

_NAME = re.compile(r"([0-9]{1,4})(?:\.([0-9]{1,4}))?")
_JOB = re.compile(r"[\w.:@+-]{1,64}")
_UID = re.compile(r"[0-9]{1,10}")
_refused: set[str] = set()  # directories already said to be unsafe


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
    return {key: [job for job, _ in lines] for key, lines in read_job_lines(directory).items()}


def read_job_lines(directory: Path) -> dict[tuple[int, int], list[tuple[str, int | None]]]:
    """As read_job_map, each job with the uid its line names (None: none); {} when the
    directory is missing or not safe."""
    try:
        entries = list(os.scandir(directory)) if _safe(directory) else []
    except (FileNotFoundError, NotADirectoryError):
        return {}
    named = [(key, e) for e in entries if (key := _key(e.name)) is not None]
    jobs: dict[tuple[int, int], list[tuple[str, int | None]]] = {}
    for key, entry in sorted(named, key=lambda item: item[0]):
        try:
            if not entry.is_file():
                continue
            text = read_file(entry.path, 4096).decode("utf-8", "replace")
        except OSError:
            continue  # removed by an epilog while listed
        lines = [parsed for line in text.splitlines() if (parsed := _line(line))]
        if lines:
            jobs[key] = lines
    return jobs


def _line(line: str) -> tuple[str, int | None] | None:
    words = line.split()
    if not words or not _JOB.fullmatch(words[0]):
        return None
    uid = words[1] if len(words) > 1 and _UID.fullmatch(words[1]) else None
    return words[0], int(uid) if uid is not None and int(uid) < 2**32 - 1 else None


def _safe(directory: Path) -> bool:
    """Owned by root or the daemon's user, and not writable by others (a tenant who can
    write there names any GPU's job and user). FileNotFoundError when missing."""
    st = os.stat(directory)
    if st.st_uid in (0, os.geteuid()) and not st.st_mode & stat.S_IWOTH:
        _refused.discard(str(directory))
        return True
    if str(directory) not in _refused:
        _refused.add(str(directory))
        log.warning(
            "job files in %s not read: the directory is owned by uid %d with mode %04o; it "
            "must be root's (or the daemon's) and not writable by other users",
            directory, st.st_uid, stat.S_IMODE(st.st_mode),
        )  # fmt: skip
    return False


def _key(name: str) -> tuple[int, int] | None:
    """(GPU index, MIG instance or -1) for a job file's name; None for other names."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), int(match[2]) if match[2] else -1
