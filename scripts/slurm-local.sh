#!/bin/bash
# A Slurm of two nodes on this machine, for trying `hethub launch slurm`'s batch script by hand:
# munged, one slurmctld and two slurmd (n0 and n1, one CPU each, both at 127.0.0.1 on their own
# ports), all as root, in a folder of their own. It runs the command given (with SLURM_CONF set,
# so sbatch, squeue and scancel reach this Slurm), then stops every process it started by its
# PID. Needs root and Debian's slurm-wlm and munge (apt-get install -y slurm-wlm munge).
# tests/test_slurm.py runs hethub's Slurm job on it; by hand:
#
#   scripts/slurm-local.sh bash -c 'sbatch --wait job.sbatch'
#
# The daemons listen on SLURM_LOCAL_PORT (default 16817) and the two ports above it.
set -euo pipefail
[ "$#" -gt 0 ] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
PORT=${SLURM_LOCAL_PORT:-16817}
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons, for a PATH without them
HERE=$(mktemp -d "${TMPDIR:-/tmp}/slurm-local.XXXXXX")
PIDS=()
stop() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "slurm-local: stopped ${PIDS[*]}; logs in $HERE" >&2
}
trap stop EXIT

mkdir -p "$HERE/state" "$HERE/spool/n0" "$HERE/spool/n1"
dd if=/dev/urandom of="$HERE/munge.key" bs=1024 count=1 status=none
chmod 400 "$HERE/munge.key"
munged --foreground --force --key-file="$HERE/munge.key" --socket="$HERE/munge.sock" \
  --pid-file="$HERE/munged.pid" --log-file="$HERE/munged.log" --seed-file="$HERE/munge.seed" 2>"$HERE/munged.out" &
PIDS+=($!)

cat > "$HERE/slurm.conf" <<CONF
ClusterName=hethub-local
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$HERE/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# Only the backfill scheduler starts a heterogeneous job: every second, not every 30 s.
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
ReturnToService=2
StateSaveLocation=$HERE/state
SlurmdSpoolDir=$HERE/spool/%n
SlurmctldPidFile=$HERE/slurmctld.pid
SlurmdPidFile=$HERE/slurmd-%n.pid
SlurmctldLogFile=$HERE/slurmctld.log
SlurmdLogFile=$HERE/slurmd-%n.log
NodeName=n0 NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=1 State=UNKNOWN
NodeName=n1 NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=1 State=UNKNOWN
PartitionName=local Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$HERE/slurm.conf"

for _ in $(seq 50); do [ -S "$HERE/munge.sock" ] && break; sleep 0.1; done
slurmctld -D -i -f "$SLURM_CONF" > "$HERE/slurmctld.out" 2>&1 &
PIDS+=($!)
for node in n0 n1; do
  slurmd -D -N "$node" -f "$SLURM_CONF" > "$HERE/slurmd-$node.out" 2>&1 &
  PIDS+=($!)
done
# Both nodes idle, or give up after 30 s
idle=0
for _ in $(seq 60); do
  idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
  [ "$idle" = 2 ] && break
  sleep 0.5
done
sinfo -N >&2
[ "$idle" = 2 ] || { echo "slurm-local: nodes n0 and n1 not idle after 30 s; see $HERE" >&2; exit 1; }
"$@"
