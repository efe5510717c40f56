#!/usr/bin/env bash
# Offline schema validation of every rendered manifest (kubernetes-models + strict field names).
#   k8s_schema.sh DEPLOY_DIR BUILD_DIR
. "$(dirname "$0")/lib.sh"
deploy="$1"; build="$2"
need kubectl "kubectl kustomize renders the manifests"
install_tools "$deploy" "$build"
out="$build/rendered-schema"
render_overlays "$deploy" "$out"
timeout 120 node "$deploy/tools/validate-k8s.js" "$out"/*.yaml || fail "schema validation"
