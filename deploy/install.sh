#!/usr/bin/env bash
# Install gpuwatchd on a bare-metal GPU node as a systemd service (docs/deploy.md).
#
#   deploy/install.sh [--prefix DIR] [--wheel FILE]    install or upgrade, enable, (re)start
#   deploy/install.sh [--prefix DIR] --uninstall        stop and remove (keeps /etc/gpuwatchd)
#
# --prefix DIR   the virtualenv to install into (default /opt/gpuwatchd)
# --wheel FILE   install this wheel (default: build this checkout)
# DESTDIR=ROOT   lay the files under ROOT only: no user, no systemctl (packaging, CI)
# PYTHON=EXE     the interpreter of the virtualenv (default python3, >= 3.10)
# PIP_*          passed to pip as usual, e.g. PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX
#
# Idempotent: run it again to upgrade; an existing gpuwatchd.yaml is never overwritten.
set -euo pipefail

usage() { sed -n '3,11s/^# \{0,1\}//p' "$0"; exit "${1:-0}"; }
die() { echo "install.sh: $*" >&2; exit 1; }

prefix=/opt/gpuwatchd
wheel=
uninstall=false
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
        --prefix=*) prefix=${1#*=}; shift ;;
        --wheel) wheel=${2:?--wheel needs a file}; shift 2 ;;
        --wheel=*) wheel=${1#*=}; shift ;;
        --uninstall) uninstall=true; shift ;;
        -h | --help) usage ;;
        *) echo "install.sh: unknown argument: $1" >&2; usage 2 ;;
    esac
done
case "$prefix" in
    /?*) prefix=${prefix%/} ;;
    *) die "--prefix must be an absolute directory other than /, got '$prefix'" ;;
esac

checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
destdir=${DESTDIR:-}
destdir=${destdir%/}
venv=$destdir$prefix
unit=$destdir/etc/systemd/system/gpuwatchd.service
sysusers=$destdir/etc/sysusers.d/gpuwatchd.conf
confdir=$destdir/etc/gpuwatchd
command_link=$destdir/usr/local/bin/gpuwatchd
live=false # act on this machine: the user, systemctl
if [ -z "$destdir" ]; then
    live=true
    [ "$(id -u)" -eq 0 ] || die "run as root (or set DESTDIR to lay the files elsewhere)"
fi

if $uninstall; then
    if $live && systemctl cat gpuwatchd.service >/dev/null 2>&1; then
        systemctl disable --now gpuwatchd.service
    fi
    rm -f "$unit" "$sysusers" "$command_link" "$confdir/default-rules.yaml"
    if [ -f "$venv/pyvenv.cfg" ]; then # only ever remove a virtualenv
        rm -rf "$venv"
    fi
    if $live; then
        systemctl daemon-reload
    fi
    echo "gpuwatchd removed; kept $confdir (your configuration) and the gpuwatchd user"
    exit 0
fi

# 1. the virtualenv and gpuwatchd in it (a fresh install of the package, its
#    dependencies upgraded only where they no longer satisfy it)
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
source=${wheel:-$checkout}
"$venv/bin/python" -m pip uninstall --quiet --yes gpuwatchd 2>/dev/null || true
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "$source"

# 2. the unit (for this prefix), the user's declaration, the command on PATH
install -d "$(dirname "$unit")" "$(dirname "$sysusers")" "$(dirname "$command_link")"
sed "s|/opt/gpuwatchd|$prefix|g" "$checkout/systemd/gpuwatchd.service" >"$unit"
chmod 0644 "$unit"
install -m 0644 "$checkout/systemd/gpuwatchd.sysusers.conf" "$sysusers"
ln -sfn "$prefix/bin/gpuwatchd" "$command_link"

# 3. the configuration, kept if it exists; the built-in rules of this version beside it,
#    for reference (to change them: copy to rules.yaml and set rules_file)
install -d -m 0755 "$confdir"
if [ -e "$confdir/gpuwatchd.yaml" ]; then
    echo "keeping $confdir/gpuwatchd.yaml; this version's defaults: $checkout/systemd/gpuwatchd.yaml"
else
    install -m 0644 "$checkout/systemd/gpuwatchd.yaml" "$confdir/gpuwatchd.yaml"
fi
install -m 0644 "$venv"/lib/python3*/site-packages/gpuwatchd/rules/default.yaml \
    "$confdir/default-rules.yaml"

# 4. staged under DESTDIR: the virtualenv's scripts name their final place
if [ -n "$destdir" ]; then
    { grep -rlIF -- "$venv" "$venv" || true; } | xargs -r sed -i "s|$venv|$prefix|g"
fi

# 5. on this machine: the user, then enable and (re)start
if $live; then
    systemd-sysusers "$sysusers"
    systemctl daemon-reload
    systemctl enable gpuwatchd.service
    systemctl restart gpuwatchd.service
    echo "gpuwatchd is running: systemctl status gpuwatchd; curl -s localhost:9766/healthz"
else
    echo "gpuwatchd laid under $destdir (no user created, no service started)"
fi
