#!/usr/bin/env bash
# Single-node Slurm 22.05 test cluster on localhost (Debian 12, run as root,
# no systemd): munged, slurmctld, slurmd and, by default, MariaDB + slurmdbd,
# all started by hand. Used by .ci/run and by people running the Slurm tests.
#
# Usage:   eval "$(bash slurm/dev/up.sh | tail -1)"
#   The LAST line of stdout is always `source <abs path>/cluster/env.sh`;
#   env.sh exports SLURM_CONF (and PATH for the sacct stand-in if WITH_DBD=0).
#
# Idempotent: running daemons are left alone, unless the generated
# slurm.conf / slurmdbd.conf differs from the copy taken when they were
# started ($C/run/<daemon>.conf; see MAX_ARRAY_SIZE below); then only the
# affected daemons are restarted. Job state survives such a restart (it
# lives in StateSaveLocation).
#
# State lives under $SLURM_DEV_ROOT/cluster
# (SLURM_DEV_ROOT defaults to ${TMPDIR:-/tmp}/batchinfer-slurm).
# Stop with slurm/dev/down.sh (PURGE=1 also wipes the state).
#
# Two nodes: SLURM_DEV_NODES=2 bash slurm/dev/up.sh brings up a separate
# cluster (state in $SLURM_DEV_ROOT/cluster-2n, ports 6837-6840, its own
# munged/slurmctld/slurmdbd/MariaDB) whose nodes node1 and node2 each run a
# slurmd in their own network, UTS and mount namespace on a bridge
# (10.213.2.11 and .12; see nodes.sh for why). It runs beside the one-node
# cluster; SLURM_DEV_NODES=2 bash slurm/dev/down.sh stops it alone.
#
# Knobs (environment):
#   WITH_DBD=1       (default) MariaDB + slurmdbd, so real `sacct` works.
#                    submitit polls sacct; without it a job that dies without
#                    writing a result leaves result() waiting forever.
#   WITH_DBD=0       accounting_storage/none; a squeue-based `sacct` stand-in
#                    goes first in PATH via env.sh (jobs are forgotten
#                    MinJobAge s after they end). Switching WITH_DBD on a
#                    running cluster is refused: run down.sh first.
#   MAX_ARRAY_SIZE=N MaxArraySize (default 1001, Slurm's own default; array
#                    indices must be < N). A small value (e.g. 4) lets tests
#                    exercise array splitting with a handful of tiny shards.
#                    Changing it needs a slurmctld restart: after `scontrol
#                    reconfigure`, `scontrol show config` shows the new value
#                    but sbatch still enforces the old one. So when the
#                    requested config differs from the one the running daemons
#                    were started with, up.sh restarts slurmctld and slurmd
#                    (queued and running jobs survive). MaxJobCount is kept
#                    well above MaxArraySize, as Slurm wants.
#   CPUS=N           CPUs advertised for the node (default: nproc). May exceed
#                    the real count (SlurmdParameters=config_overrides).
#                    With SLURM_DEV_NODES >= 2: per node, default 1.
#   NODE_MEM=MB      RealMemory of each node of a multi-node cluster (default
#                    4096: a tiny vLLM engine). Not enforced (CR_Core).
#   SLURM_DEV_NODES=N  nodes (default 1). SLURM_DEV_NET / SLURM_DEV_SUBNET
#                    name the bridge/netns prefix (bisl<N>n) and the /24
#                    (10.213.<N>) of a multi-node cluster.
#   INSTALL=1        apt-get install missing packages (default 1; 0 = fail).
#   DB_PORT=6820     MariaDB TCP port (127.0.0.1). Changing it on a running
#                    cluster needs down.sh first (mariadbd is not restarted).
set -euo pipefail

ROOT=${SLURM_DEV_ROOT:-${TMPDIR:-/tmp}/batchinfer-slurm}
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)   # env.sh must work from any directory
# shellcheck source=slurm/dev/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
dev_layout || exit 1   # C, NODES, *_PORT (and the network names if NODES > 1)
WITH_DBD=${WITH_DBD:-1}
INSTALL=${INSTALL:-1}
MAX_ARRAY_SIZE=${MAX_ARRAY_SIZE:-1001}
if [ "$NODES" = 1 ]; then
  CPUS=${CPUS:-$(nproc)}
  # "localhost" everywhere: the container's hostname may not resolve to itself
  NODE=localhost
  CLUSTER=dev
  CTLD_HOST=localhost
  NODE_FILES=""
