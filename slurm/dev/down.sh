#!/usr/bin/env bash
# Stop the test cluster started by slurm/dev/up.sh (same SLURM_DEV_ROOT).
# Cancels all jobs first so no job processes outlive the daemons, then kills
# only the pids recorded in the cluster's own pidfiles (after checking the
# process name), never anything found by name.
#   PURGE=1  also delete all cluster state (job state, accounting DB, logs,
#            munge key) so the next up.sh starts from nothing. Job ids then
#            restart at 1: use fresh submitit folders afterwards.
#   SLURM_DEV_NODES=N  stop the N-node cluster instead (same value as given to
#            up.sh; default 1); the other one is left alone. Also removes the
#            nodes' network namespaces and bridge.
# No `set -e`: one daemon failing to stop must not leave the others running.
set -uo pipefail
ROOT=${SLURM_DEV_ROOT:-${TMPDIR:-/tmp}/batchinfer-slurm}
log() { echo "[down.sh $(date +%T)] $*"; }
# shellcheck source=slurm/dev/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
dev_layout || exit 1   # C (and the network names if NODES > 1)
export SLURM_CONF=$C/etc/slurm.conf

[ -d "$C" ] || { log "nothing to do: $C does not exist"; exit 0; }
# stop "PIDFILE COMM"... : SIGTERM all, wait up to 15 s, then SIGKILL leftovers
stop() {
  local pids=() spec pf comm pid left
  for spec in "$@"; do
    pf=${spec% *}; comm=${spec#* }
    alive "$pf" "$comm" || continue
    pid=$(cat "$pf"); log "stopping $comm (pid $pid)"; kill -TERM "$pid" 2>/dev/null; pids+=("$pid")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for _ in $(seq 1 150); do
    left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null && { log "pid $pid still alive, SIGKILL"; kill -KILL "$pid"; }
  done
  return 0
}

if alive "$C/run/slurmctld.pid" slurmctld; then
  mapfile -t jobs < <(squeue -h -o %A 2>/dev/null)
  if [ ${#jobs[@]} -gt 0 ]; then
    log "cancelling jobs: ${jobs[*]}"
    scancel "${jobs[@]}" 2>/dev/null
    # wait for running/completing jobs to be gone before slurmd goes away
    for _ in $(seq 1 60); do [ -z "$(squeue -h -t R,CG -o %A 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi

# dependants first: slurmd/slurmctld need slurmdbd, which needs mariadb; all need munge
slurmds=("$C/run/slurmd.pid slurmd")
if [ "$NODES" -gt 1 ]; then
  # shellcheck source=slurm/dev/nodes.sh
  source "$(dirname "${BASH_SOURCE[0]}")/nodes.sh"
  slurmds=()
  for i in $(seq 1 "$NODES"); do slurmds+=("$(slurmd_pidfile "$i") slurmd"); done
fi
stop "${slurmds[@]}" "$C/run/slurmctld.pid slurmctld"
if [ "$NODES" -gt 1 ]; then net_down; fi
stop "$C/run/slurmdbd.pid slurmdbd"
stop "$C/run/mysqld.pid mariadbd" "$C/run/munge/munged.pid munged"

if [ "${PURGE:-0}" = 1 ]; then
  log "purging $C"
  rm -rf "$C"
fi
log "done"
