#!/usr/bin/env bash
# promtool check config / check rules / test rules, and every rule has a unit test.
#   promtool.sh DEPLOY_DIR
. "$(dirname "$0")/lib.sh"
prom="$1/prometheus"
need promtool "Debian package prometheus"
cd "$prom"
timeout 60 promtool check config prometheus.yml || fail "promtool check config"
# The kubernetes_sd_configs example. Debian's prometheus is built without Kubernetes discovery,
# so its promtool rejects the field itself: there, the same config with the discovery block
# swapped for file_sd_configs is checked (relabelling, regexes, rule files), and the block's own
# shape (role pod, namespaces.names) by python.
echo 'scrape_configs: [{job_name: k, kubernetes_sd_configs: [{role: pod}]}]' > "${TMPDIR:-/tmp}/attn-k8s-sd-probe.yml"
if timeout 30 promtool check config "${TMPDIR:-/tmp}/attn-k8s-sd-probe.yml" >/dev/null 2>&1; then
  timeout 60 promtool check config prometheus-kubernetes.yml || fail "promtool check config (kubernetes_sd_configs example)"
else
  echo "promtool was built without kubernetes_sd_configs: checking prometheus-kubernetes.yml with file_sd_configs in its place"
  need python3
  derived="$(mktemp "${TMPDIR:-/tmp}/attn-prometheus-kubernetes.XXXXXX.yml")"
  trap 'rm -f "$derived"' EXIT
  python3 - prometheus-kubernetes.yml "$derived" <<'PY' || fail "prometheus-kubernetes.yml: kubernetes_sd_configs block"
import os, sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
here = os.path.dirname(os.path.abspath(sys.argv[1]))
cfg["rule_files"] = [os.path.join(here, r) for r in cfg.get("rule_files", [])]
for job in cfg["scrape_configs"]:
    sd = job.pop("kubernetes_sd_configs", None)
    if sd is None:
        continue
    for s in sd:
        assert set(s) <= {"role", "namespaces", "selectors", "api_server", "kubeconfig_file", "attach_metadata"}, s
        assert s["role"] in {"pod", "endpoints", "endpointslice", "service", "node", "ingress"}, s
        ns = s.get("namespaces", {})
        assert set(ns) <= {"names", "own_namespace"} and all(isinstance(n, str) for n in ns.get("names", [])), ns
    job["file_sd_configs"] = [{"files": ["/nonexistent/attnd-targets.json"]}]
yaml.safe_dump(cfg, open(sys.argv[2], "w"))
PY
  timeout 60 promtool check config "$derived" || fail "promtool check config (prometheus-kubernetes.yml, discovery swapped)"
fi
rm -f "${TMPDIR:-/tmp}/attn-k8s-sd-probe.yml"
grep -q 'kubernetes_sd_configs:' prometheus-kubernetes.yml && grep -q 'target_label: namespace' prometheus-kubernetes.yml &&
  grep -q 'target_label: pod' prometheus-kubernetes.yml || fail "prometheus-kubernetes.yml lost its namespace/pod labels"
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
