#!/usr/bin/env bash
# Grafana dashboard: valid JSON, every PromQL expression parses (promtool), every metric exists.
#   grafana.sh DEPLOY_DIR BUILD_DIR
. "$(dirname "$0")/lib.sh"
deploy="$1"; build="$2"
need promtool "Debian package prometheus"
need python3
timeout 90 python3 "$deploy/tests/grafana_check.py" "$deploy/grafana/attnd-dashboard.json" \
  "$deploy/prometheus/rules" "$build/grafana-check" || fail "Grafana dashboard check"
