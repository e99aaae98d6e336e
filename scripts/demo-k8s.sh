#!/usr/bin/env bash
# `make demo-k8s`: the whole promise on one machine (issue 36, step 3). A local Kubernetes
# control plane (scripts/cluster.sh), Apache Kafka (scripts/kafka.sh), `helm install` of
# charts/sessionflow, `kubectl apply` of examples/k8s/conversational.yaml, the four stages as
# real worker processes, a burst of load, the operator scaling the slow stage (llm) up and back
# down, and the ordering verdict (`sessionflow verify`) at the end.
#
# What runs where:
#   - sessionflow-test-kubelet (tests/src/kubelet/) registers the node sessionflow-local-0 and
#     runs the pods bound to it as local processes. Both the chart's operator Deployment (the
#     image sessionflow-operator, with a token of the chart's ServiceAccount, so the chart's
#     RBAC decides what it may do) and the pipeline's worker pods (sessionflow-worker) land
#     there: their pod templates select and tolerate the node (the chart's nodeSelector and
#     tolerations values; the pipeline's workerTemplate). kwok's fake nodes run nothing.
#   - sessionflow-demo-handlers (tests/src/handlers/) is the example's four HTTP services in
#     one process: each answers with the record it got, after a latency (llm: the slow one).
#   - The example is applied with the edits a laptop needs, printed as a diff before it is
#     applied: the bootstrap and the services' URLs pointed here, one broker (replication 1,
#     fewer partitions), the session read from the key (what `sessionflow loadgen` writes), one
#     to DEMO_K8S_LLM_MAX llm workers and at most two of each other stage (2 cores), short
#     scale-down windows, the node placement.
#
# Progress is printed live, one line per change of the pipeline or of a stage's Deployment
# (`kubectl get sp,deploy -w` style). Everything started here is stopped at the end (also on
# Ctrl-C or a failure); a control plane or broker that was already running is reused and left
# running. Exit 0 only when verify says OK and the llm stage was scaled up and back down.
#
#   DEMO_K8S_RECORDS      records in the burst                              (default 30000)
#   DEMO_K8S_SESSIONS     sessions (conversations)                          (default 300)
#   DEMO_K8S_LLM_MS       the llm service's latency per record, ms          (default 100)
#   DEMO_K8S_LLM_MAX      most llm workers                                  (default 4)
#   DEMO_K8S_WINDOW_SECS  scaleDownStabilizationSecs of every stage         (default 30)
#   DEMO_K8S_KAFKA_PORT   the broker's port (it takes this and the next 3)  (default 29092)
#   DEMO_K8S_HANDLER_PORT the handler services' port                        (default 29180)
#   CLUSTER_*_PORT        the control plane's ports (scripts/cluster.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD
CARGO=${CARGO:-cargo}
RECORDS=${DEMO_K8S_RECORDS:-30000}
SESSIONS=${DEMO_K8S_SESSIONS:-300}
LLM_MS=${DEMO_K8S_LLM_MS:-100}
LLM_MAX=${DEMO_K8S_LLM_MAX:-4}
WINDOW=${DEMO_K8S_WINDOW_SECS:-30}
KAFKA_PORT=${DEMO_K8S_KAFKA_PORT:-29092}
HANDLER_PORT=${DEMO_K8S_HANDLER_PORT:-29180}
BROKERS=127.0.0.1:$KAFKA_PORT
NS=assistant
OPERATOR_NS=sessionflow-system
STATE=$here/.local/demo-k8s
CACHE=${SESSIONFLOW_CACHE:-$HOME/.cache/sessionflow}
HELM=${SESSIONFLOW_HELM:-$CACHE/helm-npm-2.2.2/helm}
T0=$SECONDS

say() { printf 'demo-k8s [%4ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() {
  say "FAILED: $*"
  exit 1
}

