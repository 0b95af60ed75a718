#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (Debian, as root) for trying the ccoll job
# scripts: a private munged, slurmctld and slurmd, all listening on 127.0.0.1 only.
#
# Installs slurm-wlm and munge with apt-get when they are missing. Writes slurm.conf, state,
# spool, logs and PID files under CCOLL_SLURM_DIR (default /tmp/ccoll-slurm), waits until the
# node is idle, then prints the SLURM_CONF to use and writes it to $CCOLL_SLURM_DIR/env:
#
#     jobs/local-slurm/up.sh && . /tmp/ccoll-slurm/env && sbatch --wait jobs/...
#     jobs/local-slurm/down.sh          # stops exactly the daemons started here
#
# Environment: CCOLL_SLURM_DIR (folder, default /tmp/ccoll-slurm), CCOLL_SLURM_CPUS (CPUs the
# node advertises, default 4, so 4 ranks fit on 2 cores), CCOLL_SLURM_CTLD_PORT and
# CCOLL_SLURM_SLURMD_PORT (default: 6817/6818, or the first free pair from 16817 when taken).
#
# Exit status: 0 up; 1 a daemon failed to start (logs are printed); 2 this folder already
# holds a running cluster; 3 Slurm is missing and cannot be installed here (not root, no
# apt-get, or the installation failed), so nothing was started.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${CCOLL_SLURM_DIR:-/tmp/ccoll-slurm}
CPUS=${CCOLL_SLURM_CPUS:-4}
NODE=$(hostname -s 2>/dev/null || uname -n | cut -d. -f1)
MARKER=.ccoll-local-slurm

say() { echo "local-slurm: $*" >&2; }
unavailable() { say "cannot run Slurm here: $*"; exit 3; }

alive() {  # alive PIDFILE NAME: the PID in PIDFILE runs a program called NAME
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && [[ -r /proc/$pid/comm ]] && [[ $(</proc/"$pid"/comm) == "$2" ]]
}

# ---- 1. the packages -----------------------------------------------------------------------
need=(slurmctld slurmd sbatch srun sinfo munged)
missing=0
for prog in "${need[@]}"; do
    PATH=$PATH:/usr/sbin command -v "$prog" >/dev/null || missing=1
done
if (( missing )); then
    (( EUID == 0 )) || unavailable "slurm-wlm/munge are not installed and installing them needs root"
    command -v apt-get >/dev/null || unavailable "slurm-wlm/munge are not installed and there is no apt-get"
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    # The package lists may be missing or stale: update once, only when the first try fails.
    aptlog=$(mktemp)
    if ! timeout 300 apt-get install -y -q slurm-wlm munge >"$aptlog" 2>&1; then
        if ! { timeout 120 apt-get update -q \
                && timeout 300 apt-get install -y -q slurm-wlm munge; } >>"$aptlog" 2>&1; then
            tail -n 20 "$aptlog" >&2
            rm -f "$aptlog"
            unavailable "apt-get install slurm-wlm munge failed (no network to the package registry?)"
        fi
    fi
    rm -f "$aptlog"
fi
PATH=$PATH:/usr/sbin
(( EUID == 0 )) || unavailable "the daemons run as root (SlurmUser=root) and munged as user munge; run as root"
id munge >/dev/null 2>&1 || unavailable "the munge user does not exist (is the munge package installed?)"

# ---- 2. the folder, the ports, slurm.conf --------------------------------------------------
if [[ -e $DIR/$MARKER ]]; then
    if alive "$DIR/run/slurmctld.pid" slurmctld || alive "$DIR/run/slurmd.pid" slurmd \
        || alive "$DIR/munge/munged.pid" munged; then
        say "a cluster is already running from $DIR; stop it with jobs/local-slurm/down.sh"
        exit 2
    fi
    rm -rf -- "$DIR"  # left by a run whose daemons are gone
elif [[ -e $DIR ]]; then
    say "$DIR exists and was not made by up.sh; set CCOLL_SLURM_DIR to another folder"
    exit 2
fi

port_free() { [[ -z $(ss -Hltn "sport = :$1" 2>/dev/null) ]]; }
CTLD_PORT=${CCOLL_SLURM_CTLD_PORT:-}
SLURMD_PORT=${CCOLL_SLURM_SLURMD_PORT:-}
if [[ -z $CTLD_PORT || -z $SLURMD_PORT ]]; then
    for base in 6817 $(seq 16817 2 16917); do
        if port_free "$base" && port_free $((base + 1)); then
            CTLD_PORT=${CTLD_PORT:-$base}; SLURMD_PORT=${SLURMD_PORT:-$((base + 1))}; break
        fi
    done
fi
[[ -n $CTLD_PORT && -n $SLURMD_PORT ]] || { say "no free port pair for slurmctld/slurmd"; exit 1; }

mkdir -p "$DIR"/{state,spool,run,log,munge}
touch "$DIR/$MARKER"
chmod 755 "$DIR"
# munged insists on a socket folder that only its own user can write and all can enter.
chown munge: "$DIR/munge"
chmod 755 "$DIR/munge"
if ! runuser -u munge -- test -w "$DIR/munge"; then
    rm -rf -- "$DIR"
    say "user munge cannot reach $DIR (a parent folder is private?); pick a CCOLL_SLURM_DIR under /tmp"
    exit 1
fi
CONF=$DIR/slurm.conf
FIRST_JOB_ID=$(( $(od -An -N4 -tu4 /dev/urandom) % 9000000 + 1000000 ))
sed -e "s|@FIRST_JOB_ID@|$FIRST_JOB_ID|g" -e "s|@NODE@|$NODE|g" -e "s|@DIR@|$DIR|g" -e "s|@CPUS@|$CPUS|g" \
    -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
    "$HERE/slurm.conf.in" >"$CONF"
export SLURM_CONF=$CONF

fail() {
    say "$*"
    for log in "$DIR"/log/*.log "$DIR"/munge/munged.log; do
        [[ -s $log ]] && { echo "---- $log" >&2; tail -n 30 "$log" >&2; }
    done
    say "stopping what was started"
    "$HERE/down.sh" >&2 || true
    exit 1
}

# ---- 3. munge ------------------------------------------------------------------------------
KEY=/etc/munge/munge.key
if [[ ! -s $KEY ]]; then
    say "creating $KEY"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile="$KEY" --force
    else
        dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
    fi
    chown munge: "$KEY"
    chmod 400 "$KEY"
fi
# Debian's munged also expects /run/munge to exist and belong to munge.
install -d -o munge -g munge -m 755 /run/munge
runuser -u munge -- munged --key-file="$KEY" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed" \
    || fail "munged did not start"
for _ in $(seq 50); do [[ -S $DIR/munge/munge.socket ]] && break; sleep 0.1; done
[[ -S $DIR/munge/munge.socket ]] || fail "munged socket did not appear"

# ---- 4. slurmctld and slurmd (each daemonizes and writes its PID file) -------------------
slurmctld -f "$CONF" || fail "slurmctld did not start"
slurmd -f "$CONF" -N "$NODE" || fail "slurmd did not start"

# sinfo (like every Slurm client) retries for a long time when the controller is not up yet.
state=""
for _ in $(seq 60); do
    state=$(timeout 5 sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    [[ $state == idle ]] && break
    sleep 0.5
done
[[ $state == idle ]] || fail "node $NODE is not idle after 30 s (state: '${state:-no answer}')"

printf 'export SLURM_CONF=%q\n' "$CONF" >"$DIR/env"
say "node $NODE idle ($CPUS CPUs, slurmctld port $CTLD_PORT); state file $DIR/env"
echo "SLURM_CONF=$CONF"
