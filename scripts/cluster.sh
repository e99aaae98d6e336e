#!/usr/bin/env bash
# A local Kubernetes control plane on 127.0.0.1 (issue 36, step 1): etcd, kube-apiserver (RBAC,
# ServiceAccount tokens), kube-controller-manager (all controllers: GC, deployments, ...),
# kube-scheduler, and kwok faking nodes (pods scheduled to them become Running/Ready).
#
#   scripts/cluster.sh install    build kube-apiserver, kube-controller-manager, kube-scheduler,
#                                 kubectl (Kubernetes v1.36.3, from the k8s.io/kubernetes module
#                                 through the wrapper module scripts/cluster/) and kwok v0.8.0
#                                 into $CACHE/k8s-v1.36.3/bin; a no-op when they are there;
#                                 exit 3 with a line "SKIPPED: ..." when they cannot be built
#   scripts/cluster.sh start      start everything; return once /readyz is ok and every fake node
#                                 is Ready; the LAST LINE of stdout is the admin kubeconfig's path
#   scripts/cluster.sh stop       stop what it started, delete its data (etcd, certs, logs)
#   scripts/cluster.sh status     exit 0 when all five processes run, /readyz is ok and every
#                                 fake node is Ready
#   scripts/cluster.sh kubeconfig print the admin kubeconfig's path (O=system:masters)
#   scripts/cluster.sh bin        print the binaries' folder (kubectl is there)
#   scripts/cluster.sh installed  exit 0 when the binaries are in the cache
#
# Timings, measured 2026-12-05 on 2 cores shared with three other engineers' cargo builds
# (load average 6-7), go1.26.8, nice -n 19, go build -p 2:
#   cold install, empty cache: 685 s (11.4 min) in all: go mod download 12 s (833 MB of
#     modules into $CACHE/go-mod), the four Kubernetes binaries in one go build 541 s (9.0 min),
#     kwok (its own modules and build) ~115 s; the ~3.5 GB Go build cache is then deleted
#     (CLUSTER_KEEP_GOCACHE=1 keeps it). A second install is a no-op (0.02 s).
#   warm start (binaries cached, nothing running, to the kubeconfig line): 4.2-6.7 s, of which
#     the API server's /readyz ~3 s; stop: ~7 s. An idle cluster: ~550 MB RSS in all
#     (kube-apiserver ~275 MB).
# etcd: Debian's etcd-server 3.4.23 (/usr/bin/etcd) is accepted by kube-apiserver v1.36.3; the API
# server only logs (info) that the RequestWatchProgress feature is not supported and does without.
# Ports (env; defaults clear of 9092-9094, 19300+, 16443, 12379, 22379 and 26443, seen in use here):
#   CLUSTER_APISERVER_PORT 17443  CLUSTER_ETCD_PORT 17379  CLUSTER_ETCD_PEER_PORT 17380
#   CLUSTER_KCM_PORT 17257  CLUSTER_SCHEDULER_PORT 17259  CLUSTER_KWOK_PORT 17247
# CLUSTER_NODES (default 2): how many fake nodes (kwok-node-0 ...). kwok manages only the nodes
# annotated kwok.x-k8s.io/node=fake (these), and the pods bound to them: a node another process
# registers (the test kubelet's sessionflow-local-0, tests/src/kubelet/) is left alone.
# Certificates, kubeconfigs, pid files, logs and etcd's data live in .local/cluster/.
set -euo pipefail

K8S_VERSION=v1.36.3 # must match scripts/cluster/go.mod
KWOK_VERSION=v0.8.0
PORT=${CLUSTER_APISERVER_PORT:-17443}
ETCD_PORT=${CLUSTER_ETCD_PORT:-17379}
ETCD_PEER_PORT=${CLUSTER_ETCD_PEER_PORT:-17380}
KCM_PORT=${CLUSTER_KCM_PORT:-17257}
SCHED_PORT=${CLUSTER_SCHEDULER_PORT:-17259}
KWOK_PORT=${CLUSTER_KWOK_PORT:-17247}
NODES=${CLUSTER_NODES:-2}
CACHE=${SESSIONFLOW_CACHE:-$HOME/.cache/sessionflow}
ROOT="$CACHE/k8s-$K8S_VERSION"
BIN="$ROOT/bin"
GOMODCACHE_DIR="$CACHE/go-mod"
here=$(cd "$(dirname "$0")/.." && pwd)
MODDIR="$here/scripts/cluster"
STATE="$here/.local/cluster"
PKI="$STATE/pki"
KUBECONFIG_FILE="$STATE/admin.kubeconfig"
ETCD_DATA="$STATE/etcd"
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubectl kwok)

