#!/usr/bin/env bash
# Starts a SLURM cluster of two nodes on this one machine (Debian 12 tested; as root) for tests and
# CI: each node is a slurmd in a network namespace of its own (its own interface, address and
# routes) and a UTS namespace of its own (its own host name), so that the two nodes have different
# names and addresses and reach each other only over a network this script makes.
#   scripts/slurm_two_nodes.sh        starts it (and munged; slurm_local.sh installs the packages)
#   scripts/slurm_two_nodes.sh stop   stops its daemons, removes its namespaces, bridge and hosts lines
# Talk to it with SLURM_CONF=/etc/slurm-gacli-two-nodes/slurm.conf in the environment of srun,
# sbatch, sinfo, squeue and scontrol. Idempotent: when the cluster already answers, it changes
# nothing.
#
# It lives beside the one-node cluster of scripts/slurm_local.sh and touches nothing of it: its own
# slurm.conf, cluster name, ports (6917/6918, not 6817/6818), state and spool directories, pid and
# log files. munge is shared. The layout:
#   bridge gacli2-br0 10.213.0.1/24 (this namespace; slurmctld answers there)
#   namespace gacli-node1: eth0 10.213.0.11/24, host name gacli-node1  (veth gacli2-v1 on the bridge)
#   namespace gacli-node2: eth0 10.213.0.12/24, host name gacli-node2  (veth gacli2-v2 on the bridge)
# /etc/hosts gets one line per node (marked "gacli-two-nodes"), so that workers find each other by
# host name. Both nodes see this machine's one file system: a run directory is shared as it would
# be on a cluster's shared file system.
set -euo pipefail

NAME=gacli-two-nodes
CONF_DIR=/etc/slurm-$NAME
CONF=$CONF_DIR/slurm.conf
LOGDIR=/var/log/slurm
RUN=/run/$NAME
SPOOL=/var/spool/$NAME
BRIDGE=gacli2-br0
NET=10.213.0
NODES=(gacli-node1 gacli-node2)
ADDRESSES=("$NET.11" "$NET.12")
CTLD_PORT=6917
SLURMD_PORT=6918
export SLURM_CONF=$CONF
log() { echo "slurm_two_nodes: $*"; }

# Is the daemon whose pid file is $1 alive (and not a zombie, nor another process that got its
# pid)? $2: the daemon's command name. As in slurm_local.sh, through /proc.
alive() { local p; p=$(cat "$1" 2>/dev/null) && [ -n "$p" ] && [ -r "/proc/$p/stat" ] &&
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] &&
    ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$p/stat"; }
# The state of each node as sinfo prints it, one line each ("gacli-node1 idle"); empty if no answer.
node_states() { timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null || true; }
fail() {
    for f in "$LOGDIR/$NAME-slurmctld.log" "$LOGDIR/$NAME"-gacli-node*.log; do
        if [ -f "$f" ]; then echo "--- tail $f"; tail -15 "$f"; fi
    done
    log "$*"; exit 1
}

