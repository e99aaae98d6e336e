#!/usr/bin/env bash
# Runs every test of the workspace against the broker in $SESSIONFLOW_BROKERS: with
# cargo-nextest when it is installed (each test in its own process, hung tests terminated,
# see .config/nextest.toml), with cargo test otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${SESSIONFLOW_BROKERS:?start a broker first (scripts/with-broker.sh does)}"
if cargo nextest --version >/dev/null 2>&1; then
  exec cargo nextest run --workspace --profile "${NEXTEST_PROFILE:-default}"
else
  echo "run-tests.sh: cargo-nextest not installed; using cargo test" >&2
  exec cargo test --workspace
fi