# --- cleanup: whatever this run started, in reverse order ----------------------------------
pids=()
started_cluster=
started_kafka=
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  [[ -n "${progress_pid:-}" ]] && kill "$progress_pid" 2>/dev/null
  if [[ -n "${KC:-}" ]]; then
    kctl delete namespace "$NS" --wait=false >/dev/null 2>&1
    [[ -x "$HELM" ]] && "$HELM" uninstall sessionflow --namespace "$OPERATOR_NS" --kubeconfig "$KC" >/dev/null 2>&1
  fi
  # The kubelet stops every pod's processes (SIGTERM, then SIGKILL) and deletes its node.
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null; done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    for _ in $(seq 1 200); do kill -0 "${pids[i]}" 2>/dev/null || break; sleep 0.1; done
    kill -9 "${pids[i]}" 2>/dev/null
  done
  [[ -n "$started_kafka" ]] && scripts/kafka.sh stop --port "$KAFKA_PORT" >/dev/null 2>&1
  [[ -n "$started_cluster" ]] && scripts/cluster.sh stop >/dev/null 2>&1
  say "cleaned up (logs were in $STATE; removed)"
  rm -rf "$STATE"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rm -rf "$STATE"
mkdir -p "$STATE/bin"

# --- build ---------------------------------------------------------------------------------
say "building the worker, the operator, the tools, the test kubelet and the handler services"
"$CARGO" build --quiet -p sessionflow-worker --bin sessionflow-worker \
  -p sessionflow-operator --bin sessionflow-operator -p sessionflow-tools --bin sessionflow \
  -p sessionflow-tests --bin sessionflow-test-kubelet --bin sessionflow-demo-handlers
TARGET=${CARGO_TARGET_DIR:-target}
# Private copies: another build in the same target cannot swap them under the running demo.
for b in sessionflow-worker sessionflow-operator sessionflow sessionflow-test-kubelet sessionflow-demo-handlers; do
  cp "$TARGET/debug/$b" "$STATE/bin/"
done
BIN=$STATE/bin
[[ -x "$HELM" ]] || { say "installing helm (scripts/chart-check.sh caches it)"; scripts/chart-check.sh >/dev/null; }
scripts/cluster.sh installed || say "the control plane is not built yet: scripts/cluster.sh start builds it (~10 min, once)"
T0=$SECONDS

# --- control plane and Kafka ---------------------------------------------------------------
if scripts/cluster.sh status 2>/dev/null; then
  say "control plane: already running, reused"
  KC=$(scripts/cluster.sh kubeconfig)
else
  say "control plane: starting (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok)"
  started_cluster=1
  KC=$(scripts/cluster.sh start | tail -n1)
fi
KUBECTL=$(scripts/cluster.sh bin)/kubectl
kctl() { "$KUBECTL" --kubeconfig "$KC" "$@"; }
export KUBECONFIG=$KC

if scripts/kafka.sh status --port "$KAFKA_PORT" >/dev/null 2>&1; then
  say "Kafka on $BROKERS: already running, reused"
else
  say "Kafka: starting one node on $BROKERS"
  started_kafka=1
  KAFKA_HEAP=${KAFKA_HEAP:-384m} scripts/kafka.sh start --port "$KAFKA_PORT" >"$STATE/kafka-start.log" 2>&1 ||
    { tail -n 20 "$STATE/kafka-start.log"; die "Kafka did not start"; }
fi

# --- the test kubelet and the handler services ---------------------------------------------
"$BIN/sessionflow-demo-handlers" --listen "127.0.0.1:$HANDLER_PORT" \
  --latency /handle=2 --latency /complete="$LLM_MS" --latency /send=1 >"$STATE/handlers.log" 2>&1 &
pids+=($!)
"$BIN/sessionflow-test-kubelet" --dir "$STATE/kubelet" \
  --entrypoint sessionflow-worker="$BIN/sessionflow-worker" \
  --entrypoint sessionflow-operator="$BIN/sessionflow-operator" >"$STATE/kubelet.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do grep -q "node .* ready" "$STATE/kubelet.log" && break; sleep 0.2; done
