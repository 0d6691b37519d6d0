#!/usr/bin/env bash
# Stop the test cluster that start.sh started in DIR: cancel every job, wait for the jobs to be
# gone, then stop slurmd(s), slurmctld, slurmdbd and MariaDB by the PIDs in their pid files.
# Idempotent: a cluster already (partly) stopped, or a DIR that never held one, is fine.
#
# Usage: stop.sh DIR
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 DIR" >&2; exit 2; }
[[ -d $1 ]] || { echo "testcluster: $1 does not exist: nothing to stop"; exit 0; }
DIR=$(cd "$1" && pwd -P)
# The Slurm the cluster was started on (env.sh names it), whatever the caller's environment.
if [[ -f $DIR/env.sh ]]; then source "$DIR/env.sh"; fi
source "$(dirname "${BASH_SOURCE[0]}")/slurm-path.sh"
export SLURM_CONF=$DIR/slurm.conf
START=$(date +%s.%N)
elapsed() { awk -v s="$START" -v n="$(date +%s.%N)" 'BEGIN {printf "%.1f", n - s}'; }
say() { if [[ ${TESTCLUSTER_VERBOSE:-0} == 1 ]]; then echo "testcluster: [$(elapsed) s] $*" >&2; fi; }

# A process that exited but was not reaped (a zombie: where PID 1 does not reap orphans, as in
# some containers) still answers kill -0, so look at its state instead.
alive() {
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z && $state != X ]]
}
pid_of() {   # pid from pid file $1 if that process still runs, else nothing
    local pid
    [[ -s $1 ]] || return 0
    pid=$(tr -dc 0-9 2>/dev/null <"$1") || return 0
    if [[ -n $pid ]] && alive "$pid"; then echo "$pid"; fi
    return 0
}

