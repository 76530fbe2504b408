#!/usr/bin/env bash
# The Docker tier: receiver ranks as containers on a bridge network, real network
# faults (suites/faults/test_network_docker.py), and validate-cluster across containers with one link capped
# by tc tbf (suites/performance/test_validate_cluster_docker.py).
#   .ci/docker-tier.sh [PYTHON [TEST...]]   PYTHON: the interpreter with the project installed (default python3);
#                                           TEST: pytest paths or node ids instead of suites/faults suites/performance
# Installs docker.io + iptables with apt if dockerd or iptables is missing (needs root), starts a private
# dockerd (own socket and data dirs under /tmp; host networking left alone), runs the tests against it,
# and always stops the engine it started. Where no engine can start, the tests report skipped
# "unknown: <reason>" and this script says so (exit 0: a skip is not a pass, and it is printed as such).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
tests=("${@:2}")
[ ${#tests[@]} -eq 0 ] && tests=(suites/faults suites/performance)
start=$(date +%s)
stamp() { echo "== docker tier $(( $(date +%s) - start ))s: $*"; }

if { ! command -v dockerd >/dev/null || ! command -v iptables >/dev/null; } && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null; then
  stamp "installing docker.io and iptables"
  apt-get update -qq >/dev/null \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io iptables >/dev/null \
    || echo "apt-get install docker.io iptables failed: the tests will skip"
fi

D=""
engine_pid=""
stop_engine() {
  if [ -n "$engine_pid" ] && kill -0 "$engine_pid" 2>/dev/null; then
    kill -TERM "$engine_pid"
    for _ in $(seq 1 40); do kill -0 "$engine_pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$engine_pid" 2>/dev/null && kill -KILL "$engine_pid"
    stamp "dockerd $engine_pid stopped"
  fi
  # never delete through a mount point left behind
  if [ -n "$D" ] && [ -d "$D" ] && ! grep -q " $D" /proc/self/mountinfo; then rm -rf "$D"; fi
}
trap stop_engine EXIT INT TERM

if [ -n "${WEIGHTSYNC_DOCKER_HOST:-}" ]; then
  stamp "using the engine at $WEIGHTSYNC_DOCKER_HOST"
elif command -v dockerd >/dev/null && [ "$(id -u)" = 0 ]; then
  D=$(mktemp -d /tmp/wsf-tier-XXXXXX)
  init=()
  command -v docker-init >/dev/null || init=(--init-path "$(command -v tini-static || command -v tini || echo /nonexistent)")
  dockerd -H "unix://$D/docker.sock" --data-root "$D/root" --exec-root "$D/exec" --pidfile "$D/dockerd.pid" \
    --iptables=false --bridge=none --storage-driver=vfs "${init[@]}" >"$D/dockerd.log" 2>&1 &
  engine_pid=$!
  for _ in $(seq 1 60); do
    [ -S "$D/docker.sock" ] && "$py" -c "import docker,sys; docker.DockerClient(base_url=sys.argv[1]).ping()" \
      "unix://$D/docker.sock" 2>/dev/null && break
    kill -0 "$engine_pid" 2>/dev/null || break
    sleep 0.5
  done
  if "$py" -c "import docker,sys; docker.DockerClient(base_url=sys.argv[1]).ping()" "unix://$D/docker.sock" 2>/dev/null; then
    export WEIGHTSYNC_DOCKER_HOST="unix://$D/docker.sock"
    stamp "dockerd $engine_pid ready at $WEIGHTSYNC_DOCKER_HOST"
  else
    echo "dockerd did not start; its log:"; tail -20 "$D/dockerd.log"
    stop_engine; engine_pid=""
  fi
else
  stamp "no dockerd (or not root): the tests will skip"
fi

export WEIGHTSYNC_DOCKER=1
log=$(mktemp /tmp/wsf-tier-pytest-XXXXXX.log)
timeout 1500 "$py" -m pytest -m docker "${tests[@]}" -p no:randomly -rs -v --durations=0 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if grep -q "unknown: " "$log"; then
  echo "docker tier: SKIPPED, not passed ($(grep -o 'unknown: .*' "$log" | head -1))"
fi
rm -f "$log"
stamp "pytest exited $rc"
exit "$rc"