else
  CPUS=${CPUS:-1}
  NODE_MEM=${NODE_MEM:-4096}
  NODE="node[1-$NODES]"
  CLUSTER=dev${NODES}n
  # nodes reach the controller at the bridge's host address
  CTLD_HOST="localhost($HOST_ADDR)"
  # one spool dir, pidfile and log per node (%n: the node's name)
  NODE_FILES=-%n
  # shellcheck source=slurm/dev/nodes.sh
  source "$(dirname "${BASH_SOURCE[0]}")/nodes.sh"
fi
export SLURM_CONF=$C/etc/slurm.conf
MUNGE_SOCK=$C/run/munge/munge.socket.2

# logs go to stdout too, but the `source` line printed at the end stays last
log() { echo "[up.sh $(date +%T)] $*"; }
die() { echo "[up.sh] ERROR: $*" >&2; exit 1; }

# wait_for SECONDS CMD... -> retry CMD every 0.2 s until it succeeds
wait_for() {
  local t=$1; shift
  local end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || return 1
    sleep 0.2
  done
}
# stop_daemon PIDFILE COMM -> SIGTERM it, wait for it to exit (SIGKILL after 30 s),
# so that the restart below never races the old process for its port/pidfile
stop_daemon() {
  local pid
  alive "$1" "$2" || return 0
  pid=$(cat "$1")
  log "restarting $2 (stopping pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  wait_for 30 sh -c "! kill -0 $pid" || { kill -KILL "$pid" 2>/dev/null || true; sleep 0.5; }
}

# Each daemon's config is snapshotted to $C/run/<daemon>.conf when it is
# started. Comparing against that snapshot (not against the file on disk,
# which a person may have edited, or a failed earlier run rewritten) tells
# whether the running daemon has the config this run asks for.
# stale DAEMON CONF [COMM] -> true if DAEMON (pidfile $C/run/DAEMON.pid, a
# process named COMM, default DAEMON) is running with a different CONF
stale() {
  alive "$C/run/$1.pid" "${3:-$1}" && ! cmp -s "$2" "$C/run/$1.conf"
}
# start_daemon DAEMON CONF ARGS... -> snapshot CONF, then start DAEMON
start_daemon() {
  local d=$1 conf=$2; shift 2
  log "starting $d"
  cp "$conf" "$C/run/$d.conf"
  "$d" "$@"
}

case "$MAX_ARRAY_SIZE" in ''|*[!0-9]*) die "MAX_ARRAY_SIZE must be an integer, got '$MAX_ARRAY_SIZE'" ;; esac
# 4000001 is Slurm's hard upper bound for MaxArraySize
[ "$MAX_ARRAY_SIZE" -le 4000001 ] || die "MAX_ARRAY_SIZE must be <= 4000001"
# slurm.conf(5): MaxJobCount should be much larger than MaxArraySize
MAX_JOB_COUNT=200000
[ $(( MAX_ARRAY_SIZE * 2 )) -le "$MAX_JOB_COUNT" ] || MAX_JOB_COUNT=$(( MAX_ARRAY_SIZE * 2 ))

# ---------------------------------------------------------------- packages
pkgs=(slurmctld slurmd slurm-client munge)
if [ "$WITH_DBD" = 1 ]; then pkgs+=(slurmdbd mariadb-server); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$INSTALL" = 1 ] || die "missing packages: ${missing[*]}"
  log "apt-get install ${missing[*]}"
  # a fresh machine has no package lists yet: on failure update once, retry
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  }
fi

# ---------------------------------------------------------------- dirs
mkdir -p "$C"/{etc,log,state/ctld,run/munge,munge}
if [ "$NODES" = 1 ]; then mkdir -p "$C/state/d"; fi
chown munge:munge "$C/munge" "$C/run/munge"
chmod 0700 "$C/munge"      # munged insists on a private key dir
chmod 0755 "$C/run/munge"  # munged refuses a socket dir without o+x

# ---------------------------------------------------------------- config
# Switching accounting on a live cluster would leave slurmdbd/mariadb
# half-running; make the user do it explicitly.
if [ -s "$C/mode" ] && [ "$(cat "$C/mode")" != "WITH_DBD=$WITH_DBD" ] && alive "$C/run/slurmctld.pid" slurmctld; then
  die "cluster is running with $(cat "$C/mode"); run down.sh before switching WITH_DBD"
fi
echo "WITH_DBD=$WITH_DBD" > "$C/mode"
# leave 5 % of the memory slurmd sees for the daemons themselves
if [ "$NODES" = 1 ]; then
  MEM=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  MEM=$(( MEM * 95 / 100 ))
  NODE_LINES="NodeName=$NODE CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
  SHARING=""
