#!/usr/bin/env bash
# Start the slurmd of one node of a test cluster that start.sh made in DIR: in the node's own
# network namespace where the cluster has them (run/netns), else on this host. start.sh starts
# every node with it; a test restarts a node whose slurmd it killed.
#
# Usage: slurmd.sh DIR NODE_NAME
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 DIR NODE_NAME" >&2; exit 2; }
DIR=$1 NODE=$2
# The Slurm the cluster was started on (env.sh names it), whatever the caller's environment.
if [[ -f $DIR/env.sh ]]; then source "$DIR/env.sh"; fi
source "$(dirname "${BASH_SOURCE[0]}")/slurm-path.sh"
LOG="$DIR/log/slurmd-$NODE.log"

ns=
if [[ -s $DIR/run/netns ]]; then
    ns=$(awk -v n="$NODE" '$3 == n {print $1}' "$DIR/run/netns")
fi
if [[ -n $ns ]]; then
    # Its own hostname and an /etc/hosts naming every node, bound over the real one in a mount
    # namespace of its own; `ip netns exec` would remount /sys and slurmd would lose its view
    # of the processes it tracks.
    nsenter --net="/run/netns/$ns" unshare --mount --uts sh -c \
        "hostname $NODE && mount --bind '$DIR/hosts' /etc/hosts && exec slurmd -N $NODE -f '$DIR/slurm.conf'" \
        </dev/null >>"$LOG" 2>&1
else
    slurmd -N "$NODE" -f "$DIR/slurm.conf" </dev/null >>"$LOG" 2>&1
fi
