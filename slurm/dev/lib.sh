# Shared by up.sh and down.sh (sourced, not run).

# alive PIDFILE COMM -> true if the pid in PIDFILE runs and is COMM
# (checking the name guards against a stale pidfile and a recycled pid)
alive() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}
