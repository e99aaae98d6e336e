#!/usr/bin/env bash
# Runs a command with the test broker: Apache Kafka (scripts/kafka.sh, one node on BROKER_PORT,
# default 9092, which uses ports BROKER_PORT … BROKER_PORT+3). Starts it unless a cluster of
# kafka.sh already answers there, exports SESSIONFLOW_BROKERS, and stops it afterwards only if
# this script started it. SESSIONFLOW_BROKERS set by the caller wins: nothing is started.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PORT=${BROKER_PORT:-9092}
started=0
if [[ -z ${SESSIONFLOW_BROKERS:-} ]]; then
  if "$here/kafka.sh" status --port "$PORT"; then
    SESSIONFLOW_BROKERS=$("$here/kafka.sh" bootstrap --port "$PORT")
  else
    SESSIONFLOW_BROKERS=$("$here/kafka.sh" start --port "$PORT" | tail -n1)
    started=1
  fi
fi
export SESSIONFLOW_BROKERS
cleanup() { if ((started)); then "$here/kafka.sh" stop --port "$PORT"; fi; }
trap cleanup EXIT
"$@"
