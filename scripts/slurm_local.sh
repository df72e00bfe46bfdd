#!/usr/bin/env bash
# Starts a real one-node SLURM cluster on this machine (Debian 12 tested; as root) for tests and CI.
#   scripts/slurm_local.sh        installs slurm and munge if needed, starts them, waits
#   scripts/slurm_local.sh stop   stops slurmd, slurmctld and munged
# Idempotent: when the cluster already answers, it changes nothing. No systemd is needed: the
# daemons are started directly and log to /var/log/slurm/ (munged to /var/log/munge/).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
NODE=$(hostname -s)             # slurmd finds its NodeName by matching the short host name
log() { echo "slurm_local: $*"; }

# Is the daemon whose pid file is $1 alive? A zombie is not: where pid 1 does not reap orphans
# (some containers and VMs), a stopped daemon stays in the process table. Nor is another process
# that got the pid of a daemon killed without removing its pid file (the file /run/slurmd.pid
# names the daemon slurmd): a stale file once kept slurmd from being started at all.
# /proc: no procps needed.
alive() { local p; p=$(cat "$1" 2>/dev/null) && [ -n "$p" ] && [ -r "/proc/$p/stat" ] &&
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$(basename "$1" .pid)" ] &&
    ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$p/stat"; }
# The node's state as sinfo prints it (idle, mix, alloc, down*, drain, unk*...), empty if no
# answer; a '*' suffix means that slurmd does not answer.
node_state() { timeout 10 sinfo -h -o %t 2>/dev/null | head -1 || true; }
# Has the running slurmd registered with slurmctld? (A restarted slurmctld may show the node idle
# from its saved state before slurmd has said a word.)
registered() {
    local t p; p=$(date -r /run/slurmd.pid +%s 2>/dev/null) || return 1
    t=$(scontrol show node "$NODE" 2>/dev/null | grep -o 'SlurmdStartTime=[0-9T:-]*')
    t=${t#*=}; [ -n "$t" ] && t=$(date -d "$t" +%s 2>/dev/null) && [ "$t" -ge $((p - 2)) ]
}
# Shows the end of each daemon's log, says what went wrong and exits non-zero.
fail() {
    for f in "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" /var/log/munge/munged.log; do
        if [ -f "$f" ]; then echo "--- tail $f"; tail -15 "$f"; fi
    done
    log "$*"; exit 1
}

# --- stop ---------------------------------------------------------------------------------
if [ "${1:-}" = stop ]; then
    for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
        if alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
        for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.2; done  # it saves its state
    done
    log "stopped"; exit 0
fi

# --- already up? --------------------------------------------------------------------------
# Both daemons run and the node is idle, mixed or allocated: nothing to do. (The pid files come
# first because sinfo, with no controller to answer it, retries for about 10 s.)
if alive /run/slurmctld.pid && alive /run/slurmd.pid && command -v sinfo >/dev/null 2>&1; then
    case "$(node_state)" in idle|mix|alloc) log "cluster already up (node $NODE)"; exit 0 ;; esac
fi
[ "$(id -u)" -eq 0 ] || { log "must run as root"; exit 1; }

# --- 1. packages --------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null 2>&1; then
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive && apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/tmp/slurm_local_apt.log 2>&1 ||
        { tail -20 /tmp/slurm_local_apt.log; log "apt-get install failed"; exit 1; }
fi

# --- 2. munge (authenticates every slurm message) -----------------------------------------
mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
if [ ! -s /etc/munge/munge.key ]; then      # Debian's package usually made one already
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start"   # daemonizes itself
    for _ in $(seq 40); do munge_ok && break; sleep 0.25; done
    munge_ok || fail "munged started but a credential does not round-trip"
fi

# --- 3. slurm.conf ------------------------------------------------------------------------
# Topology (sockets/cores/threads) as slurmd itself detects it, so that the node is not drained
# for a mismatch; RealMemory 5 % below the total: slurmd drains a node with less than it says.
TOPO=$(slurmd -C | grep -o 'CPUs=.*ThreadsPerCore=[0-9]*')
MEM=$(awk '/^MemTotal:/ { print int($2 / 1024 * 0.95) }' /proc/meminfo)
mkdir -p /etc/slurm "$LOGDIR" /var/spool/slurmctld /var/spool/slurmd
cat >"$CONF" <<EOF
# Written by gacli's scripts/slurm_local.sh: a one-node test cluster.
ClusterName=gacli-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
MailProg=/bin/true
# No cgroups: processes are tracked through /proc and tasks are not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# CPUs are the consumable: two 1-CPU jobs run side by side on a 2-CPU node.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
# A requeued job waits cred_expire+1 s before it may start again (default 120 s), and pending
# jobs are looked at every 5 s (default 30-60 s): both only make the tests faster.
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=5,bf_interval=5
ReturnToService=2
SlurmdTimeout=60
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 $TOPO RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# --- 4. daemons (each daemonizes itself; a bad slurm.conf makes it exit non-zero here) -----
alive /run/slurmctld.pid || slurmctld || fail "slurmctld did not start"
alive /run/slurmd.pid || slurmd || fail "slurmd did not start"

# --- 5. wait (at most 90 s) until slurmd has registered and the node is idle ---------------
end=$((SECONDS + 90))
while [ "$SECONDS" -lt "$end" ]; do
    state=$(node_state)
    if [ "$SECONDS" -gt $((end - 85)) ] && ! alive /run/slurmd.pid; then fail "slurmd died"; fi
    case "$state" in
        idle|mix|alloc)
            if registered; then log "cluster up (node $NODE, $(sinfo -h -o %c) CPUs)"; exit 0; fi ;;
        down*|drain*|drng*|fail*)
            scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
fail "the node did not become idle in 90 s (state: '${state:-no answer}')"
