#!/usr/bin/env bash
# CI: a one-node SLURM cluster on this machine (munged + slurmctld + slurmd), so that tests/test_slurm.py
# submits experiments/slurm/train.sbatch to a real scheduler. Needs root and Debian/Ubuntu (apt).
# Idempotent: installs what is missing, (re)writes the config, starts what is not running, and returns once
# `sinfo` shows the node idle. Logs: /var/log/slurm/, /var/log/munge/.
set -euo pipefail

if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v munged >/dev/null; then
  echo "slurm_cluster: installing slurm-wlm and munge" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# munge authenticates slurmctld, slurmd and the client commands to each other.
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- /usr/sbin/munged
fi

# One node: this machine, described by slurmd itself (real hostname, CPUs, sockets/cores/threads, memory).
host="$(hostname -s)"
node="$(slurmd -C | head -n 1)"
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=meshmoe-ci
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=30
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
$node State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

# A controller that is not running died with whatever ran before (a killed session, a reboot): its saved
# jobs belong to processes that are gone, yet it would recover them and hold the node until their time
# limit, so it starts with a clean state (-c). A running one may be serving another CI run: keep its jobs.
if pgrep -x slurmctld >/dev/null; then scontrol reconfigure; else slurmctld -c; fi
pgrep -x slurmd >/dev/null || slurmd

for _ in $(seq 60); do
  state="$(sinfo -h -n "$host" -o %T 2>/dev/null || true)"
  case "$state" in
    idle|mixed|allocated) echo "slurm_cluster: node $host is $state" >&2; exit 0 ;;
    down*|drain*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "slurm_cluster: the node did not come up; sinfo says '${state:-nothing}'" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
