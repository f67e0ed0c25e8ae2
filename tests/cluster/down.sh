#!/usr/bin/env bash
# Tear down the test cluster made by up.sh: daemons, namespaces, bridge, /etc/hosts lines.
# Safe to run twice, and on a half-made cluster.
set -u

STATE=${HPC_RL_SLURM_STATE:-/tmp/hpc-rl-slurm}
BR=hpcrl-br0
MARK="# hpc-rl-test-cluster"

stop() {  # stop the process in pid file $1: TERM, then KILL after a bounded wait
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null) || return 0
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$f"
}

# Job processes left in a namespace (a killed slurmd leaves its job steps behind).
for ns in $(ip netns list 2>/dev/null | awk '/^hpcrl-n/ {print $1}'); do
  for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
done
for f in "$STATE"/slurmd-*.pid; do [ -e "$f" ] && stop "$f"; done
stop "$STATE/slurmctld.pid"
stop "$STATE/munged.pid"   # only a munged that up.sh started

for ns in $(ip netns list 2>/dev/null | awk '/^hpcrl-n/ {print $1}'); do
  ip netns del "$ns" 2>/dev/null
done
ip link del $BR 2>/dev/null
[ -f /etc/hosts ] && sed -i "/$MARK/d" /etc/hosts
# Keep the logs for post-mortems; drop controller state so the next up.sh starts clean.
rm -rf "$STATE/ctld" "$STATE/spool"
echo "down.sh: test cluster down"
exit 0
