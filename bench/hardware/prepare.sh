#!/usr/bin/env bash
# Run here, before lending a GPU machine to validate.sh: that machine has no network, so
# gpuwatchd and the dependencies its image lacks travel as wheels in bench/hardware/wheels
# (git-ignored; the run tool's `carry` takes it along). The image has python3 3.12 with
# torch, nvidia-ml-py, prometheus-client, psutil and pyyaml (/work/.library/device/KINDS.md);
# the rest of gpuwatchd's dependencies (pydantic, simpleeval, ...) are read from the built
# wheel and carried at the versions installed in this checkout's venv (the tested ones).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
dest=bench/hardware/wheels
buildlog=$(mktemp)
trap 'rm -f "$buildlog"' EXIT
rm -rf "$dest"
mkdir -p "$dest"

quiet() {  # run "$@", showing its output only if it fails
    "$@" >"$buildlog" 2>&1 || { cat "$buildlog" >&2; return 1; }
}

# gpuwatchd itself, from this working tree (pure Python; needs setuptools in the venv),
# built in a scratch copy: setuptools reuses ./build, where stale modules may linger
src=$(mktemp -d)
trap 'rm -f "$buildlog"; rm -rf "$src"' EXIT
cp -r pyproject.toml README.md gpuwatchd "$src"/
cp LICENSE* "$src"/ 2>/dev/null || true
find "$src" -name __pycache__ -prune -exec rm -rf {} +
quiet "$PY" -m pip wheel --no-deps --no-build-isolation -w "$dest" "$src"
wheel=$(ls "$dest"/gpuwatchd-*.whl)

# its dependencies for the device (CPython 3.12, x86-64, manylinux): a binary wheel from
# the index, else (a pure-Python package published only as an sdist) built here
pins=$("$PY" bench/hardware/experiment.py pins "$wheel")
for pin in $pins; do
    echo "carrying $pin"
    quiet "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dest" "$pin" 2>/dev/null ||
        quiet "$PY" -m pip wheel --no-deps --no-build-isolation -w "$dest" "$pin"
done

"$PY" bench/hardware/experiment.py check-wheels "$dest"
du -sh "$dest"
