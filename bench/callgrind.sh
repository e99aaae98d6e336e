#!/usr/bin/env bash
# Instructions per record of the callgrind workload (bench/src/callgrind.rs): runs one system
# under `valgrind --tool=callgrind`, divides the cost of the drain's dump by the records it
# covers, and writes callgrind_annotate's inclusive and self breakdowns beside it.
#
#   bench/callgrind.sh [sessionflow|ceiling|sequential] [workload args, e.g. --records 50000]
#
# BIN (default target/release/sessionflow-bench) and OUT_DIR (default target/callgrind) can be
# set. With SESSIONFLOW_BROKERS set (scripts/with-broker.sh sets it), the records live on that
# cluster (Apache Kafka) unless the arguments name one; without it, on librdkafka's mock cluster
# inside the measured process. Needs valgrind; build the binary first (cargo build --release -p
# sessionflow-bench).
set -euo pipefail
system=${1:-sessionflow}
shift || true
if [[ -n ${SESSIONFLOW_BROKERS:-} && " $* " != *" --brokers "* ]]; then
  set -- --brokers "$SESSIONFLOW_BROKERS" "$@"
fi
bin=${BIN:-target/release/sessionflow-bench}
dir=${OUT_DIR:-target/callgrind}
mkdir -p "$dir"
out="$dir/$system.out"
rm -f "$out" "$out".*
valgrind --tool=callgrind --callgrind-out-file="$out" \
  "$bin" callgrind-workload --system "$system" "$@" \
  >"$dir/$system.txt" 2>"$dir/$system.valgrind.log"
part=$(grep -l '^desc: Trigger: Client Request: drained' "$out"* | head -1)
# The dump's own cost is its `totals:` line (the sum of its cost lines: what ran between the
# zero and the dump). Its `summary:` line counts from the process's start whatever the client
# requests zeroed (here, producing the records and the first tenth of the drain): it is not used.
total=$(awk '/^totals:/ { print $2; exit }' "$part")
records=$(awk -F': ' '/^records measured/ { print $2 }' "$dir/$system.txt")
callgrind_annotate --inclusive=yes --threshold=100 --auto=no "$part" >"$dir/$system.inclusive.txt"
callgrind_annotate --threshold=100 --auto=no "$part" >"$dir/$system.self.txt"
cat "$dir/$system.txt"
echo "instructions: $total"
echo "instructions per record: $((total / records))"
echo "breakdown: $dir/$system.inclusive.txt, $dir/$system.self.txt"
