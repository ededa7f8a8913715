#!/usr/bin/env bash
# Issue 17: gpuwatchd on a real GPU, in one run of at most ~8 minutes; everything under
# $OUT. docs/hardware/README.md says how to run it on a lent machine and what it writes.
#
#   OUT=/some/dir bash bench/hardware/validate.sh             # on the GPU machine
#   OUT=/some/dir bash bench/hardware/validate.sh --dry-run   # here: the simulator
#
# The dry run (or DRY_RUN=1) does the same steps against `gpuwatchd run --simulate` with
# phases of a few seconds and torch on the CPU; nvidia-smi and lspci may be absent.
# Every step is time-boxed; a failing step is recorded in steps.tsv and the run goes on.
# The exit status is 0 once the outputs are written, whatever the verdict (summary.txt).
set -uo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1  # no network there: pip must not try PyPI

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
DRY_RUN=${DRY_RUN:-0}
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

started=$(date +%s)
if [ "$DRY_RUN" = 1 ]; then
    mode=dry-run
    BUDGET=${BUDGET_SECONDS:-150}
    PHASE_SECONDS=${PHASE_SECONDS:-5}
    IDLE_SECONDS=${IDLE_SECONDS:-1}
    LEAD=${LEAD_SECONDS:-6}        # daemon up -> phase a: torch's import and calibration
    SETTLE=${SETTLE_SECONDS:-3}
    TAIL=1
    PY=${PYTHON:-$repo/.venv/bin/python}
    DEVICE=cpu
else
    mode=hardware
    BUDGET=${BUDGET_SECONDS:-450}  # the run tool allows 600 s a command
    PHASE_SECONDS=${PHASE_SECONDS:-60,120,90}  # a,b,c: why in docs/hardware/README.md
    IDLE_SECONDS=${IDLE_SECONDS:-20}
    SETTLE=${SETTLE_SECONDS:-60}   # the rules' 1m/2m windows still hold phase b early in c
    TAIL=5
    PY=${PYTHON:-python3}
    DEVICE=cuda
fi
PY=$(command -v "$PY") || { echo "no python: $PY" >&2; exit 2; }
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac  # the steps run in another folder

work=$(mktemp -d /tmp/gpuwatchd-hw.XXXXXX)
res=$work/results
mkdir -p "$res"
exp=$here/experiment.py

log() { printf '%s [%4ss] %s\n' "$(date +%H:%M:%S)" "$(($(date +%s) - started))" "$*" | tee -a "$res/validate.log" >&2; }

# Results come back as at most 8 files: the key ones, and everything in one tarball.
pack() {
    local f
    for f in summary.txt summary.json doctor.json nvml.json validate.log; do
        [ -f "$res/$f" ] && cp "$res/$f" "$OUT/$f"
    done
    tar -czf "$OUT/results.tar.gz.tmp" -C "$work" results
    # a file over 16 MiB does not come back at all: then without the raw scrapes
    # (timeline.jsonl keeps what the summary uses)
    if [ "$(stat -c %s "$OUT/results.tar.gz.tmp")" -gt $((15 * 1024 * 1024)) ]; then
        tar -czf "$OUT/results.tar.gz.tmp" -C "$work" --exclude scrapes.txt.gz results
    fi
    mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}

# step NAME SECONDS OUTFILE CMD...: run CMD time-boxed (capped by what is left of the
# budget), stdout to OUTFILE, stderr to NAME.stderr; record status, rc and seconds.
# OK_RCS (default "0") lists the exit codes that count as ok.
RESERVE=25  # kept back for the analysis and packing
step() {
    local name=$1 limit=$2 outfile=$3
    shift 3
    local left=$((BUDGET - ($(date +%s) - started) - RESERVE))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        log "$name: skipped, the time budget is spent"
        printf '%s\tskipped\t-\t0\n' "$name" >>"$res/steps.tsv"
        return 1
    fi
    log "$name: start (at most ${limit}s)"
    local t0 rc status
    t0=$(date +%s.%N)
    timeout -k 10 "$limit" "$@" >"$outfile" 2>"$res/$name.stderr"
    rc=$?
    [ -s "$res/$name.stderr" ] || rm -f "$res/$name.stderr"
    status=failed
    case " ${OK_RCS:-0} " in *" $rc "*) status=ok ;; esac
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && status=timeout
    local secs
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" >>"$res/steps.tsv"
    log "$name: $status (rc $rc, ${secs}s)"
    pack
    return 0
}

# absent NAME TOOL: record a tool this machine lacks (not a failure of the script)
absent() {
    log "$1: $2 not found, recorded as absent"
    printf '%s\tabsent\t-\t0\n' "$1" >>"$res/steps.tsv"
}

