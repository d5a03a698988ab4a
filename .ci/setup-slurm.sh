#!/usr/bin/env bash
# .ci/setup-slurm.sh — a real Slurm on this one host (munged, slurmctld, slurmd) for tests/test_slurm.py.
#
# Run as root on Debian 12 (no systemd needed). Idempotent: with the daemons already up and the config
# unchanged it changes nothing and exits 0. The daemons are started directly, each with a PID file under
# /run, so .ci/teardown-slurm.sh stops exactly them. Every wait has a deadline; nothing sleeps blindly.
#
#   .ci/setup-slurm.sh          # install (apt, first time only), configure, start, wait for idle nodes
#   .ci/teardown-slurm.sh       # cancel leftover jobs, stop the daemons
#
# Knobs (environment):
#   SLURM_SETUP_TIMEOUT  seconds to wait for each daemon / the nodes (default 60)
#   SLURM_CRED_EXPIRE    credential lifetime; also how long a requeued job waits before it may start
#                        again (Slurm's default is 120 s; default here 10, minimum 5)
#   SLURM_NODES          2 (default): two Slurm nodes n1, n2 emulated on this host, one slurmd each
#                        (`slurmd -N nI`, its own port), each with every CPU of the host, so that
#                        multi-node jobs (sbatch -N2) run for real here; their names do not resolve, their
#                        NodeAddr is 127.0.0.1. 1: one node named after this host. N: n1..nN.
#                        (Several slurmd on one host work with Debian 12's slurm-wlm 22.05.8; a build
#                        that refuses them times out at "slurmd of n2 to register": use 1 there.)
#
# Logs: /var/log/slurm/slurmctld.log, /var/log/slurm/slurmd-<node>.log, /var/log/munge/munged.log.
# There is no slurmdbd (so no sacct): `scontrol show job` keeps finished jobs for MinJobAge=300 s.
set -euo pipefail

TIMEOUT="${SLURM_SETUP_TIMEOUT:-60}"
CRED_EXPIRE="${SLURM_CRED_EXPIRE:-10}"
NODES="${SLURM_NODES:-2}"
HOST="$(hostname -s)"
CONF=/etc/slurm/slurm.conf
MUNGE_PID=/run/munge/munged.pid
CTLD_PID=/run/slurmctld.pid
LOGDIR=/var/log/slurm
# The Slurm node names, and one PID file per slurmd (SlurmdPidFile=/run/slurmd-%n.pid below).
if [[ $NODES == 1 ]]; then NAMES=("$HOST"); else NAMES=(); for ((i = 1; i <= NODES; i++)); do NAMES+=("n$i"); done; fi
slurmd_pid() { echo "/run/slurmd-$1.pid"; }

log() { echo "[setup-slurm] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# running PID NAME: true if PID is a live (non-zombie) process called NAME. An init that does not reap
# orphans at once can leave a killed daemon as a zombie that still passes `kill -0`; the name check
# guards against PID reuse.
running() {
  local st
  st="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  [[ "$(cat "/proc/$1/comm" 2>/dev/null)" == "$2" ]] || return 1
  st="${st##*) }"; [[ "${st:0:1}" != Z ]]
}
# alive PIDFILE NAME: true if the PID file names a running NAME process.
alive() { [[ -s "$1" ]] && running "$(cat "$1")" "$2"; }

# wait_for DESC CMD...: retry CMD every 0.5 s until it succeeds or TIMEOUT passes.
wait_for() {
  local desc=$1; shift
  local end=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    (( SECONDS < end )) || die "timeout (${TIMEOUT}s) waiting for $desc"
    sleep 0.5
  done
}

[[ $EUID -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"
(( CRED_EXPIRE >= 5 )) || die "SLURM_CRED_EXPIRE must be at least 5 (Slurm's minimum), got $CRED_EXPIRE"
[[ $NODES =~ ^[1-9][0-9]?$ ]] || die "SLURM_NODES must be a number from 1 to 99, got '$NODES'"

# --- 1. packages (first time only) ---------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurmctld, slurmd, slurm-client and munge with apt"
  # Keep the packages' maintainer scripts from starting services (there may be no init system).
  created_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d; created_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || log "apt-get update failed; trying the install with the cached lists"
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  if (( created_policy )); then rm -f /usr/sbin/policy-rc.d; fi
fi

# --- 2. the host name must resolve (slurmctld and slurmd look it up) -----------------------------------
getent hosts "$HOST" >/dev/null || { log "adding $HOST to /etc/hosts"; echo "127.0.0.1 $HOST" >> /etc/hosts; }

# --- 3. munge: key and folders --------------------------------------------------------------------------
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating the munge key"
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
  else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
fi
# munged refuses a key or folders with loose permissions or the wrong owner.
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key

# --- 4. slurm.conf for this one host --------------------------------------------------------------------
mkdir -p /etc/slurm /var/spool/slurmctld "$LOGDIR"
for name in "${NAMES[@]}"; do mkdir -p "/var/spool/slurmd/$name"; done
# The topology and memory slurmd detects, e.g. "CPUs=2 Boards=1 SocketsPerBoard=1 ... RealMemory=24105".
NODE_HW="$(slurmd -C | head -n1 | sed -E 's/^NodeName=[^ ]+ //')"
[[ "$NODE_HW" =~ RealMemory=([0-9]+) ]] || die "could not read the hardware from 'slurmd -C'"
# Configure 98% of the memory (shared out between emulated nodes): a node reporting less than its
# configured RealMemory is drained.
NODE_HW="${NODE_HW/RealMemory=${BASH_REMATCH[1]}/RealMemory=$((BASH_REMATCH[1] * 98 / 100 / NODES))}"
if [[ $NODES == 1 ]]; then
  NODE_LINES="NodeName=$HOST $NODE_HW State=UNKNOWN"
else
  NODE_LINES="$(for ((i = 1; i <= NODES; i++)); do
    echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i)) $NODE_HW State=UNKNOWN"
  done)"
