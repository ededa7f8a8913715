#!/usr/bin/env bash
# Session 8's read-only questions for a real GPU (bench/hardware/extras.py says which),
# ~4 minutes, everything under $OUT (one JSON per step, their stderr, a log).
#
#   OUT=/some/dir bash bench/hardware/extras.sh             # on the GPU machine
#   OUT=/some/dir bash bench/hardware/extras.sh --dry-run   # here: the fake NVML
#
# Wheels as for validate.sh (bench/hardware/prepare.sh, carried in bench/hardware/wheels).
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
[ "${1:-}" = "--dry-run" ] && export DRY_RUN=1
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "${DRY_RUN:-0}" = 1 ]; then
    PY=${PYTHON:-$repo/.venv/bin/python}
    SECONDS_EACH=${SECONDS_EACH:-6}
    export PYTHONPATH=$repo
else
    PY=${PYTHON:-python3}
    SECONDS_EACH=${SECONDS_EACH:-60}
    work=$(mktemp -d /tmp/gpuwatchd-extras.XXXXXX)
    "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
        "$here"/wheels/*.whl >"$OUT/install.txt" 2>&1 || echo "install failed" >>"$OUT/log.txt"
    export PYTHONPATH=$work/site
fi
cd /tmp || exit 2  # not the repo root: `python -m gpuwatchd` must import the installed one
limits="memory:60 mig:60 spin:150 queue:200 daemon:$((SECONDS_EACH * 3 + 90))"
for spec in $limits; do
    case " ${STEPS:-memory mig spin queue daemon} " in *" ${spec%%:*} "*) ;; *) continue ;; esac
    name=${spec%%:*} limit=${spec#*:}
    t0=$(date +%s)
    timeout -k 10 "$limit" "$PY" "$here/extras.py" "$name" "$OUT" "$SECONDS_EACH" \
        2>"$OUT/$name.stderr"
    echo "$name rc=$? $(($(date +%s) - t0))s" | tee -a "$OUT/log.txt"
    [ -s "$OUT/$name.stderr" ] || rm -f "$OUT/$name.stderr"
done
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
