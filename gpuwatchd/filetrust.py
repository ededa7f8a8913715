"""Whether a file the daemon acts on (its config, rule and web config files, the TLS
files the web config names, and DCGM's Python bindings that it imports) may be trusted:
writable by no one but root and the daemon's own user, with every directory above it,
as sshd's StrictModes asks of authorized_keys (issue 41). Whoever can write the config
can point `sources.dcgm.bindings_path` at code the daemon imports, `procfs` at a tree of
their own, or `web_config_file` at their own users; whoever can write the rules can
silence a cause or page on-call for nothing; whoever can write the bindings runs code as
the daemon; whoever can write the web config's client CA mints client certificates it
accepts.

A directory others may write is still safe when it is sticky (they cannot rename or
remove what root or the daemon owns in it: /tmp) or mounted read-only (a Kubernetes
ConfigMap's volume is mode 0777 on a read-only mount). A group may write where every
user in it is root or the daemon's user (Debian's OpenSSH allows a user's private
group the same way).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path


def distrust(real: str, st: os.stat_result) -> str | None:
    """Why the file at `real` (a path without links; `st`: the opened file's stat) is
    not to be trusted, or None if it is."""
    if (why := _distrust(real, st, "")) is not None:
        return why
    for directory in map(str, Path(real).parents):
        if why := _distrust(directory, os.stat(directory), f"its directory {directory} is "):
            return why
    return None


def refusal(real: str, st: os.stat_result) -> str | None:
    """Why a file the daemon reads settings from (at `real`, a path without links; `st`:
    its stat) is not read: not a regular file (a FIFO would hold its reader until someone
    writes to it), or not to be trusted (`distrust`); None if it may be read."""
    if not stat.S_ISREG(st.st_mode):
        return "cannot read: not a regular file"
    why = distrust(real, st)
    return None if why is None else f"refused: {why}"


def distrust_tree(real: str) -> str | None:
    """Why the directory at `real` (a path without links), a directory above it, or
    anything below it is not to be trusted ("PATH: why"), or None if all of it is: what
    Python may import from a directory on sys.path is any file below it (modules,
    packages, `__pycache__`'s compiled code, extension modules). A link is judged by
    where it leads, with that place's directories and, for a directory, all below it."""
    if (why := distrust(real, os.stat(real))) is not None:
        return f"{real}: {why}"
    pending, seen, count = [real], {real}, 0
    while pending:
        entries = sorted(_entries(pending.pop()), key=lambda e: e.name)
        for entry in entries:
            count += 1
            if count > MAX_TREE_ENTRIES:  # a link to / would walk the whole file system
                return f"{real}: more than {MAX_TREE_ENTRIES} files below it: {_MODULES}"
            try:
                where, st, why = _judge(entry)
            except FileNotFoundError:  # gone since listed (a .pyc's temporary file)
                continue
            if why is not None:
                return f"{entry.path}: {why}"
            if st is not None and stat.S_ISDIR(st.st_mode) and where not in seen:
                seen.add(where)  # a loop of links is walked once
                pending.append(where)
    return None


MAX_TREE_ENTRIES = 10_000
_MODULES = "expected a directory of Python modules"


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as scan:
            return list(scan)
    except FileNotFoundError:  # removed since listed: nothing in it can be imported
        return []


def _judge(entry: os.DirEntry[str]) -> tuple[str, os.stat_result | None, str | None]:
    """(where `entry` leads, its stat, why it is not to be trusted or None)."""
    if not entry.is_symlink():
        st = entry.stat(follow_symlinks=False)
        return entry.path, st, _distrust(entry.path, st, "")  # its directory: checked
    where = os.path.realpath(entry.path)
    try:
        st = os.stat(where)
    except OSError as e:  # whoever can write where it leads could put code there
        return where, None, f"a link to {where}, which cannot be read: {e.strerror}"
    return where, st, distrust(where, st)


def _distrust(path: str, st: os.stat_result, what: str) -> str | None:
    trusted = {0, os.geteuid()}
    if st.st_uid not in trusted:
        return (
            f"{what}owned by {_user(st.st_uid)}, who may change it: expected root or the "
            f"daemon's user, {_user(os.geteuid())} (chown root {path})"
        )
    if not st.st_mode & 0o022 or _read_only(path):
        return None
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return None  # others cannot replace what root or the daemon owns in it
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_mode & 0o002:
        return f"{what}writable by anyone ({mode}): {_EXPECTED} (chmod o-w {path})"
    if _only_trusted_in(st.st_gid, trusted):
        return None
    return (
        f"{what}writable by group {_group(st.st_gid)} ({mode}), which has users other than "
        f"root and the daemon's: {_EXPECTED} (chmod g-w {path})"
    )


_EXPECTED = "expected only root or the daemon's user to be able to write it"


def _read_only(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _only_trusted_in(gid: int, trusted: set[int]) -> bool:
    """Whether group `gid` has users, and only `trusted` ones (listed, or as their
    primary group)."""
    try:
        listed = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return False
    names = {p.pw_name for p in pwd.getpwall() if p.pw_uid in trusted}
    members = listed | {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid}
    return bool(members) and members <= names


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"
