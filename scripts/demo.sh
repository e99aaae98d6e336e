#!/usr/bin/env bash
# The local demo: one stage with fault injection over 1,000 sessions, verified at the end.
# Expects a broker at $SESSIONFLOW_BROKERS (scripts/with-broker.sh provides one).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/sessionflow-worker}
BROKERS=${SESSIONFLOW_BROKERS:-127.0.0.1:9092}
RECORDS=${RECORDS:-100000}
SESSIONS=${SESSIONS:-1000}
run_id=$(date +%s)
IN=demo-in-$run_id OUT=demo-out-$run_id DLQ=demo-dlq-$run_id GROUP=sessionflow-demo-$run_id
mkdir -p .local
config=.local/demo-stage-$run_id.yaml
sed -e "s/^input: .*/input: $IN/" -e "s/^output: .*/output: $OUT/" -e "s/^dlq: .*/dlq: $DLQ/" \
    -e "s/^group: .*/group: $GROUP/" examples/demo-stage.yaml >"$config"

echo "== topics: $IN → [stage demo] → $OUT (DLQ $DLQ), 8 partitions"
"$BIN" create-topics --brokers "$BROKERS" --partitions 8 "$IN" "$OUT" "$DLQ"

echo "== loadgen: $RECORDS records over $SESSIONS sessions (uniform), numbered per session"
"$BIN" loadgen --brokers "$BROKERS" --topic "$IN" --records "$RECORDS" --sessions "$SESSIONS"

echo "== stage: builtin handler, 10% transient faults, 0.1% poison, 2 ms per attempt"
log=.local/demo-worker-$run_id.log
"$BIN" run --config "$config" --brokers "$BROKERS" 2>"$log" &
worker=$!
trap 'kill $worker 2>/dev/null || true' EXIT
start=$(date +%s.%N)
"$BIN" lag --brokers "$BROKERS" --group "$GROUP" --topic "$IN" --wait-zero --timeout-secs 600
end=$(date +%s.%N)
kill -TERM $worker
wait $worker || true
trap - EXIT
grep -E "stage stopped" "$log" | sed 's/^.*INFO/  /' || true

echo "== verify: $OUT against $IN, DLQ counted as accounted for"
set +e
"$BIN" verify --brokers "$BROKERS" --topic "$OUT" --dlq "$DLQ" --input "$IN"
verdict=$?
set -e
python3 - "$RECORDS" "$start" "$end" <<'PY'
import sys
records, start, end = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
print(f"== summary: {records} records processed in {end-start:.1f}s "
      f"({records/(end-start):,.0f} records/s end to end, 2 ms simulated work per attempt)")
PY
exit $verdict
