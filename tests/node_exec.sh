#!/bin/sh
# hydra's launcher in place of ssh on the emulated cluster (tests/cluster.py):
#   node_exec.sh [-x ...] HOST COMMAND...
# runs COMMAND (joined and parsed by sh, as ssh would) on node HOST of the cluster whose
# directory FOREBAY_CLUSTER_DIR names (pids.json: each node's holder process).
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
pid=$(sed -n "s/.*\"$host\": \([0-9]*\).*/\1/p" "$FOREBAY_CLUSTER_DIR/pids.json")
if [ -z "$pid" ]; then
    echo "node_exec.sh: no node $host in $FOREBAY_CLUSTER_DIR/pids.json" >&2
    exit 255
fi
# a node capped in CPU (Cluster(cpus=...)): into the node's group first
procs="$FOREBAY_CLUSTER_DIR/cpu/$host/cgroup.procs"
if [ -e "$procs" ]; then
    echo $$ > "$procs" || exit 255
fi
exec nsenter -t "$pid" -n -u -i -m --wd="$PWD" -- sh -c "$*"