fi
NODE_LIST="$(IFS=,; echo "${NAMES[*]}")"
NEW_CONF="$(cat <<EOF
# Generated by .ci/setup-slurm.sh: a single-host test cluster.
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s, min 5).
AuthInfo=cred_expire=$CRED_EXPIRE
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
# CR_Core, not CR_Core_Memory: with memory tracking and no DefMemPerCPU every job would get all the
# node's memory, so only one job could run at a time.
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Look at pending (e.g. requeued) jobs every 2 s instead of every 60 s / 30 s.
SchedulerParameters=sched_interval=2,bf_interval=1
JobRequeue=1
# Reject impossible requests (e.g. -N2 on this one-node cluster) at submit time instead of leaving them
# PENDING forever with Reason=PartitionConfig.
EnforcePartLimits=ALL
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Keep finished jobs visible to 'scontrol show job' for 5 min (there is no sacct here).
MinJobAge=300
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=30
$NODE_LINES
PartitionName=debug Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP
EOF
)"
CONF_CHANGED=0
if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$NEW_CONF" ]]; then
  log "writing $CONF"
  printf '%s\n' "$NEW_CONF" > "$CONF"
  CONF_CHANGED=1
fi

# --- 5. start the daemons that are not running -----------------------------------------------------------
if ! alive "$MUNGE_PID" munged; then
  log "starting munged"
  rm -f /run/munge/munge.socket.2*            # a stale socket from an unclean stop
  runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID"
fi
wait_for "a munge round trip (see /var/log/munge/munged.log)" bash -c 'munge -n | unmunge'

# A changed config under running daemons: restart them (`scontrol reconfigure` does not re-read
# everything; AuthInfo=cred_expire, for one, keeps its old value).
if (( CONF_CHANGED )); then
  for pf in /run/slurmd*.pid "$CTLD_PID"; do      # every slurmd, whatever node it was, then slurmctld
    name=slurmd; [[ $pf == "$CTLD_PID" ]] && name=slurmctld
    if alive "$pf" "$name"; then
      pid="$(cat "$pf")"; log "config changed: stopping $name (pid $pid)"; kill -TERM "$pid"
      end=$((SECONDS + TIMEOUT))
      while running "$pid" "$name"; do
        (( SECONDS < end )) || die "timeout (${TIMEOUT}s) waiting for $name (pid $pid) to exit"
        sleep 0.2
      done
    fi
  done
fi

if ! alive "$CTLD_PID" slurmctld; then
  log "starting slurmctld"
  slurmctld                                   # daemonizes and writes $CTLD_PID
fi
wait_for "slurmctld to answer (see $LOGDIR/slurmctld.log)" scontrol ping

# slurmctld may still show a node idle from its saved state, so after starting a slurmd also wait
# until it has registered again: SlurmdStartTime >= the time it was started.
registered_since() {  # registered_since NODE EPOCH
  alive "$(slurmd_pid "$1")" slurmd || return 1
  local t; t="$(scontrol show node "$1" | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)"
  [[ -n $t && $t != None ]] && (( $(date -d "$t" +%s) >= $2 - 1 ))
}
for name in "${NAMES[@]}"; do
  if ! alive "$(slurmd_pid "$name")" slurmd; then
    log "starting slurmd for node $name"
    t0=$(date +%s)
    if [[ $NODES == 1 ]]; then slurmd; else slurmd -N "$name"; fi   # daemonizes, writes its PID file
    wait_for "slurmd of $name to register (see $LOGDIR/slurmd-$name.log)" registered_since "$name" "$t0"
  fi
done

# After an unclean stop a node may come back DOWN or DRAINED: resume it.
node_state() { sinfo -h -n "$1" -o %T 2>/dev/null || true; }
for name in "${NAMES[@]}"; do
  end=$((SECONDS + TIMEOUT))
  until [[ "$(node_state "$name")" =~ ^(idle|mixed|allocated)$ ]]; do
    state="$(node_state "$name")"
    if [[ "$state" == down* || "$state" == drain* ]]; then
      scontrol update NodeName="$name" State=RESUME >/dev/null 2>&1 || true
    fi
    if (( SECONDS >= end )); then
      log "node $name state: '$state'; the last lines of $LOGDIR/slurmd-$name.log:"
      tail -n 20 "$LOGDIR/slurmd-$name.log" >&2 || true
      die "timeout (${TIMEOUT}s) waiting for node $name to become idle"
    fi
    sleep 0.5
  done
done
log "ready: $(sinfo -h -o '%P %a %D %T %N' | tr '\n' ' ')($(sinfo -V), cred_expire=${CRED_EXPIRE}s)"
