#!/usr/bin/env bash
# Bring up a 3-node Slurm cluster on this machine for tests (root, no systemd).
#
# Each node is a slurmd in its own network namespace (veth on a bridge, its own IP) and UTS
# namespace (its own hostname); slurmctld and munged run in the host namespace. The filesystem
# is shared as on a real cluster. Idempotent: a healthy cluster is left as is.
# State lives in $HPC_RL_SLURM_STATE (default /tmp/hpc-rl-slurm); tests/cluster/down.sh undoes all.
set -euo pipefail

STATE=${HPC_RL_SLURM_STATE:-/tmp/hpc-rl-slurm}
NODES=${HPC_RL_SLURM_NODES:-3}
BR=hpcrl-br0
NET=10.77.0
MARK="# hpc-rl-test-cluster"
HOST=$(hostname)
READY_TIMEOUT=${HPC_RL_SLURM_READY_TIMEOUT:-90}

die() { echo "up.sh: $*" >&2; exit 1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

[ "$(id -u)" = 0 ] || die "needs root (network namespaces, slurmd); run as root or skip the Slurm tests"
for b in slurmctld slurmd munged ip unshare sinfo; do
  command -v $b >/dev/null || die "$b not found; install slurm-wlm, munge and iproute2 (apt-get install -y slurm-wlm munge iproute2)"
done

export SLURM_CONF=$STATE/slurm.conf

# Already up and all nodes answering? Nothing to do.
if alive "$STATE/slurmctld.pid" && [ -f "$SLURM_CONF" ]; then
  ok=1
  for i in $(seq 1 "$NODES"); do alive "$STATE/slurmd-n$i.pid" || ok=0; done
  if [ $ok = 1 ] && [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|alloc|mix)$')" -ge "$NODES" ]; then
    echo "up.sh: cluster already up (SLURM_CONF=$SLURM_CONF)"; exit 0
  fi
fi
# Half-up from an earlier try: start clean.
"$(dirname "$0")/down.sh" >/dev/null 2>&1 || true

mkdir -p "$STATE"/{ctld,log,spool}
chmod 755 "$STATE"

# munge: reuse a running daemon (its default socket), else start one and remember its pid.
if ! munge -n </dev/null >/dev/null 2>&1; then
  [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key missing; reinstall munge (it creates the key)"
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  munged --force --pid-file=/run/munge/munged.pid 2>>"$STATE/log/munged.out" || die "munged failed to start (see $STATE/log/munged.out)"
  cp /run/munge/munged.pid "$STATE/munged.pid"
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n </dev/null >/dev/null 2>&1 || die "munged started but does not answer"
fi

last=$((10 + NODES))
cat > "$STATE/slurm.conf" <<CONF
ClusterName=hpcrl
SlurmctldHost=$HOST($NET.1)
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120, slurm.conf(5)); the
# preemption tests requeue, and 20 s still leaves a loaded 2-core node time to launch its job steps.
AuthInfo=cred_expire=20
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
# Fast turnaround for tests: short kill grace, completed jobs stay visible for 10 minutes.
KillWait=5
MinJobAge=600
SlurmdTimeout=30
InactiveLimit=0
NodeName=n[1-$NODES] NodeAddr=$NET.[11-$last] CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
CONF
# This machine has cgroup v1 hierarchies; autodetection fails inside a netns.
cat > "$STATE/cgroup.conf" <<CONF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
CONF

# Network: a bridge on the host, one namespace + veth per node.
ip link add $BR type bridge
ip addr add $NET.1/24 dev $BR
ip link set $BR up
for i in $(seq 1 "$NODES"); do
  ns=hpcrl-n$i
  ip netns add $ns
  ip link add hrl-n$i type veth peer name eth0 netns $ns
  ip link set hrl-n$i master $BR up
  ip -n $ns addr add $NET.$((10 + i))/24 dev eth0
  ip -n $ns link set eth0 up
  ip -n $ns link set lo up
done

# Hostnames resolve everywhere (the host and every namespace read the same /etc/hosts).
sed -i "/$MARK/d" /etc/hosts
for i in $(seq 1 "$NODES"); do echo "$NET.$((10 + i)) n$i $MARK" >> /etc/hosts; done

slurmctld -D -i -f "$SLURM_CONF" >"$STATE/log/slurmctld.out" 2>&1 &
for i in $(seq 1 "$NODES"); do
  ip netns exec hpcrl-n$i unshare --uts sh -c "hostname n$i; exec slurmd -D -f '$SLURM_CONF' -N n$i" \
    >"$STATE/log/slurmd-n$i.out" 2>&1 &
done

# Wait until every node is idle (bounded; the error names what did not come up).
deadline=$((SECONDS + READY_TIMEOUT))
while :; do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' idle$' || true)
  [ "$idle" -ge "$NODES" ] && break
  if [ $SECONDS -ge $deadline ]; then
    echo "up.sh: nodes not idle after ${READY_TIMEOUT}s: $(sinfo -h -N -o '%N=%t' 2>&1 | tr '\n' ' ')" >&2
    echo "up.sh: see $STATE/log/ (slurmctld.log, slurmd-nI.log)" >&2
    exit 1
  fi
  sleep 0.5
done
echo "up.sh: $NODES nodes idle after ${SECONDS}s (SLURM_CONF=$SLURM_CONF)"