grep -q "node .* ready" "$STATE/kubelet.log" || { cat "$STATE/kubelet.log"; die "the test kubelet did not register its node"; }
say "test kubelet: node sessionflow-local-0 registered; handler services on 127.0.0.1:$HANDLER_PORT"

# --- helm install: the CRD, RBAC, and the operator (run by the test kubelet) ----------------
say "helm install sessionflow charts/sessionflow (operator pod on the test kubelet, its ServiceAccount's token)"
"$HELM" install sessionflow charts/sessionflow --kubeconfig "$KC" --namespace "$OPERATOR_NS" --create-namespace \
  --set replicas=1 --set scaleIntervalSecs=2 \
  --set-json 'nodeSelector={"sessionflow.io/test-kubelet":"true"}' \
  --set-json 'tolerations=[{"key":"sessionflow.io/test-kubelet","operator":"Equal","value":"true","effect":"NoSchedule"}]' \
  --wait --timeout 2m >"$STATE/helm.log" 2>&1 || { cat "$STATE/helm.log"; tail -n 20 "$STATE/kubelet.log"; die "helm install"; }
kctl -n "$OPERATOR_NS" get deploy,pods -o wide | sed 's/^/    /'

# --- the pipeline --------------------------------------------------------------------------
placement='  workerTemplate:\
    nodeSelector: { sessionflow.io/test-kubelet: "true" }\
    tolerations: [{ key: sessionflow.io/test-kubelet, operator: Equal, value: "true", effect: NoSchedule }]'
sed -E \
  -e "s|bootstrapServers: .*|bootstrapServers: $BROKERS|" \
  -e "s|http://[a-z-]+\.assistant\.svc:8080|http://127.0.0.1:$HANDLER_PORT|" \
  -e "s|partitions: 6, replicationFactor: 3|partitions: 1, replicationFactor: 3|" \
  -e "s|partitions: 24|partitions: 6|" \
  -e "s|replicationFactor: 3|replicationFactor: 1|" \
  -e "s|    from: header|    from: key|" -e "/    name: conversation/d" \
  -e "s|replicas: \{ min: 1, max: 4 \}|replicas: { min: 1, max: 2 }|" \
  -e "s|replicas: \{ min: 2, max: 12 \}|replicas: { min: 1, max: 2 }|" \
  -e "s|replicas: \{ min: 2, max: 24 \}|replicas: { min: 1, max: $LLM_MAX }|" \
  -e "s|scaleDownStabilizationSecs: [0-9]+|scaleDownStabilizationSecs: $WINDOW|" \
  -e "s|autoscaling: \{ lagPerReplica: 5000 \}|autoscaling: { lagPerReplica: 5000, scaleDownStabilizationSecs: $WINDOW }|" \
  -e "s|^      replicas: \{ min: 1, max: 6 \}|      replicas: { min: 1, max: 2 }\n      autoscaling: { scaleDownStabilizationSecs: $WINDOW }|" \
  -e "s|^spec:$|spec:\n$placement|" \
  examples/k8s/conversational.yaml >"$STATE/conversational.yaml"
say "kubectl apply -f examples/k8s/conversational.yaml, edited for this machine:"
diff -u examples/k8s/conversational.yaml "$STATE/conversational.yaml" | tail -n +3 | grep '^[-+]' | sed 's/^/    /' || true
kctl create namespace "$NS" >/dev/null
kctl -n "$NS" apply -f "$STATE/conversational.yaml" | sed 's/^/    /'

