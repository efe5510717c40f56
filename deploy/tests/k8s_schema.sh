#!/usr/bin/env bash
# Offline schema validation (kubernetes-models + strict field names) of the Kubernetes objects:
#  * raw: always. deploy/tools/raw-k8s.js builds base and every overlay from the raw YAML files
#    (resources, components, generated ConfigMaps, the overlays' strategic-merge and JSON 6902
#    patches applied) without kubectl, so the check runs on hosts without it (Debian 12 does not
#    package kubectl);
#  * rendered: also `kubectl kustomize` output, when kubectl is installed (ATTN_NO_KUBECTL=1
#    hides it, to test the fallback).
#   k8s_schema.sh DEPLOY_DIR BUILD_DIR
. "$(dirname "$0")/lib.sh"
deploy="$1"; build="$2"
install_tools "$deploy" "$build"
raw="$build/raw-schema"
rm -rf "$raw"
timeout 60 node "$deploy/tools/raw-k8s.js" "$deploy/k8s" "$raw" || fail "building objects from the raw YAML"
timeout 120 node "$deploy/tools/validate-k8s.js" "$raw"/*.yaml || fail "schema validation (raw YAML)"
if [ "${ATTN_NO_KUBECTL:-0}" != 1 ] && command -v kubectl >/dev/null 2>&1; then
  out="$build/rendered-schema"
  render_overlays "$deploy" "$out"
  timeout 120 node "$deploy/tools/validate-k8s.js" "$out"/*.yaml || fail "schema validation (kubectl kustomize)"
  echo "k8s_schema: raw and kubectl-kustomize renderings valid"
else
  echo "k8s_schema: raw YAML valid; kubectl not found (or ATTN_NO_KUBECTL=1): kustomize rendering not validated"
fi
