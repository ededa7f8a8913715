#!/bin/bash
# Slurm epilog: write `gpuwatchd report` for the job that just ended next to its output,
# as slurm-<jobid>.gpuwatchd.txt in the directory of its StdOut (else its WorkDir), the
# way users find `seff` output. docs/report.md explains the set-up.
#
# slurm.conf (on every compute node; the epilog runs as root on each node of the job):
#   Epilog=/etc/slurm/epilog.d/*        # or Epilog=/etc/slurm/gpuwatchd-epilog.sh
# Settings, from the environment or /etc/default/gpuwatchd-report:
#   GPUWATCHD_PROMETHEUS_URL  the Prometheus (Thanos, Mimir) with jobs.yaml's rules
#   GPUWATCHD                 the gpuwatchd command (default /opt/gpuwatchd/bin/gpuwatchd)
#   GPUWATCHD_REPORT_DELAY    seconds to wait for the last scrape and accounting
#                             evaluation (default 90: one 1m rule interval and a scrape)
#
# It never fails the job or drains the node: every error is logged and the epilog exits 0.
# The report is written in the background (the epilog must return quickly), by the job's
# user (setpriv), so it lands only where the user may write.

set -u
# shellcheck source=/dev/null
[ -r /etc/default/gpuwatchd-report ] && . /etc/default/gpuwatchd-report
GPUWATCHD=${GPUWATCHD:-/opt/gpuwatchd/bin/gpuwatchd}
DELAY=${GPUWATCHD_REPORT_DELAY:-90}
export GPUWATCHD_PROMETHEUS_URL=${GPUWATCHD_PROMETHEUS_URL:-http://localhost:9090}
PATH=/usr/bin:/bin:/usr/sbin:/sbin
log() { logger -t gpuwatchd-epilog "job ${SLURM_JOB_ID:-?}: $*"; }

[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_JOB_UID:-}" ] || exit 0
[ -x "$GPUWATCHD" ] || { log "no $GPUWATCHD"; exit 0; }

# One report per job: only on the job's first node (the epilog runs on each of them).
job=$(scontrol show job --oneliner "$SLURM_JOB_ID" 2>/dev/null) || { log "scontrol failed"; exit 0; }
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $job"; }
first=$(scontrol show hostnames "$(field NodeList)" 2>/dev/null | head -n 1)
[ "$first" = "$(hostname -s)" ] || exit 0

# Where the user looks: beside the job's output file, else in its working directory.
# (A job array's task ids and %-patterns are resolved by scontrol in StdOut.)
out=$(field StdOut)
dir=$(dirname -- "${out:-$(field WorkDir)/x}")
[ -d "$dir" ] || dir=$(field WorkDir)
target="$dir/slurm-${SLURM_JOB_ID}.gpuwatchd.txt"
# the window: from a minute before the job started (a week back if unknown) to now
if started=$(date -d "$(field StartTime)" +%s 2>/dev/null); then
    since=$((started - 60))
else
    since=7d
fi
gid=$(id -g "$SLURM_JOB_UID" 2>/dev/null || echo "$SLURM_JOB_UID")

# As the user, so root never writes into a directory the user controls.
# shellcheck disable=SC2016  # expanded by the inner shell
write='"$0" report "$1" --since "$2" >"$3.tmp" 2>&1 && mv -f "$3.tmp" "$3"'
(
    sleep "$DELAY"
    if ! setpriv --reuid="$SLURM_JOB_UID" --regid="$gid" --init-groups \
        /bin/sh -c "$write" "$GPUWATCHD" "$SLURM_JOB_ID" "$since" "$target"; then
        log "no report in $target (see $target.tmp)"
    fi
) </dev/null >/dev/null 2>&1 &
disown
exit 0
