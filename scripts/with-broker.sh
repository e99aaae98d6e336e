#!/usr/bin/env bash
# Runs a command with a local broker: starts one unless one already answers on the port, exports
# SESSIONFLOW_BROKERS, and stops the broker afterwards only if this script started it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PORT=${BROKER_PORT:-9092}
export SESSIONFLOW_BROKERS=${SESSIONFLOW_BROKERS:-127.0.0.1:$PORT}
started=0
if ! BROKER_PORT=$PORT "$here/broker.sh" status; then
  BROKER_PORT=$PORT "$here/broker.sh" start
  started=1
fi
cleanup() { if ((started)); then BROKER_PORT=$PORT "$here/broker.sh" stop; fi; }
trap cleanup EXIT
"$@"
