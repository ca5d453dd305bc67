# Shared by the Go build scripts (controlplane/, tools/, cni/), which source it.

# require_go: fails with how to get Go when it is missing.
require_go() {
  command -v go >/dev/null || { echo "go not found: install Go 1.26 or newer (https://go.dev/dl/ or your distribution's golang package)"; exit 1; }
}

# with_progress WHAT CMD...: runs CMD, printing WHAT first and a line with the elapsed time every
# 30 seconds until it ends; returns CMD's status.
with_progress() {
  local what=$1 start=$SECONDS pid status
  shift
  echo "$what"
  "$@" &
  pid=$!
  while ! wait_for "$pid" 30; do
    echo "  ... still $what: $((SECONDS - start)) s"
  done
  wait "$pid" && status=0 || status=$?
  [ $((SECONDS - start)) -lt 30 ] || echo "  done in $((SECONDS - start)) s"
  return "$status"
}

# wait_for PID SECONDS: true once PID has exited, false if it still runs after SECONDS.
wait_for() {
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    kill -0 "$1" 2>/dev/null || return 0
    sleep 0.1
  done
  ! kill -0 "$1" 2>/dev/null
}

# first_line CMD...: the first line of CMD's output. Captured whole, then cut: `cmd | head -1`
# under pipefail fails with 141 whenever cmd writes after head has exited (SIGPIPE). Every build
# script prints versions this way (tests/testenv/tests/build_script.rs drives them all).
first_line() {
  local text
  text=$("$@")
  echo "${text%%$'\n'*}"
}