# Stop the processes $@ with SIGTERM, wait up to $STOP_WAIT s, then SIGKILL what is left.
STOP_WAIT=10
stop_pids() {
    local pid deadline
    [[ $# -gt 0 ]] || return 0
    say "stopping pids $*"
    kill -TERM "$@" 2>/dev/null || true
    deadline=$((SECONDS + STOP_WAIT))
    for pid in "$@"; do
        while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
    done
    for pid in "$@"; do
        if alive "$pid"; then
            echo "testcluster: pid $pid ignored SIGTERM for ${STOP_WAIT} s: SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

ctld=$(pid_of "$DIR/run/slurmctld.pid")

# 1. Jobs first: slurmd must still run to kill the job steps, else slurmstepd and its tasks are
#    orphaned. Bounded: a controller that does not answer does not hold up the rest; without any
#    slurmd nothing could end the jobs, so do not wait for that.
any_slurmd=0
for f in "$DIR"/run/slurmd-*.pid; do [[ -n $(pid_of "$f") ]] && any_slurmd=1; done
if [[ -n $ctld && $any_slurmd -eq 1 && -f $SLURM_CONF ]]; then
    timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
    deadline=$((SECONDS + 20))
    while ((SECONDS < deadline)); do
        left=$(timeout 5 squeue -h -o %i 2>/dev/null) || break
        [[ -z $left ]] && break
        sleep 0.2
    done
    [[ -z ${left:-} ]] || echo "testcluster: jobs still listed after 20 s:" $left >&2
fi

# 2. Node daemons (the compute side) before the controller, the controller before the accounting
#    daemon (it flushes job records to it), and that before its database.
slurmd_pids=()
for f in "$DIR"/run/slurmd-*.pid; do
    [[ -e $f ]] || continue
    pid=$(pid_of "$f")
    [[ -n $pid ]] && slurmd_pids+=("$pid")
done
stop_pids "${slurmd_pids[@]}"

# Normally nothing is left now. But a step that would not die leaves slurmstepd and its tasks
# behind, reparented to PID 1. Tasks carry this cluster's SLURM_CONF in their environment (from
# the submitting client) and SLURM_JOB_ID; so does Slurm 22.05's slurmstepd (from slurmd). Slurm
# 25.11's slurmstepd writes its title over its environment (/proc/PID/environ reads empty): it
# is known by the log file of this cluster that it holds open. Kill those, never ourselves or
# our caller. (One grep reads all environments at once: spawning a process per /proc entry is
# slow.)
job_processes() {   # pids of this cluster's leftover step daemons and tasks, one a line
    local f pid
    for f in $(grep -lsxzF "SLURM_CONF=$SLURM_CONF" /proc/[0-9]*/environ); do
        pid=${f#/proc/}
        pid=${pid%/environ}
        if grep -qxs slurmstepd "/proc/$pid/comm" || grep -qsz '^SLURM_JOB_ID=' "/proc/$pid/environ"; then
            echo "$pid"
        fi
    done
    for f in $(grep -lxs slurmstepd /proc/[0-9]*/comm); do
        pid=${f#/proc/}
        pid=${pid%/comm}
        if [[ -n $(find "/proc/$pid/fd" -lname "$DIR/*" -print -quit 2>/dev/null) ]]; then
            echo "$pid"
        fi
    done
}
for pid in $(job_processes | sort -un); do
    [[ $pid != "$$" && $pid != "$PPID" ]] && alive "$pid" || continue
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
    echo "testcluster: killing leftover job process $pid ($comm)" >&2
    kill -KILL "$pid" 2>/dev/null || true
done

# With cgroup binding each slurmd made cgroups named after its node (slurm_<node> under every
# controller), which Slurm leaves behind. Remove this cluster's, emptied first where this call
# stopped its slurmd: a process still in one is a leftover of its jobs (a frozen one is thawed so
# that SIGKILL reaches it). Node names are this cluster's own while it runs (start.sh), but a
# later cluster may reuse them: with no slurmd stopped here, only empty folders go.
remove_cgroups() {   # $1: 1 to kill what is left in them
    local node dir pid
    [[ -s $DIR/nodes ]] || return 0
    while read -r node; do
        for dir in /sys/fs/cgroup/*/"slurm_$node"; do
            [[ -d $dir ]] || continue
            if [[ $1 == 1 ]]; then
                find "$dir" -name freezer.state -exec sh -c 'echo THAWED >"$1"' _ {} \; 2>/dev/null || true
                for pid in $(find "$dir" -name cgroup.procs -exec cat {} + 2>/dev/null); do
                    echo "testcluster: killing leftover job process $pid (in $dir)" >&2
                    kill -KILL "$pid" 2>/dev/null || true
                done
            fi
            # Deepest first; a folder that still holds a process stays (rmdir refuses it).
            find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null || true
        done
    done <"$DIR/nodes"
}
remove_cgroups $((${#slurmd_pids[@]} > 0 ? 1 : 0))

# (Unquoted on purpose: an empty pid means nothing to stop.)
stop_pids $ctld
stop_pids $(pid_of "$DIR/run/slurmdbd.pid")
# mariadbd writes its pid file only once it is up; start.sh also kept the pid it launched.
db=$(pid_of "$DIR/run/mariadbd.pid")
[[ -n $db ]] || db=$(pid_of "$DIR/run/mariadbd.launch.pid")
stop_pids $db

# Network namespaces (TESTCLUSTER_NETNS=1): deleting one deletes its veth pair; then the bridge.
if [[ -s $DIR/run/netns ]]; then
    while read -r ns _; do ip netns del "$ns" 2>/dev/null || true; done <"$DIR/run/netns"
    rm -f "$DIR/run/netns"
fi
if [[ -s $DIR/run/bridge ]]; then
    ip link del "$(cat "$DIR/run/bridge")" 2>/dev/null || true
    rm -f "$DIR/run/bridge"
fi

# The short folder in /tmp for socket paths (made when DIR is deep) is ours to remove.
if [[ -L $DIR/short ]]; then
    short=$(readlink "$DIR/short")
    if [[ $short == /tmp/testcluster.* ]]; then rm -rf "$short"; fi
    rm -f "$DIR/short"
fi

echo "testcluster: stopped $DIR in $(elapsed) s"
