#!/usr/bin/env bash
# A local Kafka-protocol broker for tests, the demo and CI: nisshi 0.8.1 (Tansu's successor).
#
#   scripts/broker.sh install   build nisshi once into the cache (~9 min cold on 2 cores)
#   scripts/broker.sh start     start it on 127.0.0.1:$BROKER_PORT (default 9092), wait until ready
#   scripts/broker.sh stop      stop the broker this script started on that port
#   scripts/broker.sh status    exit 0 when something answers on the port
#
# Memory storage: nothing survives a restart, which is what tests want.
set -euo pipefail

NISSHI_VERSION=0.8.1
PORT=${BROKER_PORT:-9092}
CACHE=${SESSIONFLOW_CACHE:-$HOME/.cache/sessionflow}
ROOT="$CACHE/nisshi-$NISSHI_VERSION"
BIN="$ROOT/bin/nisshi"
here=$(cd "$(dirname "$0")/.." && pwd)
STATE="$here/.local"
PIDFILE="$STATE/broker-$PORT.pid"
LOG="$STATE/broker-$PORT.log"

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

install() {
  if [[ -x "$BIN" ]]; then return 0; fi
  command -v cargo >/dev/null || { echo "broker.sh: cargo is needed to build nisshi" >&2; exit 1; }
  echo "broker.sh: building nisshi $NISSHI_VERSION into $ROOT (one time, ~9 min on 2 cores)" >&2
  mkdir -p "$CACHE"
  # --ignore-rust-version: a dependency asks for a newer rustc than this machine's, and builds
  # and runs fine with it (checked by hand, see shared/TESTING.md).
  cargo install nisshi --version "$NISSHI_VERSION" --locked --ignore-rust-version \
    --no-default-features --features dynostore --root "$ROOT" >&2
}

start() {
  if answers; then
    echo "broker.sh: something already answers on 127.0.0.1:$PORT; using it" >&2
    return 0
  fi
  install
  mkdir -p "$STATE"
  nohup "$BIN" broker \
    --listener-url "tcp://127.0.0.1:$PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$PORT" \
    --storage-engine memory://nisshi/ \
    --group-initial-rebalance-delay 0s >"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 150); do
    if answers; then
      echo "broker.sh: nisshi ready on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), log $LOG)" >&2
      return 0
    fi
    if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      echo "broker.sh: nisshi exited; its log:" >&2
      cat "$LOG" >&2
      exit 1
    fi
    sleep 0.2
  done
  echo "broker.sh: nisshi did not answer on port $PORT within 30 s" >&2
  exit 1
}

stop() {
  [[ -f "$PIDFILE" ]] || return 0
  local pid
  pid=$(cat "$PIDFILE")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
  echo "broker.sh: stopped the broker on port $PORT" >&2
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) answers ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