# Live progress: one line per change of the pipeline or a Deployment.
progress() {
  declare -A last=()
  local line name
  while true; do
    while IFS= read -r line; do
      name=${line%% *}
      if [[ "${last[$name]:-}" != "$line" ]]; then
        last[$name]=$line
        printf 'demo-k8s [%4ds]   %s\n' "$((SECONDS - T0))" "$line"
      fi
    done < <(
      kctl -n "$NS" get sp -o custom-columns='N:.metadata.name,R:.status.conditions[?(@.type=="Ready")].status,S:.status.stagesReady,L:.status.lag' --no-headers 2>/dev/null |
        awk '{l=$4; if (l=="<none>") l="-"; printf "sessionpipeline/%s ready=%s stages=%s lag=%s\n", $1, $2, $3, l}'
      kctl -n "$NS" get deploy -o custom-columns='N:.metadata.name,W:.spec.replicas,R:.status.readyReplicas' --no-headers 2>/dev/null |
        awk '{r=$3; if (r=="<none>") r=0; printf "deployment/%s replicas=%s ready=%s\n", $1, $2, r}'
    )
    sleep 1
  done
}
progress &
progress_pid=$!

# jsonpath of the llm stage's Deployment, or nothing while it does not exist.
llm() { kctl -n "$NS" get deploy -l sessionflow.io/stage=llm -o jsonpath="{.items[0]$1}" 2>/dev/null || true; }
wait_until() { # wait_until SECONDS WHAT TEST...
  local secs=$1 what=$2 deadline
  shift 2
  deadline=$((SECONDS + secs))
  until "$@"; do
    ((SECONDS < deadline)) || die "$what: not within $secs s"
    sleep 1
  done
}
pipeline_ready() {
  [[ $(kctl -n "$NS" get sp assistant -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}
wait_until 300 "the pipeline Ready (four stages, workers ready)" pipeline_ready
say "pipeline Ready: every stage's workers run (as processes of the test kubelet) and are ready"

# --- the burst -----------------------------------------------------------------------------
say "burst: $RECORDS records over $SESSIONS conversations into chat.in (the llm service takes $LLM_MS ms a record)"
"$BIN/sessionflow" loadgen --brokers "$BROKERS" --topic chat.in --records "$RECORDS" \
  --sessions "$SESSIONS" >"$STATE/loadgen.log" 2>&1 || { cat "$STATE/loadgen.log"; die "loadgen"; }
scaled_up() { [[ $(llm .spec.replicas) -gt 1 ]]; }
wait_until 300 "llm scaled up" scaled_up
say "SCALE-UP: the operator set the llm stage to $(llm .spec.replicas) replicas"
lag_zero() { [[ $(kctl -n "$NS" get sp assistant -o jsonpath='{.status.lag}' 2>/dev/null) == 0 ]]; }
wait_until 420 "the backlog drained (lag 0)" lag_zero
say "backlog drained: lag 0; the scale-down waits for the ${WINDOW} s stabilization window"
scaled_down() { [[ $(llm .spec.replicas) -eq 1 ]]; }
wait_until $((WINDOW + 180)) "llm scaled back down" scaled_down
say "SCALE-DOWN: the operator set the llm stage back to $(llm .spec.replicas) replica"
pods_gone() { [[ $(kctl -n "$NS" get pods -l sessionflow.io/stage=llm --no-headers 2>/dev/null | wc -l) -eq 1 ]]; }
wait_until 180 "the extra llm pods stopped" pods_gone
kill "$progress_pid" 2>/dev/null || true
progress_pid=
kctl -n "$NS" get sp,deploy | sed 's/^/    /'
kctl -n "$NS" get pods -o wide | sed 's/^/    /'

# --- the verdict ---------------------------------------------------------------------------
say "verify: chat.answered (the llm stage's output) against chat.in, per-session order, loss, duplicates"
if "$BIN/sessionflow" verify --brokers "$BROKERS" --topic chat.answered --input chat.in --dlq chat.dlq \
  --timeout-secs 120 2>&1 | tee "$STATE/verify.log" | grep -v PartitionEOF | sed 's/^/    /'; then
  say "demo-k8s OK in $((SECONDS - T0)) s after the build"
else
  die "verify"
fi
