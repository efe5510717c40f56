#!/usr/bin/env bash
# Every COPY/ADD source of the Dockerfile (build context = repo root) exists in the repository
# and is not excluded by .dockerignore (COPY --from=<stage> is skipped).
#   dockerfile_copy.sh REPO_DIR DOCKERFILE
. "$(dirname "$0")/lib.sh"
repo="$1"; dockerfile="$2"
[ -f "$dockerfile" ] || fail "$dockerfile not found"
[ -f "$repo/.dockerignore" ] || fail "$repo/.dockerignore not found"
# Join continuation lines, keep COPY/ADD instructions.
srcs=$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$dockerfile" | grep -i -E '^[[:space:]]*(COPY|ADD)[[:space:]]' |
  grep -v -i -E -- '--from=' |
  sed -E 's/^[[:space:]]*[A-Za-z]+[[:space:]]+//; s/--[a-z-]+=[^[:space:]]+[[:space:]]*//g' |
  awk '{ for (i = 1; i < NF; i++) print $i }')
[ -n "$srcs" ] || fail "no COPY sources found in $dockerfile"
bad=0
ignored=$(grep -v -E '^[[:space:]]*(#|$)' "$repo/.dockerignore" | grep -v '^!' | sed 's#/$##')
for s in $srcs; do
  s="${s%/}"; s="${s#./}"
  if [ ! -e "$repo/$s" ]; then echo "COPY source '$s' does not exist in $repo"; bad=1; continue; fi
  for pat in $ignored; do
    case "$s" in $pat | $pat/*) echo "COPY source '$s' is excluded by .dockerignore ($pat)"; bad=1 ;; esac
  done
  echo "COPY source '$s': ok"
done
[ "$bad" = 0 ] || fail "Dockerfile COPY sources"
