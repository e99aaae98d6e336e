#!/usr/bin/env bash
# Runs a command with the local Kubernetes control plane of the cluster tests
# (scripts/cluster.sh, tests/tests/cluster): when its binaries are installed, starts it unless
# it already runs, exports SESSIONFLOW_CLUSTER_KUBECONFIG (its admin kubeconfig), and stops it
# afterwards only if this script started it. When it is not installed, the command runs
# without it and the cluster tests say SKIPPED (`scripts/cluster.sh install` builds it,
# ~11 min cold; CI does).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
started=0
cleanup() { if ((started)); then "$here/cluster.sh" stop 2>/dev/null || true; fi; }
trap cleanup EXIT
if "$here/cluster.sh" installed; then
  if ! "$here/cluster.sh" status 2>/dev/null; then
    started=1
    "$here/cluster.sh" start >/dev/null
  fi
  SESSIONFLOW_CLUSTER_KUBECONFIG=$("$here/cluster.sh" kubeconfig)
  export SESSIONFLOW_CLUSTER_KUBECONFIG
else
  echo "with-cluster.sh: the control plane of scripts/cluster.sh is not installed; cluster" \
       "tests will be SKIPPED (scripts/cluster.sh install builds it)" >&2
fi
"$@"
