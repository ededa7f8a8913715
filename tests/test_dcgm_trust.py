"""DCGM's Python bindings are code the daemon imports: a bindings directory that anyone
but root or the daemon's user could change (it, a file below it, a directory above it)
is refused as gpuwatchd/filetrust.py refuses such config files. The source is down with
the reason, nothing in the directory runs, and once fixed it loads after its back-off.

Each test runs the real source on a copy of the fake bindings whose pydcgm.py leaves a
mark when it runs. Virtual time; nothing sleeps.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from collections.abc import Callable
from html import unescape
from pathlib import Path

import pytest
from dcgm_sim import Sim, sims, state_of

from gpuwatchd.scheduler import Poller
from gpuwatchd.sim.dcgm import FAKE_BINDINGS
from gpuwatchd.sources.dcgm import UntrustedBindings, load_bindings
from gpuwatchd.sources.dcgm.bindings import BINDING_MODULES
from gpuwatchd.status_page import StatusPage
from gpuwatchd.store import Store

EXPECTED = "expected only root or the daemon's user to be able to write it"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users (root)")


@pytest.fixture
def make(tmp_path: Path):
    yield from sims(tmp_path / "nodes")


@pytest.fixture
def bindings(tmp_path: Path) -> Path:
    """A copy of the fake bindings in tmp_path/dcgm/python3 (tmp_path: 0700 under the
    sticky /tmp) whose pydcgm.py creates tmp_path/ran when it is imported."""
    copy = tmp_path / "dcgm" / "python3"
    shutil.copytree(FAKE_BINDINGS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "pydcgm.py").open("a") as module:
        module.write(f"\nopen({str(tmp_path / 'ran')!r}, 'w').close()  # the test's mark\n")
    return copy


def ran(bindings: Path) -> bool:
    return (bindings.parent.parent / "ran").exists()


def other_users_group() -> int:
    return next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid())).pw_gid


# each: what makes the bindings untrusted -> (what the reason says, how to fix it)
Spoil = Callable[[Path], tuple[str, Callable[[], None]]]


def directory_anyone_may_write(b: Path):
    b.chmod(0o777)
    return f"{b}: writable by anyone (mode 0777): {EXPECTED} (chmod o-w {b})", lambda: b.chmod(
        0o755
    )


def directory_above_anyone_may_write(b: Path):
    b.parent.chmod(0o777)  # not sticky: anyone may rename python3 and put theirs there
    return f"{b}: its directory {b.parent} is writable by anyone", lambda: b.parent.chmod(0o755)


def directory_a_group_of_others_may_write(b: Path):
    os.chown(b, -1, other_users_group())
    b.chmod(0o775)
    return f"{b}: writable by group ", lambda: b.chmod(0o755)


def module_owned_by_nobody(b: Path):
    os.chown(b / "dcgm_agent.py", 65534, -1)
    nobody = pwd.getpwuid(65534).pw_name
    return (
        f"{b / 'dcgm_agent.py'}: owned by {nobody} (uid 65534), who may change it",
        lambda: os.chown(b / "dcgm_agent.py", 0, -1),
    )


def compiled_module_anyone_may_write(b: Path):
    """Python runs __pycache__/pydcgm.cpython-*.pyc instead of pydcgm.py when its header
    matches the source's size and time, which whoever writes it can arrange."""
    compiled = b / "__pycache__" / f"pydcgm.{sys.implementation.cache_tag}.pyc"
    compiled.parent.mkdir()
    compiled.write_bytes(b"")
    compiled.chmod(0o666)
    return f"{compiled}: writable by anyone (mode 0666)", compiled.unlink


def link_to_a_module_anyone_may_write(b: Path):
    elsewhere = b.parent.parent / "elsewhere"
    elsewhere.mkdir()
    (b / "dcgmvalue.py").rename(elsewhere / "dcgmvalue.py")
    (b / "dcgmvalue.py").symlink_to(elsewhere / "dcgmvalue.py")
    (elsewhere / "dcgmvalue.py").chmod(0o666)
    return f"{b / 'dcgmvalue.py'}: writable by anyone (mode 0666)", lambda: (
        elsewhere / "dcgmvalue.py"
    ).chmod(0o644)


SPOILS = [
    directory_anyone_may_write,
    directory_above_anyone_may_write,
    pytest.param(directory_a_group_of_others_may_write, marks=as_root),
    pytest.param(module_owned_by_nobody, marks=as_root),
    compiled_module_anyone_may_write,
    link_to_a_module_anyone_may_write,
]


@pytest.mark.parametrize("spoil", SPOILS)
def test_untrusted_bindings_are_refused_until_fixed(make, bindings: Path, spoil: Spoil):
    reason, fix = spoil(bindings)
    sim: Sim = make(bindings_path=bindings, interval=5.0)
    error = sim.down()
    assert state_of(error) == "not_installed"
    assert f"not_installed: DCGM's Python bindings refused: {reason}" in str(error)
    assert not ran(bindings) and not set(BINDING_MODULES) & set(sys.modules)
    fix()
    sim.advance(5)  # the back-off after one failure
    assert sim.collect().state() == "connected" and ran(bindings)


def test_load_bindings_itself_refuses_and_imports_nothing(bindings: Path):
    (bindings / "pydcgm.py").chmod(0o666)
    with pytest.raises(UntrustedBindings, match=r"pydcgm\.py: writable by anyone \(mode 0666\)"):
        load_bindings(bindings)
    assert not ran(bindings)
    (bindings / "pydcgm.py").chmod(0o644)
    assert load_bindings(bindings).pydcgm and ran(bindings)


def test_the_reason_reaches_the_poller_and_the_status_page(make, bindings: Path):
    """What `gpuwatchd doctor` lists under "sources down" is the poller's last error."""
    bindings.chmod(0o777)
    sim: Sim = make(bindings_path=bindings)
    store = Store()
    poller = Poller(sim.source, store, sim.clock.now)
    poller.poll()
    why = f"{bindings}: writable by anyone (mode 0777)"
    assert poller.health.up is False and why in (poller.health.last_error or "")
    page = StatusPage(store, [poller], sim.clock.now)
    assert why in unescape(page().decode())