# --- stop ---------------------------------------------------------------------------------
if [ "${1:-}" = stop ]; then
    for node in "${NODES[@]}"; do
        if alive "$RUN/slurmd-$node.pid" slurmd; then kill "$(cat "$RUN/slurmd-$node.pid")"; fi
    done
    if alive "$RUN/slurmctld.pid" slurmctld; then kill "$(cat "$RUN/slurmctld.pid")"; fi
    for _ in $(seq 50); do
        alive "$RUN/slurmctld.pid" slurmctld || alive "$RUN/slurmd-gacli-node1.pid" slurmd ||
            alive "$RUN/slurmd-gacli-node2.pid" slurmd || break
        sleep 0.2
    done
    for node in "${NODES[@]}"; do
        # What is left in the namespace (job steps, their tasks) goes with it.
        for pid in $(ip netns pids "$node" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns delete "$node" 2>/dev/null || true
    done
    ip link delete "$BRIDGE" 2>/dev/null || true
    sed -i "/# $NAME\$/d" /etc/hosts
    log "stopped"; exit 0
fi

# --- already up? --------------------------------------------------------------------------
up() {
    alive "$RUN/slurmctld.pid" slurmctld && alive "$RUN/slurmd-gacli-node1.pid" slurmd &&
        alive "$RUN/slurmd-gacli-node2.pid" slurmd || return 1
    [ "$(node_states | grep -cE ' (idle|mix|alloc|comp)$')" -eq 2 ]
}
if command -v sinfo >/dev/null 2>&1 && up; then log "cluster already up (${NODES[*]})"; exit 0; fi
[ "$(id -u)" -eq 0 ] || { log "must run as root"; exit 1; }

# --- 1. slurm and munge: the packages, key and munged of the one-node cluster ---------------
command -v slurmctld >/dev/null 2>&1 && [ -s /etc/munge/munge.key ] ||
    fail "slurm or munge's key is missing: run bash scripts/slurm_local.sh first (it installs them)"
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start"
    for _ in $(seq 40); do munge_ok && break; sleep 0.25; done
    munge_ok || fail "munged started but a credential does not round-trip"
fi

# --- 2. the network: a bridge here, a namespace per node with a veth pair into the bridge -----
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.1/24" dev "$BRIDGE"
fi
ip link set "$BRIDGE" up
for i in 0 1; do
    node=${NODES[$i]} veth=gacli2-v$((i + 1))
    ip netns list | grep -qw "^$node" || ip netns add "$node"
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip link add "$veth" type veth peer name eth0 netns "$node"
        ip link set "$veth" master "$BRIDGE"
        ip -n "$node" addr add "${ADDRESSES[$i]}/24" dev eth0
    fi
    ip link set "$veth" up
    ip -n "$node" link set lo up
    ip -n "$node" link set eth0 up
    grep -q " $node # $NAME\$" /etc/hosts || echo "${ADDRESSES[$i]} $node # $NAME" >>/etc/hosts
done

# --- 3. slurm.conf ------------------------------------------------------------------------
# Each node claims the machine's CPUs (they share them); memory is not a consumable here.
TOPO=$(slurmd -C | grep -o 'CPUs=.*ThreadsPerCore=[0-9]*')
mkdir -p "$CONF_DIR" "$LOGDIR" "$RUN" "$SPOOL/ctld"
for node in "${NODES[@]}"; do mkdir -p "$SPOOL/$node"; chmod 755 "$SPOOL/$node"; done
cat >"$CONF" <<EOF
# Written by gacli's scripts/slurm_two_nodes.sh: two nodes, each in a network and UTS namespace.
ClusterName=gacli-two-nodes
SlurmctldHost=$(hostname -s)($NET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=5,bf_interval=5
ReturnToService=2
SlurmdTimeout=60
# A node whose slurmd does not answer is marked down after SlurmdTimeout; the tests cut only the
# training's processes, so the nodes stay up.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGDIR/$NAME-slurmctld.log
SlurmdLogFile=$LOGDIR/$NAME-%n.log
NodeName=${NODES[0]} NodeHostname=${NODES[0]} NodeAddr=${ADDRESSES[0]} $TOPO RealMemory=1000 State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=${NODES[1]} NodeAddr=${ADDRESSES[1]} $TOPO RealMemory=1000 State=UNKNOWN
PartitionName=two Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF

# --- 4. daemons: slurmctld here, each slurmd inside its node's namespaces --------------------
# nsenter, not ip netns exec: that one also remounts /sys without the cgroup file system, which
# slurmd's cgroup plugin needs at start even with proctrack/linuxproc.
alive "$RUN/slurmctld.pid" slurmctld || slurmctld -f "$CONF" || fail "slurmctld did not start"
for node in "${NODES[@]}"; do
    alive "$RUN/slurmd-$node.pid" slurmd ||
        nsenter --net="/run/netns/$node" unshare --uts \
            sh -c "hostname $node && exec slurmd -f $CONF -N $node" ||
        fail "slurmd of $node did not start"
done

# --- 5. wait (at most 90 s) until both nodes are idle ----------------------------------------
end=$((SECONDS + 90))
while [ "$SECONDS" -lt "$end" ]; do
    if up; then log "cluster up (${NODES[*]}, SLURM_CONF=$CONF)"; exit 0; fi
    node_states | while read -r node state; do
        case "$state" in
            down*|drain*|drng*|fail*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
        esac
    done
    sleep 1
done
fail "the nodes did not become idle in 90 s ($(node_states | tr '\n' ' '))"
