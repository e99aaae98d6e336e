#!/usr/bin/env bash
# Checks that the control plane of scripts/cluster.sh does what a real cluster does:
#   1. a Deployment of 2 replicas gets 2 pods scheduled on the kwok nodes, Running and Ready;
#   2. deleting the Deployment garbage-collects its ReplicaSet and pods;
#   3. a ServiceAccount token (TokenRequest, `kubectl create token`) authenticates as that
#      ServiceAccount, and RBAC decides: `auth can-i list pods` is "no" until a RoleBinding
#      grants it, then "yes".
# Usage: scripts/cluster-check.sh [KUBECONFIG]  (default: scripts/cluster.sh's admin kubeconfig;
# the cluster must be started). Exit 0 when every check passes, 1 on the first failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KCFG=${1:-$("$here/cluster.sh" kubeconfig)}
BIN=$("$here/cluster.sh" bin)
NS=cluster-check-$$
export PATH="$BIN:$PATH"
k() { kubectl --kubeconfig "$KCFG" "$@"; }
fail() {
  echo "FAIL: $*" >&2
  k -n "$NS" get deploy,rs,pods -o wide >&2 || true
  exit 1
}
ok() { echo "ok: $*"; }
tmp=$(mktemp -d)
cleanup() {
  k delete namespace "$NS" --wait=false >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

k get --raw /readyz >/dev/null || fail "the API server at $(k config view -o jsonpath='{.clusters[0].cluster.server}') is not ready"
k create namespace "$NS" >/dev/null

# 1. Deployment -> ReplicaSet -> 2 pods, scheduled on kwok nodes, Running and Ready.
k -n "$NS" create deployment x --image=nginx --replicas=2 >/dev/null
k -n "$NS" rollout status deployment/x --timeout=90s >/dev/null || fail "deployment x did not become available"
k -n "$NS" wait --for=condition=Ready pod -l app=x --timeout=60s >/dev/null || fail "pods of x not Ready"
pods=$(k -n "$NS" get pods -l app=x -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase} {.spec.nodeName}{"\n"}{end}')
[[ $(grep -c ' Running kwok-node-' <<<"$pods" || true) -eq 2 ]] || fail "expected 2 Running pods on kwok nodes, got: $pods"
ok "deployment x: 2 pods Running and Ready on $(awk '{print $3}' <<<"$pods" | sort -u | paste -sd' ')"

# 2. Delete the Deployment: the garbage collector removes its ReplicaSet, which removes the pods.
k -n "$NS" delete deployment x --wait=false >/dev/null
gone=0
for _ in $(seq 1 120); do
  rs=$(k -n "$NS" get rs -l app=x -o name 2>/dev/null | wc -l)
  po=$(k -n "$NS" get pods -l app=x -o name 2>/dev/null | wc -l)
  if ((rs == 0 && po == 0)); then gone=1 && break; fi
  sleep 0.5
done
((gone)) || fail "after deleting deployment x: $rs ReplicaSet(s) and $po pod(s) left (garbage collector)"
ok "deployment x deleted: its ReplicaSet and pods garbage-collected"

# 3. A ServiceAccount token, and RBAC deciding what it may do.
k -n "$NS" create serviceaccount sa >/dev/null
token=$(k -n "$NS" create token sa --duration=10m) || fail "kubectl create token sa"
server=$(k config view --raw -o jsonpath='{.clusters[0].cluster.server}')
k config view --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}' | base64 -d >"$tmp/ca.crt"
# A kubeconfig with the token only (no client certificate, which would authenticate first).
cat >"$tmp/sa.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "$server", certificate-authority: "$tmp/ca.crt"}}]
users: [{name: sa, user: {token: "$token"}}]
contexts: [{name: c, context: {cluster: c, user: sa, namespace: "$NS"}}]
current-context: c
EOF
sak() { kubectl --kubeconfig "$tmp/sa.kubeconfig" "$@"; }
who=$(sak auth whoami -o jsonpath='{.status.userInfo.username}') || fail "the token does not authenticate"
[[ $who == "system:serviceaccount:$NS:sa" ]] || fail "the token authenticates as '$who'"
ok "the token of serviceaccount sa authenticates as $who"
ans=$(sak auth can-i list pods 2>&1 || true)
[[ $ans == no ]] || fail "with the token, 'auth can-i list pods' said '$ans', expected 'no'"
sak get pods >/dev/null 2>&1 && fail "with the token, 'get pods' succeeded without any RoleBinding"
ok "with the token: auth can-i list pods -> no (RBAC), get pods -> Forbidden"
k -n "$NS" create role pod-reader --verb=list,get --resource=pods >/dev/null
k -n "$NS" create rolebinding sa-reads-pods --role=pod-reader --serviceaccount="$NS:sa" >/dev/null
ans=no
for _ in $(seq 1 20); do
  ans=$(sak auth can-i list pods 2>&1 || true)
  [[ $ans == yes ]] && break
  sleep 0.5
done
[[ $ans == yes ]] || fail "after the RoleBinding, 'auth can-i list pods' said '$ans'"
ok "after a RoleBinding: auth can-i list pods -> yes"
echo "cluster-check: all checks passed"
