# Shared by bin/slurm-local and bin/cluster-local (sourced, not run): the Slurm and munge
# packages, munged, stopping a daemon by pid, and the slurm.conf lines both clusters use.
# The caller sets DIR (where everything lives), MUNGE_SOCKET, PORT, REQUEUE_DELAY and die().

PACKAGES="slurmctld slurmd slurm-client munge"

alive() {  # a zombie (state Z, not yet reaped) counts as stopped
    [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
running() { [ -s "$1" ] && alive "$(cat "$1")"; }

missing_packages() {
    local p
    command -v dpkg-query >/dev/null || { echo "$PACKAGES"; return; }
    for p in $PACKAGES; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"
    done
}

install_packages() {
    local missing policy_added=0
    missing=$(missing_packages | xargs)
    [ -z "$missing" ] && return 0
    [ "$(id -u)" = 0 ] || die "missing packages: $missing; install them as root: sudo $0 install"
    command -v apt-get >/dev/null || die "missing packages: $missing, and there is no apt-get: install Slurm (slurmctld, slurmd, client commands) and munge with your package manager"
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # keep the packages' postinst from starting services
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        policy_added=1
    fi
    echo "$(basename "$0"): installing $missing"
    local status=0
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends $missing >/dev/null; } || status=$?
    [ "$policy_added" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ "$status" = 0 ] || die "apt-get install $missing failed (exit status $status)"
}

start_munge() {
    install -d -o munge -g munge -m 0755 "$DIR/munge"      # socket and pid: reachable by all
    install -d -o munge -g munge -m 0700 "$DIR/munge/private"
    if [ ! -s "$DIR/munge/private/munge.key" ]; then
        runuser -u munge -- mungekey --create --keyfile="$DIR/munge/private/munge.key"
    fi
    running "$DIR/munge/munged.pid" && return 0
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" \
        --key-file="$DIR/munge/private/munge.key" --seed-file="$DIR/munge/private/munged.seed" \
        --log-file="$DIR/munge/private/munged.log" --pid-file="$DIR/munge/munged.pid"
    local _
    for _ in $(seq 50); do
        munge -S "$MUNGE_SOCKET" -n </dev/null 2>/dev/null \
            | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged does not answer on $MUNGE_SOCKET; see $DIR/munge/private/munged.log"
}

stop_pid() {  # stop_pid NAME PIDFILE
    local pid _
    [ -s "$2" ] || return 0
    pid=$(cat "$2")
    if alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then
            echo "$(basename "$0"): $1 (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        echo "$(basename "$0"): stopped $1 (pid $pid)" >&2
    fi
    rm -f "$2"
}


# slurm_conf_common CTLHOST SLURMD_SUFFIX SLURMD_TIMEOUT: the slurm.conf lines before the nodes.
# SLURMD_SUFFIX names each slurmd's spool, pid and log file ("" for one slurmd, "-%n" for one
# per node); SLURMD_TIMEOUT is how many seconds of silence make slurmctld mark a node down.
# Job ids start at a random number: the MPICH wheel names its shared-memory segment after the
# PMI job name, which under srun is "<job id>.<step id>", and a job killed before MPI_Finalize
# leaves that segment in /dev/shm; a later cluster counting from 1 again would reuse the name,
# attach to the stale segment and fail in MPI_Init ("Message truncated; 8 bytes received").
slurm_conf_common() {
    cat <<EOF
ClusterName=local$PORT
FirstJobId=$(( (RANDOM << 15 | RANDOM) % 60000000 + 1000 ))
SlurmctldHost=$1
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$REQUEUE_DELAY
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=1
ReturnToService=2
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/d$2
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd$2.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd$2.log
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MinJobAge=300
KillWait=5
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=$3
GresTypes=gpu
EOF
}
