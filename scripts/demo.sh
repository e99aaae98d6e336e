#!/usr/bin/env bash
# The local demo (`make demo`): the conversational pipeline ingest → nlu → llm → delivery, one
# worker process per stage (`sessionflow-worker run --config examples/demo/<stage>.yaml`), 10%
# transient faults and 0.1% poison records at every stage, 1,000 sessions; a summary table per
# stage, then the last topic verified against the first (exit 1 on an order violation or a lost
# record). See `sessionflow demo --help` (the tools' binary, crate sessionflow-tools; it starts
# the stages from the `sessionflow-worker` binary built beside it).
#
# The broker is embedded (librdkafka's mock cluster, inside the demo process) unless BROKERS
# names a real one, e.g. `scripts/broker.sh start` then BROKERS=127.0.0.1:${BROKER_PORT:-9092}.
#
#   DEMO_RECORDS   records produced            (default 120000)
#   DEMO_RATE      records per second; 0: as fast as possible   (default 2000, so ~1 min)
#   DEMO_SESSIONS  sessions (conversations)    (default 1000)
#   BROKERS        bootstrap servers of a real broker            (default: embedded)
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
"$CARGO" build --quiet -p sessionflow-worker --bin sessionflow-worker -p sessionflow-tools --bin sessionflow
BIN=${CARGO_TARGET_DIR:-target}/debug/sessionflow
args=(demo --records "${DEMO_RECORDS:-120000}" --rate "${DEMO_RATE:-2000}"
      --sessions "${DEMO_SESSIONS:-1000}" --config-dir examples/demo --state-dir .local/demo)
if [[ -n "${BROKERS:-}" ]]; then
  args+=(--brokers "$BROKERS")
fi
exec "$BIN" "${args[@]}"
