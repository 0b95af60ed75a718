#!/usr/bin/env bash
# Stop the one-node Slurm cluster that jobs/local-slurm/up.sh started from CCOLL_SLURM_DIR
# (default /tmp/ccoll-slurm): cancel its jobs, stop slurmd, slurmctld and the private munged
# by the PIDs in their PID files (never by name), then remove the folder. Safe to run twice.
set -euo pipefail

DIR=${CCOLL_SLURM_DIR:-/tmp/ccoll-slurm}
MARKER=.ccoll-local-slurm
PATH=$PATH:/usr/sbin
say() { echo "local-slurm: $*" >&2; }

if [[ ! -e $DIR ]]; then
    say "nothing to stop ($DIR does not exist)"
    exit 0
fi
if [[ ! -e $DIR/$MARKER ]]; then
    say "$DIR was not made by up.sh; leaving it alone"
    exit 2
fi

# ours PIDFILE NAME: print the PID in PIDFILE if it still runs a program called NAME (a stale
# PID file may name a PID that now belongs to something else).
ours() {
    local pid
    [[ -s $1 ]] || return 0
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(</proc/"$pid"/comm) == "$2" ]] && echo "$pid"
    return 0
}

# stop NAME=PID...: SIGTERM to all at once (each daemon takes ~2 s to exit), wait up to 10 s,
# then SIGKILL whatever is left.
stop() {
    local item pid name left
    for item in "$@"; do kill -TERM "${item#*=}" 2>/dev/null || true; done
    for _ in $(seq 100); do
        left=0
        for item in "$@"; do [[ -e /proc/${item#*=} ]] && left=1; done
        (( left )) || break
        sleep 0.1
    done
    for item in "$@"; do
        name=${item%%=*} pid=${item#*=}
        if [[ -e /proc/$pid ]]; then
            say "$name ($pid) ignored SIGTERM for 10 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        else
            say "stopped $name ($pid)"
        fi
    done
}

if [[ -s $DIR/slurm.conf ]] && command -v squeue >/dev/null; then
    export SLURM_CONF=$DIR/slurm.conf
    # Cancel what still runs, so no job steps outlive slurmd.
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        say "cancelling jobs: ${jobs//$'\n'/ }"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null || true) ]] && break
            sleep 0.2
        done
    fi
fi

daemons=()
pid=$(ours "$DIR/run/slurmd.pid" slurmd) && [[ -n $pid ]] && daemons+=("slurmd=$pid")
pid=$(ours "$DIR/run/slurmctld.pid" slurmctld) && [[ -n $pid ]] && daemons+=("slurmctld=$pid")
(( ${#daemons[@]} )) && stop "${daemons[@]}"
# munged last: the Slurm daemons authenticate through it until they exit.
pid=$(ours "$DIR/munge/munged.pid" munged) && [[ -n $pid ]] && stop "munged=$pid"
rm -rf -- "$DIR"
say "removed $DIR"
