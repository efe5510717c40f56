#!/usr/bin/env bash
# promtool check config / check rules / test rules, and every rule has a unit test.
#   promtool.sh DEPLOY_DIR
. "$(dirname "$0")/lib.sh"
prom="$1/prometheus"
need promtool "Debian package prometheus"
cd "$prom"
timeout 60 promtool check config prometheus.yml || fail "promtool check config"
timeout 60 promtool check rules rules/*.yml || fail "promtool check rules"
timeout 120 promtool test rules tests/*.yml || fail "promtool test rules"
# Coverage: each recording rule is evaluated by a promql_expr_test and each alert is checked by
# an alert_rule_test that expects it to fire (and is not just listed with exp_alerts: []).
missing=0
for r in $(sed -n -E 's/^ *- record: *([^ ]+) *$/\1/p' rules/*.yml); do
  grep -q -E "^ *- expr: *(round\()?$r[ ,)/]" tests/*.yml || { echo "recording rule $r has no promql_expr_test"; missing=1; }
done
for a in $(sed -n -E 's/^ *- alert: *([^ ]+) *$/\1/p' rules/*.yml); do
  grep -A2 -E "^ *- alertname: *$a *$" tests/*.yml | grep -q -E '^ *exp_alerts: *$' ||
    { echo "alert $a has no alert_rule_test where it fires"; missing=1; }
done
[ "$missing" = 0 ] || fail "rules without unit tests"
echo "promtool: config, rules and tests ok; every rule tested"
