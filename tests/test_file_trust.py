"""Config, rule and web config files that someone other than root or the daemon's user
could write are refused, as sshd's StrictModes refuses such authorized_keys (issue 41
item 6; each test loaded the file before). A rule file refused on reload keeps the last
good rules, with the reason."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatchd import filetrust
from gpuwatchd.config import ConfigError, load_config
from gpuwatchd.filetrust import distrust_tree
from gpuwatchd.rules import RuleEngine, RuleFileWatcher, RulesError, load_rules
from gpuwatchd.store import Store
from gpuwatchd.webconfig import WebConfigError, load_web_config
from tests.test_rules_hardening import CATALOG, Jobs, names
from tests.test_rules_load import GOOD

EXPECTED = "expected only root or the daemon's user to be able to write it"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users (root)")


def config(where: Path, mode: int = 0o644) -> Path:
    path = where / "gpuwatchd.yaml"
    path.write_text("listen: 127.0.0.1:0\n")
    path.chmod(mode)
    return path


def refusal(load, path: Path) -> str:
    with pytest.raises((ConfigError, RulesError, WebConfigError)) as refused:
        load(path)
    return str(refused.value)


def test_a_config_anyone_may_write_is_refused_until_fixed(tmp_path):
    path = config(tmp_path, 0o666)
    assert refusal(load_config, path) == (
        f"{path}: refused: writable by anyone (mode 0666): {EXPECTED} (chmod o-w {path})"
    )
    path.chmod(0o644)
    assert load_config(path).listen == "127.0.0.1:0"


@as_root
def test_a_rule_file_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(GOOD)
    os.chown(path, 65534, -1)
    nobody = pwd.getpwuid(65534).pw_name
    assert refusal(load_rules, path) == (
        f"{path}: refused: owned by {nobody} (uid 65534), who may change it: expected root "
        f"or the daemon's user, root (uid 0) (chown root {path})"
    )


@as_root
def test_a_web_config_a_group_of_other_users_may_write_is_refused(tmp_path):
    other = next(p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid()))
    path = tmp_path / "web.yml"
    path.write_text("{}\n")
    os.chown(path, -1, other.pw_gid)
    path.chmod(0o664)
    message = refusal(load_web_config, path)
    assert f"{path}: refused: writable by group " in message
    assert f"which has users other than root and the daemon's: {EXPECTED}" in message
    os.chown(path, -1, 0)  # root's own group (only root in it) may write
    load_web_config(path)


def test_a_directory_anyone_may_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    path = config(shared)
    shared.chmod(0o777)  # anyone could put another file in its place
    assert f"refused: its directory {shared} is writable by anyone (mode 0777)" in refusal(
        load_config, path
    )
    shared.chmod(0o1777)  # sticky, as /tmp: nobody else can rename or remove it
    load_config(path)


def test_a_link_is_judged_by_where_it_leads(tmp_path):
    (tmp_path / "real").mkdir()
    path = config(tmp_path / "real", 0o666)
    (tmp_path / "link.yaml").symlink_to(path)
    assert f"{path}: " not in refusal(load_config, tmp_path / "link.yaml")  # named as given
    assert "writable by anyone (mode 0666)" in refusal(load_config, tmp_path / "link.yaml")


def test_a_read_only_mount_is_trusted_whatever_its_modes(tmp_path):
    """A Kubernetes ConfigMap volume: mode 0777 (kubernetes#125876) on a read-only mount."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    volume = tmp_path / "volume"
    volume.mkdir()
    path = config(volume)
    volume.chmod(0o777)
    load = f"from gpuwatchd.config import load_config; load_config({str(path)!r}); print('ok')"
    mount = f"mount --bind {volume} {volume} && mount -o remount,bind,ro {volume} {volume}"
    user = [] if os.geteuid() == 0 else ["-r"]
    ran = subprocess.run(
        ["unshare", *user, "-m", "sh", "-c", f'{mount} && {sys.executable} -c "{load}"'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "ok" not in ran.stdout and ("mount" in ran.stderr or "unshare" in ran.stderr):
        pytest.skip(f"cannot mount in a namespace here: {ran.stderr.strip()}")
    assert ran.stdout == "ok\n", ran.stderr


def test_a_rule_file_made_writable_keeps_the_last_good_rules_with_the_reason(tmp_path, caplog):
    path = tmp_path / "rules.yaml"
    path.write_text(GOOD)
    engine = RuleEngine(Store(), load_rules(path, CATALOG), lambda s: True, CATALOG)
    jobs = Jobs()
    watcher = RuleFileWatcher(engine, path, lambda: 100.0, start=jobs)
    path.write_text(GOOD.replace("cause_x", "cause_y"))
    path.chmod(0o666)
    watcher.request()
    watcher.check()
    jobs.run()
    with caplog.at_level(logging.ERROR):
        assert watcher.check() is False
    assert names(watcher) == ["cause_x"] and engine.reload_ok is False
    assert f"refused: writable by anyone (mode 0666): {EXPECTED}" in caplog.text
    path.chmod(0o644)  # the mode alone changed: the watcher sees it and loads the file
    assert watcher.check() is None and watcher.check() is None
    jobs.run()
    assert watcher.check() is True and names(watcher) == ["cause_y"]


def test_a_tree_is_walked_once_through_a_loop_of_links_and_within_a_bound(tmp_path, monkeypatch):
    """What Python may import from a directory: anything below it (distrust_tree)."""
    tree = tmp_path / "tree"
    (tree / "package").mkdir(parents=True)
    (tree / "package" / "module.py").write_text("")
    (tree / "package" / "loop").symlink_to(tree)  # a link back up: walked once
    assert distrust_tree(str(tree)) is None
    (tree / "package" / "module.py").chmod(0o666)
    assert distrust_tree(str(tree)) == (
        f"{tree / 'package' / 'module.py'}: writable by anyone (mode 0666): {EXPECTED} "
        f"(chmod o-w {tree / 'package' / 'module.py'})"
    )
    (tree / "package" / "module.py").chmod(0o644)
    monkeypatch.setattr(filetrust, "MAX_TREE_ENTRIES", 2)  # a link to / would walk it all
    assert distrust_tree(str(tree)) == (
        f"{tree}: more than 2 files below it: expected a directory of Python modules"
    )
