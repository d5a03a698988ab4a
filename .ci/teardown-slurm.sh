#!/usr/bin/env bash
# .ci/teardown-slurm.sh — undo .ci/setup-slurm.sh's daemons: cancel the jobs still in this test
# cluster, then stop slurmd, slurmctld and munged (reverse start order).
#
# Stops by PID file only, and only a PID that still belongs to a process of the expected name; never
# pkill/killall. Safe to run when nothing is running. Packages and /etc/slurm/slurm.conf stay, so a
# later setup is quick.
#
# Knobs: SLURM_TEARDOWN_TIMEOUT seconds per wait (default 30).
set -euo pipefail

TIMEOUT="${SLURM_TEARDOWN_TIMEOUT:-30}"
log() { echo "[teardown-slurm] $*" >&2; }

# running PID NAME: true if PID is a live (non-zombie) process called NAME.
running() {
  local st
  st="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  [[ "$(cat "/proc/$1/comm" 2>/dev/null)" == "$2" ]] || return 1
  st="${st##*) }"; [[ "${st:0:1}" != Z ]]
}
alive() { [[ -s "$1" ]] && running "$(cat "$1")" "$2"; }

# 1. Jobs left by an interrupted test: cancel them while slurmctld and slurmd can still end them (a job
#    whose slurmd is gone would stay COMPLETING in the saved state and come back at the next setup).
if alive /run/slurmctld.pid slurmctld && command -v squeue >/dev/null; then
  jobs="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)"
  if [[ -n "${jobs// /}" ]]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086  # one argument per job id
    scancel $jobs 2>/dev/null || true
    end=$((SECONDS + TIMEOUT))
    while [[ -n "$(squeue -h -o %i 2>/dev/null || true)" ]]; do
      if (( SECONDS >= end )); then log "jobs still listed after ${TIMEOUT}s: $(squeue -h 2>&1 || true)"; break; fi
      sleep 0.5
    done
  fi
fi

# stop NAME PIDFILE: SIGTERM, wait up to TIMEOUT, then SIGKILL.
stop() {
  local name=$1 pidfile=$2 pid end
  if [[ ! -s $pidfile ]]; then log "$name: no PID file"; return 0; fi
  pid="$(cat "$pidfile")"
  if ! running "$pid" "$name"; then
    log "$name: pid $pid is not running"; rm -f "$pidfile"; return 0
  fi
  log "$name: stopping pid $pid"
  kill -TERM "$pid"
  end=$((SECONDS + TIMEOUT))
  while running "$pid" "$name"; do
    if (( SECONDS >= end )); then log "$name: SIGKILL $pid"; kill -KILL "$pid" 2>/dev/null || true; break; fi
    sleep 0.2
  done
  rm -f "$pidfile"
}

for pidfile in /run/slurmd*.pid; do            # one per node: /run/slurmd-<node>.pid
  [[ -e $pidfile ]] && stop slurmd "$pidfile"
done
stop slurmctld /run/slurmctld.pid
stop munged    /run/munge/munged.pid
