# The nodes of a multi-node dev cluster (SLURM_DEV_NODES >= 2; sourced by up.sh
# and down.sh after lib.sh's dev_layout).
#
# Why network namespaces and not Slurm's multiple-slurmd mode: Debian's
# slurm-wlm 22.05.8 is built without --enable-multiple-slurmd (its library
# still has the "Duplicated NodeHostName" check that the mode compiles out),
# and even with it every node would share 127.0.0.1, so nothing would prove
# that ranks of one engine meet across hosts. Here each slurmd runs in its own
# network, UTS and mount namespace: its own address on a bridge the script
# makes ($SUBNET.0/24, the host side is $HOST_ADDR), its own hostname, and an
# /etc/hosts (bind-mounted in its mount namespace only) that names every node,
# so jobs resolve `scontrol show hostnames` as on a real cluster. Processes
# stay in the host's pid namespace and file system: munge's socket, the state
# folder and /dev/shm are shared as on nodes with a shared file system.

# net_up -> bridge, one netns + veth per node, and $C/etc/hosts (idempotent)
net_up() {
  local i ns veth
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "creating bridge $BRIDGE ($HOST_ADDR/24)"
    ip link add "$BRIDGE" type bridge
    ip addr add "$HOST_ADDR/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
  {
    echo "127.0.0.1 localhost"
    echo "$HOST_ADDR ${NET}-host"
    for i in $(seq 1 "$NODES"); do echo "$(node_addr "$i") $(node_name "$i")"; done
  } > "$C/etc/hosts"
  for i in $(seq 1 "$NODES"); do
    ns=$(node_netns "$i"); veth=$(node_veth "$i")
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      log "creating node $(node_name "$i") ($(node_addr "$i") in netns $ns)"
      ip link add "$veth" type veth peer name "${veth}p"
      ip link set "${veth}p" netns "$ns"
      ip netns exec "$ns" ip link set "${veth}p" name eth0
      ip netns exec "$ns" ip addr add "$(node_addr "$i")/24" dev eth0
    fi
    ip link set "$veth" master "$BRIDGE" up
    ip netns exec "$ns" ip link set eth0 up
    # vLLM and other job processes talk to themselves over 127.0.0.1
    ip netns exec "$ns" ip link set lo up
    # as on a real node, a default route: tools that find their own address by
    # routing towards the outside (vLLM's get_ip) see the bridge address, not none
    ip netns exec "$ns" ip route replace default via "$HOST_ADDR"
  done
}

# net_down -> remove what net_up made (call after every slurmd is stopped)
net_down() {
  local i ns
  for i in $(seq 1 "$NODES"); do
    ns=$(node_netns "$i")
    # deleting the netns deletes the veth pair with it
    if [ -e "/run/netns/$ns" ]; then log "removing netns $ns"; ip netns del "$ns"; fi
    ip link del "$(node_veth "$i")" 2>/dev/null || true
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then log "removing bridge $BRIDGE"; ip link del "$BRIDGE"; fi
}

# slurmd_pidfile I -> the pidfile slurm.conf gives node I's slurmd (SlurmdPidFile=...-%n.pid)
slurmd_pidfile() { echo "$C/run/slurmd-$(node_name "$1").pid"; }

# start_node_slurmd I -> slurmd of node I inside its namespaces (it daemonizes)
start_node_slurmd() {
  local name
  name=$(node_name "$1")
  mkdir -p "$C/state/d-$name"
  # nsenter, not `ip netns exec`: that one remounts /sys, hiding
  # /sys/fs/cgroup, and slurmd then refuses to start ("Unable to initialize
  # cgroup plugin")
  # shellcheck disable=SC2016  # expanded by the inner sh
  nsenter --net="/run/netns/$(node_netns "$1")" unshare --uts --mount sh -c \
    'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -N "$1"' sh "$name" "$C/etc/hosts"
}
