# Shared helpers for the deploy checks (sourced).
set -euo pipefail

# ctest SKIP_RETURN_CODE
SKIP=77

skip() { echo "SKIP: $*"; exit "$SKIP"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

need() {  # need TOOL [why]: skip the test when TOOL is absent
  command -v "$1" >/dev/null 2>&1 || skip "$1 not found${2:+ ($2)}; scripts/install-deps.sh installs it"
}

# install_tools DEPLOY_DIR BUILD_DIR: npm ci deploy/tools/package*.json into BUILD_DIR/deploy-tools
# (once per lock file; serialised with flock). Sets NODE_PATH. Skips when npm or the registry is
# unavailable.
install_tools() {
  local src="$1/tools" dest="$2/deploy-tools"
  need node "the Node.js based validators"
  need npm "the Node.js based validators"
  mkdir -p "$dest"
  (
    command -v flock >/dev/null && flock -w 600 9
    if [ -d "$dest/node_modules" ] && cmp -s "$src/package-lock.json" "$dest/package-lock.json"; then
      exit 0
    fi
    cp "$src/package.json" "$src/package-lock.json" "$dest/"
    rm -rf "$dest/node_modules"
    echo "installing $(tr -d '\n ' < "$src/package.json" | grep -o '"dependencies":{[^}]*}') into $dest"
    if ! timeout 300 npm ci --prefix "$dest" --ignore-scripts --no-audit --no-fund --loglevel=error; then
      rm -f "$dest/package-lock.json"
      exit 3
    fi
  ) 9>"$dest/.lock" || {
    [ $? = 3 ] && skip "npm ci of deploy/tools failed (no access to the npm registry?)"
    fail "installing deploy tools"
  }
  export NODE_PATH="$dest/node_modules"
}

# render_overlays DEPLOY_DIR OUT_DIR: kubectl kustomize base and every overlay into OUT_DIR/*.yaml
render_overlays() {
  local k8s="$1/k8s" out="$2" d name
  need kubectl "kubectl kustomize renders the manifests"
  mkdir -p "$out"
  rm -f "$out"/*.yaml
  for d in "$k8s/base" "$k8s"/overlays/*/; do
    d="${d%/}"
    name="$(basename "$d")"
    echo "kubectl kustomize ${d#"$1"/}"
    timeout 60 kubectl kustomize "$d" > "$out/$name.yaml" || fail "kubectl kustomize $d"
    [ -s "$out/$name.yaml" ] || fail "$d rendered nothing"
  done
}
