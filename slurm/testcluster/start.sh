#!/usr/bin/env bash
# Start a whole private Slurm cluster on this one host, for tests:
#   MariaDB -> slurmdbd (accounting) -> slurmctld -> NODES x slurmd
# Every file it writes (configs, state, spool, pid files, logs, database) lies under DIR.
# Nodes are named by loopback addresses of the cluster's own, 127.A.B.11, 127.A.B.12, ... (A.B
# from its port block), so a job's hostnames (MASTER_ADDR) resolve without touching /etc/hosts
# and clusters side by side never share a node name. By default the nodes bind as GPU clusters
# do (proctrack/cgroup, task/affinity + task/cgroup constraining cores and devices): each node
# has the machine's own CPUs, 16000 MB and 4 "GPUs" of type a100, device files that a device
# cgroup allows or denies. TESTCLUSTER_BINDING=none: nothing bound, 8 CPUs a node declared.
#
# Usage: start.sh DIR [NODES]      (DIR must be empty or not exist yet; NODES defaults to 2)
# Then:  source DIR/env.sh         (exports SLURM_CONF; every Slurm client needs it)
# Stop:  stop.sh DIR
#
# Environment (all optional):
#   TESTCLUSTER_PORT_BASE     first of NODES+2 consecutive TCP ports (slurmctld, slurmdbd, nodes);
#                             default: a random free block in 10000-19999, below the ports
#                             the kit derives for its jobs (20000-32767), so no job's
#                             rendezvous ever finds a daemon of a cluster on its port
#   TESTCLUSTER_FIRST_JOB_ID  first job id; default derived from the clock (see below)
#   TESTCLUSTER_TIMEOUT       seconds to wait for the cluster to be ready (default 60)
#   TESTCLUSTER_MAX_ARRAY_SIZE  Slurm's MaxArraySize (default 6: small, so that a test shows a
#                             sweep split into several arrays; Slurm's own default is 1001)
#   TESTCLUSTER_MAX_JOB_COUNT   Slurm's MaxJobCount, the jobs it holds at once (default 10000)
#   TESTCLUSTER_NETNS=1       each slurmd in a network namespace of its own, with its own
#                             address and hostname (node1, node2, …) on a bridge: a job's ranks
#                             then talk across a real network stack, whose links a test can cut
#   TESTCLUSTER_BINDING       cgroup (default; none with TESTCLUSTER_NETNS=1): tasks bound to
#                             CPUs and GPUs through cgroups, as production clusters run;
#                             none: proctrack/linuxproc, task/none, every task sees everything
#   TESTCLUSTER_CPUS          CPUs a node declares (default: the machine's own layout with
#                             cgroup binding, 8 without); with binding, no more than the
#                             machine has (README: what this sandbox cannot do)
#   TESTCLUSTER_REQUEUE_DELAY seconds a requeued job is held before it may start again
#                             (default 10; Slurm's own: 121): requeue_delay from Slurm 25.11,
#                             the credential lifetime (AuthInfo=cred_expire, at least 5) before
#   TESTCLUSTER_SLURM_PREFIX  run a Slurm built apart (build-slurm.sh) instead of the system's:
#                             its bin and sbin come first on PATH, here and in DIR/env.sh
set -euo pipefail

die() { echo "testcluster: error: $*" >&2; exit 1; }

