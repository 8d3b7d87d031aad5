# Shared by up.sh and down.sh (sourced, not run).

# alive PIDFILE COMM -> true if the pid in PIDFILE runs and is COMM
# (checking the name guards against a stale pidfile and a recycled pid)
alive() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}

# dev_layout -> sets NODES, C (state folder), the daemons' ports and, for a
# multi-node cluster, its network names, from SLURM_DEV_NODES (default 1).
# One home for these, so up.sh and down.sh always agree on which instance they
# mean. The one-node cluster keeps $ROOT/cluster and ports 6817-6820; an
# N-node one gets $ROOT/cluster-<N>n and ports shifted by 20*(N-1), so both
# run side by side with their own munged, slurmctld, slurmdbd and MariaDB.
dev_layout() {
  NODES=${SLURM_DEV_NODES:-1}
  case "$NODES" in
    ''|*[!0-9]*|0) echo "SLURM_DEV_NODES must be a positive integer, got '$NODES'" >&2; return 1 ;;
  esac
  [ "$NODES" -le 9 ] || { echo "SLURM_DEV_NODES must be <= 9" >&2; return 1; }
  local shift=$(( 20 * (NODES - 1) ))
  CTLD_PORT=$(( 6817 + shift ))
  SLURMD_PORT=$(( 6818 + shift ))
  DBD_PORT=$(( 6819 + shift ))
  DB_PORT=${DB_PORT:-$(( 6820 + shift ))}
  if [ "$NODES" = 1 ]; then
    C=$ROOT/cluster
    return 0
  fi
  C=$ROOT/cluster-${NODES}n
  # names of the network made for the nodes (kernel names: <= 15 chars)
  NET=${SLURM_DEV_NET:-bisl${NODES}n}
  SUBNET=${SLURM_DEV_SUBNET:-10.213.${NODES}}
  BRIDGE=${NET}br
  HOST_ADDR=$SUBNET.1
  NODE_PREFIX=node
}
# node_name I / node_addr I / node_netns I / node_veth I  (I = 1..NODES)
node_name() { echo "${NODE_PREFIX}$1"; }
node_addr() { echo "$SUBNET.$(( 10 + $1 ))"; }
node_netns() { echo "${NET}-ns$1"; }
node_veth() { echo "${NET}v$1"; }
