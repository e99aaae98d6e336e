#!/usr/bin/env bash
# Runs a command with the Kubernetes API server of the CRD tests (scripts/apiserver.sh): when
# its binary is installed, starts it unless it already answers, exports SESSIONFLOW_KUBECONFIG,
# and stops it afterwards only if this script started it. When it is not installed, the
# command runs without it and the CRD tests say SKIPPED (`scripts/apiserver.sh install`
# builds it, ~5 min; CI does).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
started=0
if "$here/apiserver.sh" installed; then
  if ! "$here/apiserver.sh" status 2>/dev/null; then
    "$here/apiserver.sh" start >/dev/null
    started=1
  fi
  SESSIONFLOW_KUBECONFIG=$("$here/apiserver.sh" kubeconfig)
  export SESSIONFLOW_KUBECONFIG
else
  echo "with-apiserver.sh: apiextensions-apiserver not installed; CRD tests will be SKIPPED" \
       "(scripts/apiserver.sh install builds it)" >&2
fi
cleanup() { if ((started)); then "$here/apiserver.sh" stop 2>/dev/null || true; fi; }
trap cleanup EXIT
"$@"