[[ $# -ge 1 && $# -le 2 ]] || die "usage: $0 DIR [NODES]"
NODES=${2:-2}
[[ $NODES =~ ^[0-9]+$ && $NODES -ge 1 && $NODES -le 200 ]] || die "NODES must be 1..200, got '$NODES'"
TIMEOUT=${TESTCLUSTER_TIMEOUT:-60}
NETNS=${TESTCLUSTER_NETNS:-0}
# The namespaced nodes default to no binding: their tests need more tasks a node than the
# machine has CPUs (and their names, node1 ..., would share cgroups with another such cluster).
BINDING=${TESTCLUSTER_BINDING:-$([[ $NETNS == 1 ]] && echo none || echo cgroup)}
[[ $BINDING == cgroup || $BINDING == none ]] || die "TESTCLUSTER_BINDING must be cgroup or none, got '$BINDING'"
REQUEUE_DELAY=${TESTCLUSTER_REQUEUE_DELAY:-10}
[[ $REQUEUE_DELAY =~ ^[0-9]+$ ]] || die "TESTCLUSTER_REQUEUE_DELAY must be seconds, got '$REQUEUE_DELAY'"

# PATH: the system's Slurm, or the one TESTCLUSTER_SLURM_PREFIX names.
source "$(dirname "${BASH_SOURCE[0]}")/slurm-path.sh"
for prog in mariadbd mariadb-install-db mariadb-admin slurmdbd slurmctld slurmd sinfo sacct sacctmgr; do
    command -v "$prog" >/dev/null || die "$prog not found: run $(dirname "$0")/install.sh first"
done

mkdir -p "$1"
DIR=$(cd "$1" && pwd -P)   # absolute: the configs must not depend on the working directory
[[ -z $(ls -A "$DIR") ]] || die "$DIR is not empty (stop.sh the old cluster and use a new folder)"
mkdir -p "$DIR"/{state,run,log,dev,db}

# If anything below fails, take down whatever already runs, so no daemon outlives a failed start.
# (On success the trap is cleared at the end.)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
trap '"$HERE/stop.sh" "$DIR" >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT TERM   # (bash skips the EXIT trap when a signal kills it)

# ---------------------------------------------------------------------------------------------
# Ports and job ids.
# Two clusters on one host must not share a port, so pick a random block of free ones (below
# the kernel's ephemeral range, so no outgoing connection holds them).
port_in_use() {   # any TCP socket (any state) bound to local port $1?
    local hex
    hex=$(printf '%04X' "$1")
    cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk -v p=":$hex" '$2 ~ p"$" {f=1} END {exit !f}'
}
block_free() {    # are ports $1 .. $1+$2-1 all free?
    local p
    for ((p = $1; p < $1 + $2; p++)); do port_in_use "$p" && return 1; done
    return 0
}
NPORTS=$((NODES + 2))
if [[ -n ${TESTCLUSTER_PORT_BASE:-} ]]; then
    BASE=$TESTCLUSTER_PORT_BASE
    block_free "$BASE" "$NPORTS" || die "ports $BASE..$((BASE + NPORTS - 1)) are not all free"
else
    for _ in $(seq 50); do
        BASE=$((10000 + (RANDOM % ((10000 - NPORTS) / 10)) * 10))
        block_free "$BASE" "$NPORTS" && break
        BASE=
    done
    [[ -n $BASE ]] || die "found no block of $NPORTS free ports in 10000-19999"
fi
CTLD_PORT=$BASE
DBD_PORT=$((BASE + 1))
NODE_PORT0=$((BASE + 2))

# submitit caches job states by job id for the life of a Python process, so a second cluster
# started by the same process must not reuse the first one's ids. Derive the first id from the
# clock: 100 ids per second, wrapping after about 7 days, below Slurm's MaxJobId (67043328).
if [[ -n ${TESTCLUSTER_FIRST_JOB_ID:-} ]]; then
    FIRST_JOB_ID=$TESTCLUSTER_FIRST_JOB_ID
else
    FIRST_JOB_ID=$((1000 + ($(date +%s%N) / 10000000) % 60000000))
fi

# ---------------------------------------------------------------------------------------------
# Node names and fake GPUs.
# All of 127/8 is loopback. A.B come from the port block, which no other cluster on this host
# holds: slurmd names its cgroups after its node (slurm_<node> under each controller), so two
# clusters with a node of the same name would share them.
LOOPBACK_NET="127.$((BASE / 256 % 256)).$((BASE % 256))"
node_name() { echo "$LOOPBACK_NET.$((10 + $1))"; }   # node 1 -> 127.A.B.11
node_addr() { node_name "$1"; }
CTLD_ADDR=127.0.0.1
if [[ $NETNS == 1 ]]; then
    # Names and a subnet of this cluster's own: its port block is unique on this host.
    NET_ID=$((BASE / 10))
    SUBNET="10.$((200 + NET_ID / 250 % 50)).$((NET_ID % 250))"
    BRIDGE="kb$NET_ID"
    node_name() { echo "node$1"; }
    node_addr() { echo "$SUBNET.$((10 + $1))"; }
    CTLD_ADDR=$SUBNET.1
fi
NODE_NAMES=()
for ((i = 1; i <= NODES; i++)); do NODE_NAMES+=("$(node_name "$i")"); done
# Typed, as most GPU clusters name theirs: a request may name the type (--gpus-per-node=a100:4)
# or not (--gpus-per-node=4); another type is refused at submission.
GPU_TYPE=a100
# A gres File must exist (with Count=4 and no File the node drains). Each is a character device
# of the NVIDIA driver's numbers (major 195, minor N), as /dev/nvidiaN on a GPU node: a device
# cgroup allows or denies it by those numbers, so a task's open() tells whether Slurm gave it
# that GPU (no driver behind it: ENXIO where allowed, EPERM where denied). Without binding a
# symlink to /dev/null does where device files cannot be made.
for g in 0 1 2 3; do
    mknod "$DIR/dev/nvidia$g" c 195 "$g" 2>/dev/null ||
        { [[ $BINDING == none ]] && ln -s /dev/null "$DIR/dev/nvidia$g"; } ||
        die "cannot make device files in $DIR/dev (mknod: root, and no nodev mount, needed)"
done
printf '%s\n' "${NODE_NAMES[@]}" >"$DIR/nodes"   # for tests and stop.sh

# CPUs a node declares. Bound, they are the machine's own layout (as `slurmd -C` reads it), so
# that Slurm's binding means on each node what it means on a real one. More than the machine has
# cannot be bound: Slurm folds them onto its CPUs and fails to lay out a step that fills the node
# ("Unable to layout tasks on given cpus"; README: what this sandbox cannot do).
node_cpus() {
    if [[ -n ${TESTCLUSTER_CPUS:-} ]]; then
        [[ $TESTCLUSTER_CPUS =~ ^[0-9]+$ && $TESTCLUSTER_CPUS -ge 1 ]] ||
            die "TESTCLUSTER_CPUS must be a number of CPUs, got '$TESTCLUSTER_CPUS'"
        [[ $BINDING == none || $TESTCLUSTER_CPUS -le $(nproc) ]] ||
            die "TESTCLUSTER_CPUS=$TESTCLUSTER_CPUS: more than the $(nproc) CPUs here cannot be" \
                "bound; TESTCLUSTER_BINDING=none declares any number"
        echo "CPUs=$TESTCLUSTER_CPUS"
    elif [[ $BINDING == none ]]; then
        echo "CPUs=8"
    else
        slurmd -C | grep -o 'CPUs=[0-9]* Boards=[0-9]* SocketsPerBoard=[0-9]* CoresPerSocket=[0-9]* ThreadsPerCore=[0-9]*' ||
            echo "CPUs=$(nproc)"
    fi
}
NODE_CPUS=$(node_cpus)

# Unix socket paths must fit in 108 bytes: MariaDB's socket and the sockets slurmstepd creates in
# the node spool dirs (SPOOL/NODE/NODE_JOBID.STEPID, up to 58 bytes more with nodes named like
# 127.255.255.210). For a deep DIR they go to a short folder in /tmp instead, linked as
# DIR/short, which stop.sh removes.
if [[ ${#DIR} -le 44 ]]; then
    SHORT=$DIR
else
    SHORT=$(mktemp -d /tmp/testcluster.XXXXXX)
    ln -s "$SHORT" "$DIR/short"
fi
mkdir -p "$SHORT/spool" "$SHORT/mysql"
for n in "${NODE_NAMES[@]}"; do mkdir -p "$SHORT/spool/$n"; done
MYSQL_SOCKET=$SHORT/mysql/mysqld.sock

CLUSTER=testcluster

# ---------------------------------------------------------------------------------------------
# Configuration files. Slurm finds slurmdbd.conf, gres.conf, cgroup.conf and plugstack.conf next
# to the slurm.conf that SLURM_CONF names.

# The Slurm release on PATH as a number: 2205 for "slurm-wlm 22.05.8", 2511 for "slurm 25.11.7".
RELEASE=$(slurmctld -V | awk '{split($NF, v, "."); printf "%d%02d", v[1], v[2]}')
# A requeued job may start again only after a hold: Slurm 25.11's requeue_delay, before that the
# credential lifetime (at least 5 s), either 120 s by default, plus 1 s.
if ((RELEASE >= 2511)); then
    REQUEUE_PARAMETER=",requeue_delay=$REQUEUE_DELAY"
    AUTH_INFO="# (the requeue hold: requeue_delay in SchedulerParameters)"
else
    REQUEUE_PARAMETER=
    AUTH_INFO="AuthInfo=cred_expire=$((REQUEUE_DELAY < 5 ? 5 : REQUEUE_DELAY))"
fi

if [[ $BINDING == cgroup ]]; then
    # Slurm's cgroup/v1 needs the controllers mounted one per hierarchy, as on this machine
    # (Slurm 25.11 still runs it, and warns that v1 is deprecated).
    for controller in cpuset devices freezer; do
        [[ -d /sys/fs/cgroup/$controller ]] || die "no cgroup v1 $controller hierarchy under" \
            "/sys/fs/cgroup: TESTCLUSTER_BINDING=none starts a cluster that binds nothing"
    done
    BINDING_CONF="# As GPU clusters run: each job's processes in cgroups of their own (scancel reaches
# what they fork), each task bound to its CPUs (task/affinity) within the cores and GPUs of its
# job and step (task/cgroup, cgroup.conf).
ProctrackType=proctrack/cgroup
TaskPlugin=task/affinity,task/cgroup"
    cat >"$DIR/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=yes
ConstrainDevices=yes
EOF
else
    BINDING_CONF="# Nothing bound (TESTCLUSTER_BINDING=none): processes tracked through /proc, every task sees
# every CPU and device.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none"
fi

cat >"$DIR/slurm.conf" <<EOF
# Written by slurm/testcluster/start.sh: a private test cluster, $NODES node(s) on one host.
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)($CTLD_ADDR)
SlurmctldPort=$CTLD_PORT
FirstJobId=$FIRST_JOB_ID

# No munge: every daemon and client runs on this host as root.
AuthType=auth/none
CredType=cred/none
$AUTH_INFO
SlurmUser=root
SlurmdUser=root

StateSaveLocation=$DIR/state
SlurmdSpoolDir=$SHORT/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$DIR/plugstack.conf

$BINDING_CONF
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Without batch_sched_delay=0 each batch job can wait up to 3 s to be scheduled. Heterogeneous
# jobs are started by the backfill scheduler alone: bf_interval=1 starts them within a second
# rather than 30. A job whose hold ends (after a requeue) waits for the main scheduling loop,
# every 60 s by default: sched_interval=2 starts it within 2 s.
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2$REQUEUE_PARAMETER
KillWait=2
ReturnToService=2
# A node that stops answering (its link cut) is marked DOWN after this, and its jobs requeued.
SlurmdTimeout=$([[ $NETNS == 1 ]] && echo 30 || echo 300)
# Finished jobs leave squeue after 5 s (sacct keeps them). Also makes 'sbatch --wait' poll every
# 2 s: it lengthens its poll interval (2 s, then 8 s) only while that stays below MinJobAge/2.
MinJobAge=5
MaxArraySize=${TESTCLUSTER_MAX_ARRAY_SIZE:-6}
MaxJobCount=${TESTCLUSTER_MAX_JOB_COUNT:-10000}
# Lets a node declare more CPUs/memory than the machine has (TESTCLUSTER_CPUS; 16000 MB).
SlurmdParameters=config_overrides
GresTypes=gpu

AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# Record GPUs per job in accounting (sacct -o AllocTRES shows gres/gpu=N and gres/gpu:a100=N).
AccountingStorageTRES=gres/gpu,gres/gpu:$GPU_TYPE
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

EOF
for ((i = 1; i <= NODES; i++)); do
    n=$(node_name "$i")
    echo "NodeName=$n NodeAddr=$(node_addr "$i") Port=$((NODE_PORT0 + i - 1)) $NODE_CPUS RealMemory=16000 Gres=gpu:$GPU_TYPE:4 State=UNKNOWN" \
        >>"$DIR/slurm.conf"
    echo "NodeName=$n Name=gpu Type=$GPU_TYPE File=$DIR/dev/nvidia[0-3]" >>"$DIR/gres.conf"
done
# Bound nodes have only the machine's few CPUs: OverSubscribe=FORCE:4 lets up to 4 jobs share a
# CPU (not --exclusive ones), so that several jobs run on one node at once, as on a node with
# more CPUs. Slurm gives each job idle CPUs while there are any, binds each to its own, and
# shares them only once all are taken; one job still gets no more CPUs a node than it has.
OVERSUBSCRIBE=$([[ $BINDING == cgroup ]] && echo FORCE:4 || echo NO)
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=$OVERSUBSCRIBE" \
    >>"$DIR/slurm.conf"
: >"$DIR/plugstack.conf"

# slurmdbd refuses a slurmdbd.conf that others can read: create it with mode 600.
(umask 077 && cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/none
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
)

cat >"$DIR/env.sh" <<EOF
# Source this to use the test cluster in $DIR.
export SLURM_CONF=$DIR/slurm.conf
# The Slurm it runs on (empty: the system's); stop.sh and slurmd.sh read it from here.
export TESTCLUSTER_SLURM_PREFIX='${TESTCLUSTER_SLURM_PREFIX:-}'
EOF
if [[ -n ${TESTCLUSTER_SLURM_PREFIX:-} ]]; then
    # Its clients, not the system's: a client of another release cannot talk to these daemons.
    echo "export PATH=\"$TESTCLUSTER_SLURM_PREFIX/bin:$TESTCLUSTER_SLURM_PREFIX/sbin:\$PATH\"" >>"$DIR/env.sh"
fi
export SLURM_CONF=$DIR/slurm.conf
# slurmdbd's MariaDB client library connects to "localhost" through the socket that
# MYSQL_UNIX_PORT names (else the system's /run/mysqld/mysqld.sock). Measured: a [client]
# socket= in an option file is not honoured, this variable is.
export MYSQL_UNIX_PORT=$MYSQL_SOCKET

# ---------------------------------------------------------------------------------------------
# Helpers for waiting.
START=$(date +%s.%N)
elapsed() { awk -v s="$START" -v n="$(date +%s.%N)" 'BEGIN {printf "%.1f", n - s}'; }
timed_out() { awk -v s="$START" -v n="$(date +%s.%N)" -v t="$TIMEOUT" 'BEGIN {exit !(n - s > t)}'; }
fail_with_logs() {   # $1 message, rest: log files to show
    local msg=$1 f
    shift
    {
        echo "testcluster: error: $msg (after $(elapsed) s)"
        for f in "$@"; do
            [[ -f $f ]] || continue
            echo "----- last lines of $f"
            tail -n 25 "$f"
        done
    } >&2
    exit 1
}
say() { if [[ ${TESTCLUSTER_VERBOSE:-0} == 1 ]]; then echo "testcluster: [$(elapsed) s] $*" >&2; fi; }
wait_for() {   # $1 what, $2 command to poll, rest: logs to show on timeout
    local what=$1 cmd=$2
    shift 2
    say "waiting for $what"
    until eval "$cmd" >/dev/null 2>&1; do
        timed_out && fail_with_logs "timed out waiting for $what" "$@"
        sleep 0.1
    done
    say "... $what: ok"
}

# ---------------------------------------------------------------------------------------------
# MariaDB: a private data directory and temporary folder (clusters started side by side name
# their temporary tables alike in a shared /tmp), no TCP, root authenticates through the socket.
mkdir -p "$DIR/db/tmp"
mariadb-install-db --no-defaults --datadir="$DIR/db/data" --tmpdir="$DIR/db/tmp" --user=root \
    --auth-root-authentication-method=socket --skip-test-db --skip-name-resolve \
    >"$DIR/log/mariadb-install.log" 2>&1 ||
    fail_with_logs "mariadb-install-db failed" "$DIR/log/mariadb-install.log"
# mariadbd does not daemonize: setsid + nohup detach it from the caller's session and output
# (a caller that captures our stdout would otherwise wait for it forever). The small buffer pool
# and no fsync keep it light; the data are throwaway.
setsid nohup mariadbd --no-defaults --user=root --datadir="$DIR/db/data" --tmpdir="$DIR/db/tmp" \
    --skip-networking --socket="$MYSQL_SOCKET" --pid-file="$DIR/run/mariadbd.pid" \
    --log-error="$DIR/log/mariadbd.log" --skip-name-resolve \
    --innodb-buffer-pool-size=32M --innodb-log-file-size=16M \
    --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 --innodb-flush-method=nosync \
    --performance-schema=OFF --skip-log-bin \
    </dev/null >>"$DIR/log/mariadbd.log" 2>&1 &
# Its pid file appears only once it is up; remember the pid now so stop.sh can always find it.
echo $! >"$DIR/run/mariadbd.launch.pid"
wait_for "MariaDB" "mariadb-admin --no-defaults --socket='$MYSQL_SOCKET' ping" "$DIR/log/mariadbd.log"

# ---------------------------------------------------------------------------------------------
# Slurm daemons. Each daemonizes itself (writes its pid file, detaches from our output).
slurmdbd </dev/null >>"$DIR/log/slurmdbd.log" 2>&1 ||
    fail_with_logs "slurmdbd did not start" "$DIR/log/slurmdbd.log"
wait_for "slurmdbd on port $DBD_PORT" "sacctmgr -n list cluster" "$DIR/log/slurmdbd.log" "$DIR/log/mariadbd.log"

# -i: ignore any saved state (there is none; keeps a failed run from confusing the next).
if [[ $NETNS == 1 ]]; then
    # The cluster's hosts file (every node's name and address) bound over /etc/hosts in a mount
    # namespace of the controller's own, as each slurmd has it. Slurm 25.11's slurmctld looks up
    # a name for every connection it accepts, one at a time, without remembering failures: names
    # that only DNS could answer stalled it for seconds each, and a burst of jobs past srun's
    # timeout.
    { echo "127.0.0.1 localhost"; echo "$CTLD_ADDR $(hostname -s)"; } >"$DIR/hosts"
    for ((i = 1; i <= NODES; i++)); do echo "$(node_addr "$i") $(node_name "$i")" >>"$DIR/hosts"; done
    unshare --mount sh -c \
        "mount --bind '$DIR/hosts' /etc/hosts && exec slurmctld -i -f '$DIR/slurm.conf'" \
        </dev/null >>"$DIR/log/slurmctld.log" 2>&1 ||
        fail_with_logs "slurmctld did not start" "$DIR/log/slurmctld.log"
else
    slurmctld -i -f "$DIR/slurm.conf" </dev/null >>"$DIR/log/slurmctld.log" 2>&1 ||
        fail_with_logs "slurmctld did not start" "$DIR/log/slurmctld.log"
fi

# Network namespaces: a bridge with the controller's address, and per node a namespace whose
# veth pair (host end kv<NET_ID>n<K>, named in run/netns for stop.sh and for tests) plugs into
# it. Each slurmd runs there with its own hostname and an /etc/hosts naming every node
# (slurmd.sh).
if [[ $NETNS == 1 ]]; then
    ip link add "$BRIDGE" type bridge && ip addr add "$CTLD_ADDR/24" dev "$BRIDGE" &&
        ip link set "$BRIDGE" up || die "cannot make bridge $BRIDGE (root and iproute2 needed)"
    echo "$BRIDGE" >"$DIR/run/bridge"
    for ((i = 1; i <= NODES; i++)); do
        ns="kn${NET_ID}n$i" veth="kv${NET_ID}n$i"
        ip netns add "$ns" && echo "$ns $veth $(node_name "$i") $(node_addr "$i")" >>"$DIR/run/netns"
        ip link add "$veth" type veth peer name "${veth}p"
        ip link set "${veth}p" netns "$ns"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" link set "${veth}p" name eth0
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
fi

for ((i = 1; i <= NODES; i++)); do
    n=$(node_name "$i")
    "$HERE/slurmd.sh" "$DIR" "$n" || fail_with_logs "slurmd $n did not start" "$DIR/log/slurmd-$n.log"
done

# ---------------------------------------------------------------------------------------------
# Ready = every node idle, and the controller has registered the cluster with slurmdbd (before
# that, sacct answers but jobs are not yet accounted to this cluster).
all_idle() {
    local states
    states=$(sinfo -h -N -o '%t' 2>/dev/null) || return 1
    [[ $(grep -cx idle <<<"$states") -eq $NODES ]]
}
node_logs=()
for n in "${NODE_NAMES[@]}"; do node_logs+=("$DIR/log/slurmd-$n.log"); done
wait_for "all $NODES nodes idle" all_idle "$DIR/log/slurmctld.log" "${node_logs[@]}"
wait_for "accounting (cluster $CLUSTER registered)" \
    "sacctmgr -n -P list cluster format=cluster | grep -qx $CLUSTER && sacct -n -X" \
    "$DIR/log/slurmdbd.log" "$DIR/log/slurmctld.log"

# The controller runs its first scheduling cycle 2-3 s after it started; until then batch jobs
# stay pending. Wait for it, so that the first test job starts as fast as any later one.
sched_cycles() { sdiag 2>/dev/null | awk '/^Main schedule/ {m=1} m && /Total cycles:/ {print $3; exit}'; }
wait_for "the first scheduling cycle" '[[ $(sched_cycles) -ge 1 ]]' "$DIR/log/slurmctld.log"

trap - EXIT
echo "testcluster: $NODES node(s) of $(sinfo --version) ready in $(elapsed) s: source $DIR/env.sh" \
    "(slurmctld port $CTLD_PORT, slurmdbd port $DBD_PORT, first job id $FIRST_JOB_ID)"