say() { echo "cluster.sh: $*" >&2; }
skip() {
  echo "SKIPPED: $*"
  exit 3
}
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# alive NAME: the pid in $STATE/NAME.pid runs and its command line mentions NAME.
alive() {
  local f="$STATE/$1.pid" pid
  [[ -f "$f" ]] || return 1
  pid=$(cat "$f")
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$1"
}

# --- install -------------------------------------------------------------------------------

ensure_tools() {
  local missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v curl >/dev/null || missing+=(curl)
  command -v flock >/dev/null || missing+=(util-linux)
  [[ ${#missing[@]} -eq 0 ]] && return 0
  say "installing ${missing[*]} with apt-get"
  if ! as_root apt-get install -y "${missing[@]}" >&2; then
    as_root apt-get update >&2 || true
    as_root apt-get install -y "${missing[@]}" >&2 || skip "apt-get install ${missing[*]} failed"
  fi
}

installed() {
  local c
  for c in "${COMPONENTS[@]}"; do [[ -x "$BIN/$c" ]] || return 1; done
  [[ -f "$ROOT/kwok-stages.yaml" ]]
}

# goenv CMD...: the go command with this script's caches, nice'd, at most 2 packages at a time.
goenv() {
  env GOMODCACHE="$GOMODCACHE_DIR" GOCACHE="$ROOT/gocache" GOWORK=off GOTOOLCHAIN=local \
    GOFLAGS="-p=2 -buildvcs=false" CGO_ENABLED=0 GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}" \
    nice -n 19 "$@"
}

build() {
  command -v go >/dev/null || skip "no go command on this machine (Go >= 1.26 is needed)"
  local gov
  gov=$(go env GOVERSION)
  [[ $(printf '%s\n' go1.26 "$gov" | sort -V | head -n1) == go1.26 ]] || skip "$gov is older than go1.26, which k8s.io/kubernetes $K8S_VERSION needs"
  mkdir -p "$ROOT/bin.tmp" "$GOMODCACHE_DIR"
  local log="$ROOT/build.log"
  : >"$log"

  say "downloading k8s.io/kubernetes $K8S_VERSION and its modules (~0.8 GB) into $GOMODCACHE_DIR"
  (cd "$MODDIR" && goenv go mod download) >>"$log" 2>&1 ||
    { tail -n 20 "$log" >&2; skip "go mod download of k8s.io/kubernetes $K8S_VERSION failed (log $log)"; }

  local vp=k8s.io/component-base/version cp=k8s.io/client-go/pkg/version ld="-s -w" p minor
  minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  for p in $vp $cp; do
    ld="$ld -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitVersion=$K8S_VERSION -X $p.gitTreeState=clean -X $p.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  say "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $K8S_VERSION (nice, -p 2; ~9 min on 2 shared cores)"
  (cd "$MODDIR" && goenv go build -mod=readonly -trimpath -ldflags "$ld" -o "$ROOT/bin.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl) >>"$log" 2>&1 ||
    { tail -n 20 "$log" >&2; skip "go build of Kubernetes $K8S_VERSION failed (log $log)"; }

  say "building kwok $KWOK_VERSION"
  goenv env GOBIN="$ROOT/bin.tmp" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" >>"$log" 2>&1 ||
    { tail -n 20 "$log" >&2; skip "go install sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION failed (log $log)"; }
  # kwok's default stages (what kwokctl gives it): nodes become Ready and keep a lease; pods
  # become Running/Ready, and are removed once deleted.
  local kdir s
  kdir=$(goenv go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d "$kdir/kustomize/stage" ]] || skip "kwok $KWOK_VERSION's module has no kustomize/stage"
  {
    for s in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
      pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
      echo "---"
      cat "$kdir/kustomize/stage/$s.yaml"
    done
  } >"$ROOT/bin.tmp/kwok-stages.yaml"

  for c in "${COMPONENTS[@]}"; do
    "$ROOT/bin.tmp/$c" --help >/dev/null 2>&1 || skip "the built $c does not run"
  done
  {
    echo "Kubernetes $K8S_VERSION (k8s.io/kubernetes module, wrapper $MODDIR), kwok $KWOK_VERSION"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) with $(go version)"
    echo "etcd: $(etcd --version 2>/dev/null | head -n1) ($(command -v etcd))"
  } >"$ROOT/bin.tmp/BUILD-INFO"
  mv -f "$ROOT/bin.tmp/kwok-stages.yaml" "$ROOT/bin.tmp/BUILD-INFO" "$ROOT/"
  mkdir -p "$BIN"
  for c in "${COMPONENTS[@]}"; do mv -f "$ROOT/bin.tmp/$c" "$BIN/$c"; done
  rmdir "$ROOT/bin.tmp" 2>/dev/null || true
  # The build cache is ~GBs; keep it only when asked (a rebuild then takes minutes).
  [[ -n "${CLUSTER_KEEP_GOCACHE:-}" ]] || rm -rf "$ROOT/gocache"
}

install() {
  ensure_tools
  installed && return 0
  mkdir -p "$ROOT"
  # One build at a time; a second caller waits and then finds the binaries.
  exec 9>"$ROOT/.lock"
  flock 9
  if ! installed; then
    local t0=$SECONDS
    build
    say "built $(head -n1 "$ROOT/BUILD-INFO") in $((SECONDS - t0)) s"
  fi
  exec 9>&-
}

# --- certificates and kubeconfigs ----------------------------------------------------------

make_pki() {
  [[ -f "$PKI/complete" ]] && return 0
  rm -rf "$PKI"
  mkdir -p "$PKI"
  (
    cd "$PKI"
    umask 077
    key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
    key ca.key
    openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/CN=sessionflow-cluster-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
      -addext "subjectKeyIdentifier=hash" -out ca.crt
    # sign NAME SUBJECT EXT: NAME.key and NAME.crt, signed by the CA.
    sign() {
      key "$1.key"
      openssl req -new -key "$1.key" -subj "$2" -out "$1.csr"
      printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
        "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid" "$3" >"$1.ext"
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 3650 \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    }
    sign apiserver "/CN=kube-apiserver" "extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    sign admin "/O=system:masters/CN=sessionflow-admin" "extendedKeyUsage=clientAuth"
    sign controller-manager "/CN=system:kube-controller-manager" "extendedKeyUsage=clientAuth"
    sign scheduler "/CN=system:kube-scheduler" "extendedKeyUsage=clientAuth"
    # kwok writes node and pod status and node leases: an admin (system:masters) identity.
    sign kwok "/O=system:masters/CN=kwok" "extendedKeyUsage=clientAuth,serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost"
    # The aggregation layer's front proxy: its own CA and client certificate (the API server
    # publishes the CA for requestheader authentication; without it every component complains).
    key front-proxy-ca.key
    openssl req -x509 -new -key front-proxy-ca.key -sha256 -days 3650 -subj "/CN=sessionflow-front-proxy-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
      -addext "subjectKeyIdentifier=hash" -out front-proxy-ca.crt
    key front-proxy-client.key
    openssl req -new -key front-proxy-client.key -subj "/CN=front-proxy-client" -out front-proxy-client.csr
    printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
      "extendedKeyUsage=clientAuth" >front-proxy-client.ext
    openssl x509 -req -in front-proxy-client.csr -CA front-proxy-ca.crt -CAkey front-proxy-ca.key -CAcreateserial \
      -sha256 -days 3650 -extfile front-proxy-client.ext -out front-proxy-client.crt 2>/dev/null
    # The ServiceAccount token signing key pair (RSA: what every verifier takes).
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key 2>/dev/null
    openssl pkey -in sa.key -pubout -out sa.pub
    rm -f ./*.csr ./*.ext ./*.srl
    touch complete
  )
}

b64() { base64 -w0 <"$1"; }

# kubeconfig FILE CERTNAME: a kubeconfig for https://127.0.0.1:$PORT with PKI/CERTNAME.{crt,key}.
kubeconfig() {
  cat >"$1.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: sessionflow
  cluster:
    server: https://127.0.0.1:$PORT
    certificate-authority-data: $(b64 "$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(b64 "$PKI/$2.crt")
    client-key-data: $(b64 "$PKI/$2.key")
contexts:
- name: sessionflow
  context:
    cluster: sessionflow
    user: $2
    namespace: default
current-context: sessionflow
EOF
  mv -f "$1.tmp" "$1"
}

# --- start / stop --------------------------------------------------------------------------

apiserver_ready() {
  [[ -f "$PKI/admin.crt" ]] || return 1
  [[ $(curl -sS --max-time 3 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$PORT/readyz" 2>/dev/null) == ok ]]
}
etcd_healthy() { curl -sS --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }
# local_healthz PORT: a component's own /healthz on 127.0.0.1:PORT (always allowed anonymously).
local_healthz() { [[ $(curl -sSk --max-time 2 "https://127.0.0.1:$1/healthz" 2>/dev/null) == ok ]]; }
kctl() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"; }
# nodes_ready: every fake node exists and is Ready.
nodes_ready() {
  local n out
  out=$(kctl get nodes -l type=kwok -o jsonpath='{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' 2>/dev/null) || return 1
  n=$(grep -c '=True$' <<<"$out" || true)
  ((n >= NODES))
}
ready() { apiserver_ready && nodes_ready; }
all_alive() {
  local c
  for c in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do alive "$c" || return 1; done
}

wait_for() { # wait_for NAME SECONDS TEST...: NAME's pid must stay alive while TEST fails.
  local what=$1 secs=$2
  shift 2
  local deadline=$((SECONDS + secs)) pid log="$STATE/$what.log"
  pid=$(cat "$STATE/$what.pid")
  until "$@"; do
    # kill -0, not alive(): right after the fork the child's command line is still this script's.
    if ! kill -0 "$pid" 2>/dev/null; then
      say "$what exited; the end of its log ($log):"
      tail -n 30 "$log" >&2
      kill_all >/dev/null 2>&1 || true
      exit 1
    fi
    if ((SECONDS >= deadline)); then
      say "$what did not become ready within $secs s; the end of its log ($log):"
      tail -n 30 "$log" >&2
      kill_all >/dev/null 2>&1 || true
      exit 1
    fi
    sleep 0.3
  done
}

# launch NAME CMD...: run CMD in the background, its output in $STATE/NAME.log, pid in NAME.pid.
launch() {
  local name=$1
  shift
  nohup "$@" </dev/null >"$STATE/$name.log" 2>&1 8>&- &
  echo $! >"$STATE/$name.pid"
}

fake_node() { # fake_node NAME: a Node for kwok to manage (no taint: any pod may land on it)
  cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $1
  annotations:
    node.alpha.kubernetes.io/ttl: "0"
    kwok.x-k8s.io/node: fake
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: $1
    node-role.kubernetes.io/agent: ""
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    kubeletVersion: fake
    kubeProxyVersion: fake
EOF
}

ready_lines() {
  say "ready: https://127.0.0.1:$PORT, $NODES kwok node(s); kubectl is $BIN/kubectl; logs in $STATE"
  echo "$KUBECONFIG_FILE"
}

start() {
  mkdir -p "$STATE"
  exec 8>"$STATE/.lock"
  flock 8
  if all_alive; then
    PORT=$(cat "$STATE/port" 2>/dev/null || echo "$PORT")
    local deadline=$((SECONDS + 120))
    until ready; do
      ((SECONDS < deadline)) || { say "running but not ready after 120 s; see $STATE/*.log"; exit 1; }
      sleep 0.5
    done
    say "already running"
    ready_lines
    return 0
  fi
  stop_all # whatever part of it is left
  install
  local p
  for p in "$PORT" "$ETCD_PORT" "$ETCD_PEER_PORT" "$KCM_PORT" "$SCHED_PORT" "$KWOK_PORT"; do
    if port_taken "$p"; then
      say "port $p on 127.0.0.1 is taken by something this script did not start; set CLUSTER_*_PORT"
      exit 1
    fi
  done
  local t0=$SECONDS
  mkdir -p "$STATE"
  make_pki
  kubeconfig "$KUBECONFIG_FILE" admin
  kubeconfig "$STATE/controller-manager.kubeconfig" controller-manager
  kubeconfig "$STATE/scheduler.kubeconfig" scheduler
  kubeconfig "$STATE/kwok.kubeconfig" kwok
  echo "$PORT" >"$STATE/port"
  echo "$NODES" >"$STATE/nodes"

  rm -rf "$ETCD_DATA"
  mkdir -p "$ETCD_DATA"
  launch etcd etcd --name sessionflow-cluster --data-dir "$ETCD_DATA" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "sessionflow-cluster=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new
  wait_for etcd 30 etcd_healthy

  # --endpoint-reconciler-type=none: the 'kubernetes' Service gets no endpoints (an Endpoints
  # object may not hold 127.0.0.1, and nothing here dials the Service).
  launch kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$PORT" \
    --endpoint-reconciler-type none \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" --cert-dir "$STATE/apiserver-certs" \
    --authorization-mode Node,RBAC \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --requestheader-client-ca-file "$PKI/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$PKI/front-proxy-client.crt" --proxy-client-key-file "$PKI/front-proxy-client.key" \
    --allow-privileged=true
  wait_for kube-apiserver 120 apiserver_ready

  launch kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$KCM_PORT" \
    --controllers '*' --use-service-account-credentials=true \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --leader-elect=false
  launch kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig "$STATE/scheduler.kubeconfig" \
    --authentication-kubeconfig "$STATE/scheduler.kubeconfig" \
    --authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" \
    --leader-elect=false
  launch kwok "$BIN/kwok" \
    --kubeconfig "$STATE/kwok.kubeconfig" --config "$ROOT/kwok-stages.yaml" \
    --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --tls-cert-file "$PKI/kwok.crt" --tls-private-key-file "$PKI/kwok.key" \
    --node-ip 127.0.0.1 --node-name localhost --node-port "$KWOK_PORT" \
    --server-address "127.0.0.1:$KWOK_PORT" \
    --node-lease-duration-seconds 40
  wait_for kube-controller-manager 60 local_healthz "$KCM_PORT"
  wait_for kube-scheduler 60 local_healthz "$SCHED_PORT"

  local i
  for ((i = 0; i < NODES; i++)); do fake_node "kwok-node-$i"; echo "---"; done |
    kctl apply -f - >"$STATE/nodes.log" 2>&1 || { cat "$STATE/nodes.log" >&2; kill_all; exit 1; }
  wait_for kwok 60 nodes_ready
  say "started in $((SECONDS - t0)) s"
  ready_lines
}

kill_pidfiles() { # kill_pidfiles NAME...: SIGTERM all, wait up to 15 s, then SIGKILL
  local name pid pids=()
  for name in "$@"; do
    if alive "$name"; then
      pid=$(cat "$STATE/$name.pid")
      kill "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  for name in "$@"; do rm -f "$STATE/$name.pid"; done
}

# kill_all: stop the processes and drop etcd's data; the logs stay (a failed start's evidence).
kill_all() {
  kill_pidfiles kwok kube-scheduler kube-controller-manager
  kill_pidfiles kube-apiserver
  kill_pidfiles etcd
  rm -rf "$ETCD_DATA"
}

stop_all() {
  kill_all
  # Its data: etcd's, the certificates, kubeconfigs and logs (state only this script writes).
  if [[ -d "$STATE" ]]; then
    find "$STATE" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf {} +
  fi
}

case "${1:-}" in
  install)
    install
    echo "cluster.sh: $(head -n1 "$ROOT/BUILD-INFO" 2>/dev/null) is installed in $BIN"
    ;;
  start) start ;;
  stop)
    mkdir -p "$STATE"
    exec 8>"$STATE/.lock"
    flock 8
    stop_all
    say "stopped; its data is deleted"
    ;;
  status)
    PORT=$(cat "$STATE/port" 2>/dev/null || echo "$PORT")
    NODES=$(cat "$STATE/nodes" 2>/dev/null || echo "$NODES")
    [[ -x "$BIN/kubectl" ]] && all_alive && ready
    ;;
  kubeconfig) echo "$KUBECONFIG_FILE" ;;
  bin) echo "$BIN" ;;
  installed) installed ;;
  *)
    echo "usage: $0 install|start|stop|status|kubeconfig|bin|installed" >&2
    exit 2
    ;;
esac
