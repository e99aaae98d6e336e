#!/usr/bin/env bash
# A real Kubernetes API server for CRD tests: apiextensions-apiserver (Kubernetes 1.36) over etcd.
#
#   scripts/apiserver.sh install     build apiextensions-apiserver once into the cache, from Debian
#                                    sid's Go source packages (~5 min cold on 2 cores); exit 3 with
#                                    a line "SKIPPED: ..." when it cannot be built
#   scripts/apiserver.sh start       start etcd on 127.0.0.1:$ETCD_PORT (default 12379) and the API
#                                    server on https://127.0.0.1:$APISERVER_PORT (default 16443),
#                                    wait until /healthz says ok
#   scripts/apiserver.sh stop        stop both, drop etcd's data
#   scripts/apiserver.sh status      exit 0 when /healthz says ok
#   scripts/apiserver.sh kubeconfig  print the kubeconfig's absolute path (client cert, O=system:masters)
#   scripts/apiserver.sh installed   exit 0 when the binary is in the cache
#
# It serves CustomResourceDefinitions and custom resources only (schema, CEL rules, defaults,
# pruning, status subresource, server-side apply): no core API, no controllers, no GC.
# /healthz is the readiness probe; /readyz stays 500 without a core API server.
# Certs, kubeconfig, pid files and logs live in .local/apiserver/.
set -euo pipefail

PORT=${APISERVER_PORT:-16443}
ETCD_PORT=${ETCD_PORT:-12379}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-12380}
CACHE=${SESSIONFLOW_CACHE:-$HOME/.cache/sessionflow}
ROOT="$CACHE/apiextensions-apiserver"
BIN="$ROOT/bin/apiextensions-apiserver"
# The Go toolchain package from sid; empty: golang-1.26-go if sid has it, else sid's newest.
GO_PKG=${APISERVER_GO_PKG:-}
here=$(cd "$(dirname "$0")/.." && pwd)
STATE="$here/.local/apiserver"
PKI="$STATE/pki"
KUBECONFIG_FILE="$STATE/kubeconfig"
ETCD_DATA="$STATE/etcd"
ETCD_PID="$STATE/etcd.pid"
API_PID="$STATE/apiserver.pid"
ETCD_LOG="$STATE/etcd.log"
API_LOG="$STATE/apiserver.log"

say() { echo "apiserver.sh: $*" >&2; }
skip() {
  echo "SKIPPED: apiextensions-apiserver cannot be built here: $*"
  exit 3
}
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

healthy() {
  [[ -f "$PKI/client.crt" ]] || return 1
  [[ $(curl -sS --max-time 3 --cacert "$PKI/ca.crt" --cert "$PKI/client.crt" --key "$PKI/client.key" \
    "https://127.0.0.1:$PORT/healthz" 2>/dev/null) == ok ]]
}
# alive PIDFILE NAME: the pid in PIDFILE runs and its command line mentions NAME.
alive() {
  [[ -f "$1" ]] || return 1
  local pid
  pid=$(cat "$1")
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2"
}
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# --- install -------------------------------------------------------------------------------

