#!/usr/bin/env bash
# yamllint every YAML file under deploy/ with deploy/.yamllint.
#   yamllint.sh DEPLOY_DIR
. "$(dirname "$0")/lib.sh"
deploy="$1"
need yamllint
cd "$deploy"
n=$(find . -path ./tools/node_modules -prune -o \( -name '*.yml' -o -name '*.yaml' -o -name .yamllint \) -print | wc -l)
[ "$n" -gt 0 ] || fail "no YAML files found under $deploy"
timeout 60 yamllint --strict -c .yamllint -f parsable . || fail "yamllint found problems"
echo "yamllint: $n files clean"