else
  # Jobs that ask for it (sbatch --oversubscribe) may share a node's one core: how two tasks come
  # to run on the same nodes at once, as tasks sharing a GPU node's cards do on a real cluster.
  SHARING=" OverSubscribe=YES"
  NODE_LINES=""
  for i in $(seq 1 "$NODES"); do
    NODE_LINES+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") NodeHostname=$(node_name "$i") CPUs=$CPUS RealMemory=$NODE_MEM State=UNKNOWN"$'\n'
  done
  NODE_LINES=${NODE_LINES%$'\n'}
fi

if [ "$WITH_DBD" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# the slurmdbd connection does NOT use AuthInfo=socket=; it needs this:
AccountingStoragePass=$MUNGE_SOCK
JobCompType=jobcomp/none"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none"
fi

cat > "$C/etc/slurm.conf.new" <<EOF
# generated by slurm/dev/up.sh -- edits are overwritten
ClusterName=$CLUSTER
SlurmctldHost=$CTLD_HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may restart
# (default 120 s); only a slurmctld restart applies it
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$C/state/ctld
SlurmdSpoolDir=$C/state/d$NODE_FILES
SlurmctldPidFile=$C/run/slurmctld.pid
SlurmdPidFile=$C/run/slurmd$NODE_FILES.pid
SlurmctldLogFile=$C/log/slurmctld.log
SlurmdLogFile=$C/log/slurmd$NODE_FILES.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# frequent passes: a requeued job starts in ~4 s instead of 7-17 s
SchedulerParameters=sched_interval=5,bf_interval=1
$ACCT
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdParameters=config_overrides
MaxArraySize=$MAX_ARRAY_SIZE
MaxJobCount=$MAX_JOB_COUNT
MinJobAge=300
KillWait=10
InactiveLimit=0
$NODE_LINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP$SHARING
EOF
mv "$C/etc/slurm.conf.new" "$C/etc/slurm.conf"

if [ "$WITH_DBD" = 1 ]; then
  (
    umask 077   # slurmdbd refuses a world-readable file (it holds a password)
    cat > "$C/etc/slurmdbd.conf.new" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
LogFile=$C/log/slurmdbd.log
PidFile=$C/run/slurmdbd.pid
EOF
  )
  mv "$C/etc/slurmdbd.conf.new" "$C/etc/slurmdbd.conf"
  chmod 600 "$C/etc/slurmdbd.conf"
fi

{
  printf 'export SLURM_CONF=%q\n' "$C/etc/slurm.conf"
  if [ "$WITH_DBD" != 1 ]; then printf 'export PATH=%q:"$PATH"\n' "$C/bin"; fi
} > "$C/env.sh"
if [ "$WITH_DBD" != 1 ]; then
  # No accounting DB: a tiny `sacct` stand-in answering submitit's
  # `sacct -o JobID,State,NodeList --parsable2 -j ID...` from slurmctld's
  # memory via squeue.
  mkdir -p "$C/bin"
  cat > "$C/bin/sacct" <<'SHIM'
#!/bin/bash
ids=()
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) ids+=("$2"); shift 2 ;;
    --jobs=*)  ids+=("${1#--jobs=}"); shift ;;
    *) shift ;;
  esac