ensure_tools() {
  local missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v curl >/dev/null || missing+=(curl)
  [[ ${#missing[@]} -eq 0 ]] && return 0
  say "installing ${missing[*]} with apt-get"
  if ! as_root apt-get install -y "${missing[@]}" >&2; then
    as_root apt-get update >&2 || true
    as_root apt-get install -y "${missing[@]}" >&2 || skip "apt-get install ${missing[*]} failed"
  fi
}

# The machine's own Debian mirror (from its apt sources), pointed at sid below.
debian_mirror() {
  local url
  url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -oE '^[^#]*(URIs:|deb )[^#]*' | grep -oE 'https?://[^ ]+' | sed 's:/*$::' |
    grep -E '/debian$' | head -n1 || true)
  echo "${url:-http://deb.debian.org/debian}"
}

build() {
  local work="$ROOT/work"
  local apt="$work/apt"
  rm -rf "$work"
  mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/parts" "$work/debs" "$work/tree" "$ROOT/bin"
  : >"$apt/status"
  local mirror
  mirror=$(debian_mirror)
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror sid main" >"$apt/sources.list"
  # A private apt: its own sources, state and cache, an empty dpkg status (so the dependency
  # closure is complete), nothing of the system's apt state touched.
  local A=(-o "Dir::Etc::SourceList=$apt/sources.list" -o "Dir::Etc::SourceParts=$apt/parts"
    -o "Dir::Etc::Preferences=$apt/preferences" -o "Dir::Etc::PreferencesParts=$apt/parts"
    -o "Dir::State=$apt" -o "Dir::State::Lists=$apt/lists" -o "Dir::State::status=$apt/status"
    -o "Dir::Cache=$apt" -o "Dir::Cache::Archives=$apt/archives"
    -o "Dir::Cache::pkgcache=$apt/pkgcache.bin" -o "Dir::Cache::srcpkgcache=$apt/srcpkgcache.bin"
    -o "APT::Install-Recommends=false" -o "APT::Sandbox::User=root" -o "Acquire::Languages=none"
    -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons-hidpi::DefaultEnabled=false")

  say "reading Debian sid's package lists from $mirror"
  apt-get "${A[@]}" update >"$work/apt-update.log" 2>&1 ||
    { tail -n 5 "$work/apt-update.log" >&2; skip "apt-get update for sid failed (log $work/apt-update.log)"; }
  apt-cache "${A[@]}" show golang-k8s-apiextensions-apiserver-dev >/dev/null 2>&1 ||
    skip "sid has no golang-k8s-apiextensions-apiserver-dev"

  if [[ -z "$GO_PKG" ]]; then
    if apt-cache "${A[@]}" show golang-1.26-go >/dev/null 2>&1; then
      GO_PKG=golang-1.26-go
    else
      GO_PKG=$(apt-cache "${A[@]}" pkgnames golang-1. | grep -E '^golang-1\.[0-9]+-go$' | sort -V | tail -n1 || true)
    fi
  fi
  [[ -n "$GO_PKG" ]] || skip "sid has no golang-1.NN-go"
  local go_minor=${GO_PKG#golang-}
  go_minor=${go_minor%-go}

  # The dependency closure, resolved by apt on an empty system; only Go source packages kept.
  local sim="$work/closure.txt"
  apt-get "${A[@]}" install -s -y golang-k8s-apiextensions-apiserver-dev >"$sim" 2>&1 ||
    { tail -n 5 "$sim" >&2; skip "apt cannot resolve golang-k8s-apiextensions-apiserver-dev in sid"; }
  local pkgs
  mapfile -t pkgs < <(awk '$1 == "Inst" { print $2 }' "$sim" | grep -E '^golang-.*-dev$')
  pkgs+=("$GO_PKG" "golang-$go_minor-src")
  say "downloading ${#pkgs[@]} packages from sid (~270 MB): golang-k8s-apiextensions-apiserver-dev, its Go dependencies, $GO_PKG"
  (cd "$work/debs" && apt-get "${A[@]}" download "${pkgs[@]}") >"$work/apt-download.log" 2>&1 ||
    { tail -n 5 "$work/apt-download.log" >&2; skip "apt-get download from sid failed (log $work/apt-download.log)"; }

  say "unpacking them"
  local deb
  for deb in "$work/debs"/*.deb; do
    dpkg -x "$deb" "$work/tree" || skip "dpkg -x $(basename "$deb") failed"
  done
  local goroot="$work/tree/usr/lib/go-$go_minor"
  [[ -x "$goroot/bin/go" ]] || skip "$GO_PKG has no $goroot/bin/go"
  "$goroot/bin/go" version >/dev/null 2>&1 || skip "sid's go binary does not run here"

  # Debian's golang-*-dev packages install their source under /usr/share/gocode/src: a GOPATH.
  local ver kver
  ver=$(dpkg-deb -f "$work"/debs/golang-k8s-apiextensions-apiserver-dev_*.deb Version)
  kver=${ver%%-*} # 0.36.4 -> Kubernetes v1.36.4
  kver="v1.${kver#0.}"
  local major=1 minor=${kver#v1.}
  minor=${minor%%.*}
  local vpkg=k8s.io/component-base/version
  say "building apiextensions-apiserver $kver with $("$goroot/bin/go" version | awk '{print $3}') (~5 min on 2 cores)"
  if ! env -i PATH=/usr/bin:/bin HOME="$HOME" TMPDIR="${TMPDIR:-/tmp}" \
    GOROOT="$goroot" GOPATH="$work/tree/usr/share/gocode" GOCACHE="$work/gocache" \
    GO111MODULE=off CGO_ENABLED=0 GOTOOLCHAIN=local GOPROXY=off GOFLAGS= GOENV=off GOWORK=off \
    "$goroot/bin/go" build -trimpath -o "$BIN.tmp" \
    -ldflags "-s -w -X $vpkg.gitMajor=$major -X $vpkg.gitMinor=$minor -X $vpkg.gitVersion=$kver -X $vpkg.gitCommit= -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    k8s.io/apiextensions-apiserver >"$work/go-build.log" 2>&1; then
    tail -n 20 "$work/go-build.log" >&2
    skip "go build k8s.io/apiextensions-apiserver failed (log $work/go-build.log)"
  fi
  "$BIN.tmp" --help >/dev/null 2>&1 || skip "the built binary does not run"
  {
    echo "apiextensions-apiserver $kver (golang-k8s-apiextensions-apiserver-dev $ver from sid)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) with $("$goroot/bin/go" version)"
    echo "packages:"
    for deb in "$work/debs"/*.deb; do
      echo "  $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version)"
    done
  } >"$ROOT/BUILD-INFO"
  mv -f "$BIN.tmp" "$BIN"
  [[ -n "${APISERVER_KEEP_WORK:-}" ]] || rm -rf "$work"
}

install() {
  ensure_tools
  if [[ -x "$BIN" ]] && "$BIN" --help >/dev/null 2>&1; then return 0; fi
  mkdir -p "$ROOT"
  # One build at a time; a second caller waits and then finds the binary.
  exec 9>"$ROOT/.lock"
  flock 9
  if ! { [[ -x "$BIN" ]] && "$BIN" --help >/dev/null 2>&1; }; then
    command -v apt-get >/dev/null || skip "no apt-get on this machine"
    command -v dpkg-deb >/dev/null || skip "no dpkg-deb on this machine"
    local t0=$SECONDS
    build
    say "built $(head -n1 "$ROOT/BUILD-INFO") in $((SECONDS - t0)) s"
  fi
  exec 9>&-
}

# --- start / stop --------------------------------------------------------------------------

make_pki() {
  [[ -f "$PKI/ca.crt" && -f "$PKI/server.crt" && -f "$PKI/client.crt" && -f "$PKI/client.key" ]] && return 0
  rm -rf "$PKI"
  mkdir -p "$PKI"
  (
    cd "$PKI"
    umask 077
    key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; } # PKCS#8
    key ca.key
    openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/CN=sessionflow-test-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
      -addext "subjectKeyIdentifier=hash" -out ca.crt
    cat >server.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
EOF
    cat >client.ext <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
EOF
    key server.key
    openssl req -new -key server.key -subj "/CN=localhost" -out server.csr
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 3650 \
      -extfile server.ext -out server.crt 2>/dev/null
    key client.key
    openssl req -new -key client.key -subj "/O=system:masters/CN=sessionflow-test" -out client.csr
    openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 3650 \
      -extfile client.ext -out client.crt 2>/dev/null
    rm -f ./*.csr ./*.ext ca.srl
  )
}

b64() { base64 -w0 <"$1"; }

write_kubeconfigs() {
  local tmp="$KUBECONFIG_FILE.tmp"
  cat >"$tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: sessionflow-test
  cluster:
    server: https://127.0.0.1:$PORT
    certificate-authority-data: $(b64 "$PKI/ca.crt")
users:
- name: sessionflow-test
  user:
    client-certificate-data: $(b64 "$PKI/client.crt")
    client-key-data: $(b64 "$PKI/client.key")
contexts:
- name: sessionflow-test
  context:
    cluster: sessionflow-test
    user: sessionflow-test
    namespace: default
current-context: sessionflow-test
EOF
  mv -f "$tmp" "$KUBECONFIG_FILE"
  # What the server takes for the 'core' API server, which does not exist: nothing listens on
  # port 1, so its lookups fail fast (and are tolerated or skipped).
  cat >"$STATE/dummy-core.kubeconfig" <<'EOF'
apiVersion: v1
kind: Config
clusters:
- name: none
  cluster:
    server: https://127.0.0.1:1
    insecure-skip-tls-verify: true
users:
- name: none
  user:
    token: none
contexts:
- name: none
  context:
    cluster: none
    user: none
current-context: none
EOF
}

ready_line() {
  echo "apiserver ready at https://127.0.0.1:$PORT; KUBECONFIG=$KUBECONFIG_FILE"
}

wait_for() { # wait_for WHAT PIDFILE LOG SECONDS TEST...
  local what=$1 pidfile=$2 log=$3 secs=$4
  shift 4
  local deadline=$((SECONDS + secs)) pid
  pid=$(cat "$pidfile")
  until "$@"; do
    # kill -0, not alive(): right after the fork the child's command line is still this script's.
    if ! kill -0 "$pid" 2>/dev/null; then
      say "$what exited; the end of its log ($log):"
      tail -n 30 "$log" >&2
      stop_all >/dev/null 2>&1 || true
      exit 1
    fi
    if ((SECONDS >= deadline)); then
      say "$what did not become ready within $secs s; the end of its log ($log):"
      tail -n 30 "$log" >&2
      stop_all >/dev/null 2>&1 || true
      exit 1
    fi
    sleep 0.3
  done
}

etcd_healthy() { curl -sS --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }

start() {
  mkdir -p "$STATE"
  exec 8>"$STATE/.lock"
  flock 8
  if alive "$API_PID" apiextensions-apiserver && alive "$ETCD_PID" etcd; then
    PORT=$(cat "$STATE/port" 2>/dev/null || echo "$PORT")
    if ! healthy; then
      wait_for apiextensions-apiserver "$API_PID" "$API_LOG" 60 healthy
    fi
    say "already running (pids $(cat "$API_PID") and $(cat "$ETCD_PID"))"
    ready_line
    return 0
  fi
  stop_all # whatever half of it is left
  install
  for p in "$PORT" "$ETCD_PORT" "$ETCD_PEER_PORT"; do
    if port_taken "$p"; then
      say "port $p on 127.0.0.1 is taken by something this script did not start; set APISERVER_PORT / ETCD_PORT / ETCD_PEER_PORT"
      exit 1
    fi
  done
  make_pki
  write_kubeconfigs
  echo "$PORT" >"$STATE/port"

  local t0=$SECONDS
  rm -rf "$ETCD_DATA"
  mkdir -p "$ETCD_DATA"
  nohup etcd --name sessionflow-test --data-dir "$ETCD_DATA" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "sessionflow-test=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new \
    </dev/null >"$ETCD_LOG" 2>&1 8>&- &
  echo $! >"$ETCD_PID"
  wait_for etcd "$ETCD_PID" "$ETCD_LOG" 30 etcd_healthy

  local dummy="$STATE/dummy-core.kubeconfig"
  nohup "$BIN" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --secure-port "$PORT" \
    --tls-cert-file "$PKI/server.crt" --tls-private-key-file "$PKI/server.key" \
    --cert-dir "$STATE/certs" \
    --client-ca-file "$PKI/ca.crt" \
    --kubeconfig "$dummy" --authentication-kubeconfig "$dummy" --authorization-kubeconfig "$dummy" \
    --authentication-skip-lookup --authentication-tolerate-lookup-failure \
    --enable-priority-and-fairness=false \
    --disable-admission-plugins NamespaceLifecycle,MutatingAdmissionPolicy,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook \
    --enable-garbage-collector=false \
    </dev/null >"$API_LOG" 2>&1 8>&- &
  echo $! >"$API_PID"
  wait_for apiextensions-apiserver "$API_PID" "$API_LOG" 60 healthy
  say "etcd (pid $(cat "$ETCD_PID")) and apiextensions-apiserver (pid $(cat "$API_PID")) up in $((SECONDS - t0)) s; logs in $STATE"
  ready_line
}

kill_pidfile() { # kill_pidfile PIDFILE NAME
  if alive "$1" "$2"; then
    local pid
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

stop_all() {
  kill_pidfile "$API_PID" apiextensions-apiserver
  kill_pidfile "$ETCD_PID" etcd
  rm -rf "$ETCD_DATA"
}

case "${1:-}" in
  install)
    install
    echo "apiserver.sh: $(head -n1 "$ROOT/BUILD-INFO" 2>/dev/null || echo apiextensions-apiserver) is installed at $BIN"
    ;;
  start) start ;;
  stop)
    stop_all
    say "stopped apiextensions-apiserver and etcd"
    ;;
  status)
    PORT=$(cat "$STATE/port" 2>/dev/null || echo "$PORT")
    healthy
    ;;
  kubeconfig) echo "$KUBECONFIG_FILE" ;;
  installed) [[ -x "$BIN" ]] ;;
  *)
    echo "usage: $0 install|start|stop|status|kubeconfig|installed" >&2
    exit 2
    ;;
esac