cleanup() {
    local f pid
    for f in "$work"/*.pid; do  # the experiment stops both itself; this is the backstop
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        if kill -0 "$pid" 2>/dev/null; then
            log "cleanup: stopping $(basename "$f" .pid) (pid $pid)"
            kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
            sleep 2
            kill -KILL -- "-$pid" 2>/dev/null
        fi
    done
    pack
    [ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

log "gpuwatchd hardware validation, $mode: python $PY, results in $OUT, work $work"
log "phases ${PHASE_SECONDS}s, idle ${IDLE_SECONDS}s, budget ${BUDGET}s"

# -- 0. install gpuwatchd: the machine has no network, so from carried wheels ----------------
if [ "$DRY_RUN" = 1 ]; then
    log "install: dry run, using $PY's gpuwatchd"
else
    shopt -s nullglob
    wheels=("$here"/wheels/*.whl)
    shopt -u nullglob
    if [ "${#wheels[@]}" -gt 0 ]; then
        step install 120 "$res/install.txt" "$PY" -m pip install --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$work/site" "${wheels[@]}"
        export PYTHONPATH=$work/site
        export PATH=$work/site/bin:$PATH
    else
        log "install: no wheels in $here/wheels (run bench/hardware/prepare.sh here first)"
        printf 'install\tabsent\t-\t0\n' >>"$res/steps.tsv"
    fi
    # without the gpuwatchd wheel, the source tree (its dependencies must be there)
    ls "$here"/wheels/gpuwatchd-*.whl >/dev/null 2>&1 || export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$repo
fi
cd "$work" || exit 2  # not the repo root: `python -m gpuwatchd` must import the installed one

# -- 1. facts -------------------------------------------------------------------------------
# shellcheck disable=SC2016 # $1 is for the inner shell
step env 30 "$res/env.txt" bash -c '
    echo "## uname"; uname -a; echo "## cpus"; nproc; echo "## memory"; head -3 /proc/meminfo
    echo "## /dev/shm (DataLoader workers pass batches through it)"; df -h /dev/shm
    echo "## python"; "$1" -VV
    echo "## gpuwatchd"; "$1" -c "import gpuwatchd, pydantic, simpleeval; print(gpuwatchd.__version__, gpuwatchd.__file__)"
    echo "## pip list"; "$1" -m pip list 2>/dev/null' env "$PY"

if command -v nvidia-smi >/dev/null; then
    step nvidia-smi-q 30 "$res/nvidia-smi-q.txt" nvidia-smi -q
    step nvidia-smi 15 "$res/nvidia-smi.txt" nvidia-smi
else
    absent nvidia-smi nvidia-smi
fi
command -v lspci >/dev/null || absent lspci lspci

if [ "$DRY_RUN" = 1 ]; then
    step setup 60 "$res/setup.txt" "$PY" "$exp" setup "$res" --socket "$work/probe.sock" \
        --dry-run --lead "$LEAD" --phase-seconds "$PHASE_SECONDS"
    simulate=(--simulate "$res/scenario.yaml")
else
    step setup 60 "$res/setup.txt" "$PY" "$exp" setup "$res" --socket "$work/probe.sock"
    simulate=()
fi
step facts 60 "$res/facts.txt" "$PY" "$exp" facts "$res" "${simulate[@]}"
step rules-check 30 "$res/rules-check.txt" "$PY" -m gpuwatchd rules check "$res/rules.yaml"

# -- 2. doctor on the idle GPU (1: a cause holds, 3: some checks could not run; 2: failed)
if [ "$DRY_RUN" = 1 ]; then
    OK_RCS="0 1 3" step doctor 60 "$res/doctor.json" "$PY" -m gpuwatchd doctor \
        --config "$res/config.yaml" --json --simulate "$res/scenario.yaml" --at "$((LEAD / 2))"
else
    OK_RCS="0 1 3" step doctor 45 "$res/doctor.json" "$PY" -m gpuwatchd doctor \
        --config "$res/config.yaml" --json
fi

# -- 3/4. the daemon and the training phases; the daemon's CPU and RSS --------------------
left=$((BUDGET - ($(date +%s) - started) - RESERVE))
run_args=(run "$res" --config "$res/config.yaml" --socket "$work/probe.sock"
    --device "$DEVICE" --phase-seconds "$PHASE_SECONDS" --idle-seconds "$IDLE_SECONDS"
    --tail-seconds "$TAIL" --budget "$((left - 15))" --pid-dir "$work" "${simulate[@]}")
[ "$DRY_RUN" = 1 ] && run_args+=(--lead "$LEAD")
step experiment "$left" "$res/experiment.txt" "$PY" "$exp" "${run_args[@]}"

# -- 5. the summary ---------------------------------------------------------------------------
RESERVE=0 step analyze 60 "$res/analyze.txt" "$PY" "$exp" analyze "$res" --mode "$mode" \
    --settle "$SETTLE"
# once more, so that the summary lists the analyze step itself
timeout 60 "$PY" "$exp" analyze "$res" --mode "$mode" --settle "$SETTLE" >/dev/null 2>&1
[ -f "$res/summary.txt" ] && grep -E '^(verdict|gpuwatchd hardware)' "$res/summary.txt" | tee -a "$res/validate.log"
log "done in $(($(date +%s) - started))s"
