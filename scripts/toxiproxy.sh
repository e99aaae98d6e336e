#!/usr/bin/env bash
# toxiproxy (github.com/Shopify/toxiproxy/v2): a TCP proxy whose HTTP API adds latency, cuts
# and resets between a client and a server. The chaos run on Apache Kafka puts one in front
# of every broker (scripts/kafka.sh start --proxied) so that network faults between the
# workers and one broker are real TCP behaviour, not a stand-in. Built from the Go module proxy.
#
#   scripts/toxiproxy.sh install   build toxiproxy-server and toxiproxy-cli into
#                                  ~/.cache/sessionflow/toxiproxy-<version>/bin; idempotent
#   scripts/toxiproxy.sh bin       print the server binary's path (installs first if needed)
set -euo pipefail

TOXIPROXY_VERSION=${TOXIPROXY_VERSION:-v2.12.0}
CACHE=${SESSIONFLOW_CACHE:-$HOME/.cache/sessionflow}
ROOT="$CACHE/toxiproxy-$TOXIPROXY_VERSION"
BIN="$ROOT/bin"

say() { echo "toxiproxy.sh: $*" >&2; }
die() { say "$*"; exit 1; }

install() {
  if [[ -x "$BIN/server" && -x "$BIN/cli" && -f "$ROOT/.installed" ]]; then return 0; fi
  local go
  go=$(command -v go || true)
  [[ -z $go && -x /usr/local/go/bin/go ]] && go=/usr/local/go/bin/go
  [[ -n $go ]] || die "go is needed (toxiproxy is built from the Go module proxy)"
  say "building github.com/Shopify/toxiproxy/v2 $TOXIPROXY_VERSION into $BIN"
  mkdir -p "$BIN.partial"
  GOBIN="$BIN.partial" CGO_ENABLED=0 "$go" install \
    "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" \
    "github.com/Shopify/toxiproxy/v2/cmd/cli@$TOXIPROXY_VERSION" >&2 \
    || die "go install of toxiproxy $TOXIPROXY_VERSION failed"
  rm -rf "$BIN"
  mv "$BIN.partial" "$BIN"
  touch "$ROOT/.installed"
  say "installed toxiproxy $TOXIPROXY_VERSION ($("$BIN/server" -version 2>&1 | head -n1))"
}

case "${1:-}" in
  install) install ;;
  bin) install; echo "$BIN/server" ;;
  *) echo "usage: $0 install | bin" >&2; exit 2 ;;
esac