done
[ ${#ids[@]} -gt 0 ] || { echo "sacct shim: only -j is supported" >&2; exit 1; }
echo "JobID|State|NodeList"
exec squeue --states=all -h -o '%i|%T|%N' -j "$(IFS=,; echo "${ids[*]}")"
SHIM
  chmod +x "$C/bin/sacct"
fi

# ---------------------------------------------------------------- munge
if [ ! -s "$C/munge/munge.key" ]; then
  runuser -u munge -- mungekey -c -k "$C/munge/munge.key"
fi
if ! alive "$C/run/munge/munged.pid" munged; then
  log "starting munged"
  # own socket and key, so a system munged (if any) is never touched
  runuser -u munge -- /usr/sbin/munged \
    --key-file="$C/munge/munge.key" --socket="$MUNGE_SOCK" \
    --pid-file="$C/run/munge/munged.pid" --log-file="$C/munge/munged.log" \
    --seed-file="$C/munge/munged.seed"
  wait_for 10 sh -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'" || die "munged not answering"
fi

# ---------------------------------------------------------------- mariadb + slurmdbd
if [ "$WITH_DBD" = 1 ]; then
  DBSOCK=$C/run/mysqld.sock
  if [ ! -d "$C/db/mysql" ]; then
    log "initialising mariadb datadir"
    mkdir -p "$C/db"
    mariadb-install-db --no-defaults --datadir="$C/db" --user=root \
      --auth-root-authentication-method=socket --skip-test-db >"$C/log/mariadb-install.log" 2>&1 \
      || { tail "$C/log/mariadb-install.log"; die "mariadb-install-db failed"; }
  fi
  if ! alive "$C/run/mysqld.pid" mariadbd; then
    log "starting mariadbd (127.0.0.1:$DB_PORT)"
    # --no-defaults: ignore /etc/mysql so a system MariaDB never interferes;
    # small buffer pool keeps it ~110 MB; long lock wait avoids slurmdbd
    # errors on a busy 2-core box
    setsid mariadbd --no-defaults --datadir="$C/db" --user=root \
      --socket="$DBSOCK" --pid-file="$C/run/mysqld.pid" \
      --bind-address=127.0.0.1 --port="$DB_PORT" \
      --log-error="$C/log/mariadb.err" --innodb-buffer-pool-size=64M \
      --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_for 60 mariadb --no-defaults -S "$DBSOCK" -uroot -e 'select 1' \
      || { tail "$C/log/mariadb.err"; die "mariadbd did not start"; }
  fi
  mariadb --no-defaults -S "$DBSOCK" -uroot -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  if stale slurmdbd "$C/etc/slurmdbd.conf"; then stop_daemon "$C/run/slurmdbd.pid" slurmdbd; fi
  if ! alive "$C/run/slurmdbd.pid" slurmdbd; then
    start_daemon slurmdbd "$C/etc/slurmdbd.conf"
    wait_for 60 sacctmgr -n list cluster || { tail "$C/log/slurmdbd.log"; die "slurmdbd not answering"; }
  fi
fi

# ---------------------------------------------------------------- slurmctld + slurmd
# A changed slurm.conf (MAX_ARRAY_SIZE, CPUS, ...) is applied by restarting
# the daemons, never by `scontrol reconfigure`: after a reconfigure with a
# new MaxArraySize, `scontrol show config` reports the new value but sbatch
# still enforces the old one (seen on 22.05); cred_expire also needs a
# restart. slurmd is restarted too so both daemons run the same file.
# slurmds: run/<key>.pid and .conf per node ("slurmd" on the one-node cluster)
if [ "$NODES" = 1 ]; then
  SLURMDS=(slurmd)
  NODE_NAMES=("$NODE")
else
  net_up
  SLURMDS=(); NODE_NAMES=()
  for i in $(seq 1 "$NODES"); do
    SLURMDS+=("slurmd-$(node_name "$i")"); NODE_NAMES+=("$(node_name "$i")")
  done
fi
restart=0
if stale slurmctld "$SLURM_CONF"; then restart=1; fi
for d in "${SLURMDS[@]}"; do if stale "$d" "$SLURM_CONF" slurmd; then restart=1; fi; done
if [ $restart = 1 ]; then
  for d in "${SLURMDS[@]}"; do stop_daemon "$C/run/$d.pid" slurmd; done
  stop_daemon "$C/run/slurmctld.pid" slurmctld
fi
if ! alive "$C/run/slurmctld.pid" slurmctld; then
  start_daemon slurmctld "$SLURM_CONF"
  wait_for 30 sh -c 'scontrol ping | grep -q UP' || { tail "$C/log/slurmctld.log"; die "slurmctld not answering"; }
fi
for i in "${!SLURMDS[@]}"; do
  alive "$C/run/${SLURMDS[$i]}.pid" slurmd && continue
  if [ "$NODES" = 1 ]; then
    start_daemon slurmd "$SLURM_CONF" -N "$NODE"
  else
    log "starting slurmd of ${NODE_NAMES[$i]}"
    cp "$SLURM_CONF" "$C/run/${SLURMDS[$i]}.conf"
    start_node_slurmd $(( i + 1 ))
  fi
done

# every node must become idle; resume it if an unclean stop left it down/drained
end=$(( $(date +%s) + 60 ))
for n in "${NODE_NAMES[@]}"; do
  while :; do
    st=$(sinfo -h -n "$n" -o %T 2>/dev/null || true)
    case "$st" in
      idle|mixed|allocated) break ;;
      down*|drain*|fail*) scontrol update nodename="$n" state=resume || true ;;
    esac
    [ "$(date +%s)" -lt "$end" ] || { sinfo; tail "$C"/log/slurmd*.log; die "node $n not idle (state=$st)"; }
    sleep 0.5
  done
done

log "cluster up: node $NODE state=$st MaxArraySize=$MAX_ARRAY_SIZE WITH_DBD=$WITH_DBD"
daemons=(munge/munged slurmctld "${SLURMDS[@]}")
if [ "$WITH_DBD" = 1 ]; then daemons+=(mysqld slurmdbd); fi
for f in "${daemons[@]}"; do
  printf '  %-14s pid %s\n' "$(basename "$f")" "$(cat "$C/run/$f.pid")"
done
# must stay the last line of stdout: callers `eval "$(... | tail -1)"`
printf 'source %q\n' "$C/env.sh"
