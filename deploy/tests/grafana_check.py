#!/usr/bin/env python3
"""Checks that the deploy files name only real metrics, and that their PromQL parses.

  grafana_check.py METRICS DASHBOARD RULES_DIR ADAPTER_VALUES METRICS_CC WORK_DIR

METRICS is the /metrics exposition of the built attnd (deploy/tests/grafana.sh starts
`attnd --backend=cpu` on free ports, sends it traffic so that the families that only appear after
a request show up, and scrapes it). The real metric names are read from its `# TYPE` lines:
counters and gauges as they are, histograms with _bucket/_sum/_count, summaries with
_sum/_count. Names registered in server/observability/metrics.cc (METRICS_CC) but absent from the scrape are
reported (the traffic did not reach them).

Checked against those names (plus `up` and the recording rules of RULES_DIR):
  * deploy/grafana/attnd-dashboard.json: every panel target and label_values()/query_result()
    variable query, with Grafana variables substituted ($__rate_interval -> 5m, $job -> .*);
  * every `expr` of the recording and alert rules in RULES_DIR;
  * deploy/k8s/prometheus-adapter/values.yaml: each rule's seriesQuery and metricsQuery (adapter
    templates <<.Series>>, <<.LabelMatchers>>, <<.GroupBy>> filled in) and its name.matches;
    and the custom metrics the HPA (deploy/k8s/components/hpa/hpa.yaml, beside it) scales on must
    be ones the adapter serves (name.as).
All the expressions are written as recording rules into WORK_DIR and parsed by `promtool check
rules`. Then a negative self-check: a copy of each of the three sources with one metric name
misspelled must be rejected, or the check itself is broken.
"""
import copy
import glob
import json
import os
import re
import subprocess
import sys

try:
    import yaml
except ImportError:  # python3-yaml comes with yamllint (scripts/install-deps.sh)
    print("SKIP: python3 yaml module not found (Debian package python3-yaml)")
    sys.exit(77)

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
            "group_left", "group_right", "inf", "nan", "atan2"}
GRAFANA_VARS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h",
                "__interval_ms": "60000", "__range_s": "3600", "__range_ms": "3600000"}


def substitute(expr):
    def var(m):
        name = m.group(1) or m.group(2) or m.group(3)
        name = name.split(":")[0]  # ${var:regex} formats
        return GRAFANA_VARS.get(name, ".*")
    return re.sub(r"\$\{([A-Za-z0-9_:]+)\}|\[\[([A-Za-z0-9_:]+)\]\]|\$([A-Za-z0-9_]+)", var, expr)


def metric_names(expr):
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)                                          # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                                         # ranges, subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"(?<![A-Za-z0-9_:.])(\d+(ms|s|m|h|d|w|y))+(?![A-Za-z0-9_:])", " ", s)  # durations
    s = re.sub(r"(?<![A-Za-z0-9_:.])(0x[0-9a-fA-F]+|\d*\.?\d+([eE][+-]?\d+)?)", " ", s)  # numbers
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        tail = s[m.end():].lstrip()
        if tail.startswith("(") or m.group(0).lower() in KEYWORDS:
            continue  # function, aggregation or keyword
        names.add(m.group(0))
    return names


# --- the real names ---------------------------------------------------------------------------

def exposed_names(exposition):
    """{sample name} from the # TYPE lines of a text exposition."""
    names, families = set(), {}
    for m in re.finditer(r"^# TYPE ([A-Za-z_:][A-Za-z0-9_:]*) (\w+)\s*$", exposition, re.M):
        families[m.group(1)] = m.group(2)
    for n, t in families.items():
        if t == "histogram":
            names |= {n + "_bucket", n + "_sum", n + "_count"}
        elif t == "summary":
            names |= {n, n + "_sum", n + "_count"}
        else:
            names.add(n)
    return names, families


def registered_in_source(metrics_cc):
    """Family names server/observability/metrics.cc registers (.Name("x"), hist("x", gauge("x", BuildPool("x")."""
    with open(metrics_cc) as f:
        src = f.read()
    return set(re.findall(r'(?:\.Name|\bhist|\bgauge|\bBuildPool)\(\s*"(attn_[A-Za-z0-9_]+)"', src))


# --- the expressions of each source --------------------------------------------------------------

def walk_panels(panels):
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def dashboard_exprs(dash):
    """[(where, expr)] of a dashboard (Grafana variables substituted); exits on malformed panels."""
    exprs, ids = [], set()
    for p in walk_panels(dash.get("panels", [])):
        if p.get("type") == "row":
            continue
        if p.get("id") in ids:
            sys.exit(f"duplicate panel id {p.get('id')}")
        ids.add(p.get("id"))
        targets = p.get("targets", [])
        if not targets:
            sys.exit(f"panel '{p.get('title')}' has no targets")
        for t in targets:
            if not t.get("expr", "").strip():
                sys.exit(f"panel '{p.get('title')}' target {t.get('refId')} has no expr")
            exprs.append((f"dashboard panel '{p.get('title')}' {t.get('refId')}", substitute(t["expr"])))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.match(r"^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", q)
        if m:
            exprs.append((f"dashboard variable ${v['name']}", substitute(m.group(1))))
        elif q.strip().startswith("query_result("):
            exprs.append((f"dashboard variable ${v['name']}", substitute(q.strip()[len("query_result("):-1])))
        elif q.strip():
            sys.exit(f"variable ${v['name']}: unsupported query {q!r}")
    return exprs


def rules_exprs(rule_docs):
    """[(where, expr)] and the recording rule names of {path: parsed rules file}."""
    exprs, records = [], set()
    for path, doc in sorted(rule_docs.items()):
        for g in doc.get("groups", []):
            for r in g.get("rules", []):
                name = r.get("record") or r.get("alert")
                if r.get("record"):
                    records.add(r["record"])
                exprs.append((f"{os.path.basename(path)} {name}", str(r.get("expr", ""))))
    return exprs, records


def adapter_exprs(values):
    """[(where, expr)] of prometheus-adapter values (templates filled in) and the served names."""
    exprs, served = [], set()
    rules = values.get("rules", {})
    for section in ("custom", "external"):
        for i, r in enumerate(rules.get(section, []) or []):
            where = f"prometheus-adapter {section}[{i}]"
            sq = r.get("seriesQuery", "")
            exprs.append((f"{where} seriesQuery", sq))
            series = sorted(metric_names(sq))
            series_name = series[0] if series else "up"
            matches = (r.get("name") or {}).get("matches", "")
            literal = re.fullmatch(r"\^?([A-Za-z_:][A-Za-z0-9_:]*)\$?", matches or "")
            if literal:  # a plain name: it must be a real series too
                exprs.append((f"{where} name.matches", literal.group(1)))
                series_name = literal.group(1)
            served.add((r.get("name") or {}).get("as") or series_name)
            mq = r.get("metricsQuery", "")
            mq = (mq.replace("<<.Series>>", series_name)
                    .replace("<<.LabelMatchers>>", 'namespace="attnd",pod=~"attnd-.*"')
                    .replace("<<.GroupBy>>", "namespace, pod"))
            exprs.append((f"{where} metricsQuery", mq))
    return exprs, served


# --- checking ------------------------------------------------------------------------------------

def check_names(exprs, known):
    """Problems: expressions naming no metric, or an unknown one."""
    problems = []
    for where, e in exprs:
        names = metric_names(e)
        if not names:
            problems.append(f"{where}: references no metric: {e}")
        for n in sorted(names - known):
            problems.append(f"{where}: unknown metric '{n}' in: {e.strip()}")
    return problems


def promtool_parse(exprs, path):
    with open(path, "w") as f:
        f.write("groups:\n  - name: deploy_exprs\n    rules:\n")
        for i, (where, e) in enumerate(exprs):
            f.write(f"      # {where}\n      - record: deploy_expr_{i}\n        expr: {json.dumps(e)}\n")
    r = subprocess.run(["promtool", "check", "rules", path], capture_output=True, text=True, timeout=60)
    return r.returncode == 0, r.stdout + r.stderr


def misspell(text, name):
    """text with the first whole-word occurrence of metric name misspelled."""
    bad = name.replace("attn_", "attn_misspelt_", 1) if name.startswith("attn_") else name + "_typo"
    out, n = re.subn(r"(?<![A-Za-z0-9_:])" + re.escape(name) + r"(?![A-Za-z0-9_:])", bad, text, count=1)
    assert n == 1, (name, text)
    return out


def main():
    metrics, dashboard, rules_dir, adapter_values, metrics_cc, work = sys.argv[1:7]
    with open(metrics) as f:
        real, families = exposed_names(f.read())
    if not any(n.startswith("attn_") for n in real):
        sys.exit(f"no attn_ metric families in {metrics}")
    if "attn_requests_total" not in real:
        sys.exit("attn_requests_total missing from the scrape: send traffic before scraping")
    missing = sorted(registered_in_source(metrics_cc) - set(families))
    if missing:
        print(f"note: registered in {metrics_cc} but not in the scrape (no traffic reached them): "
              + ", ".join(missing))

    with open(dashboard) as f:
        dash = json.load(f)
    rule_docs = {}
    for path in sorted(glob.glob(os.path.join(rules_dir, "*.yml"))):
        with open(path) as f:
            rule_docs[path] = yaml.safe_load(f)
    with open(adapter_values) as f:
        values = yaml.safe_load(f)
    hpa_path = os.path.join(os.path.dirname(os.path.dirname(adapter_values)), "components", "hpa", "hpa.yaml")
    with open(hpa_path) as f:
        hpa = yaml.safe_load(f)

    d_exprs = dashboard_exprs(dash)
    r_exprs, records = rules_exprs(rule_docs)
    a_exprs, served = adapter_exprs(values)
    if not d_exprs or not r_exprs or not a_exprs or not records:
        sys.exit("no expressions found in the dashboard, the rules or the adapter values")
    known = real | records | {"up"}
    known_raw = real | {"up"}  # the adapter reads raw series: no recording rules assumed

    problems = check_names(d_exprs, known) + check_names(r_exprs, known) + check_names(a_exprs, known_raw)
    for m in hpa.get("spec", {}).get("metrics", []):
        if m.get("type") in ("Pods", "Object", "External"):
            name = m[m["type"].lower()]["metric"]["name"]
            if name not in served:
                problems.append(f"hpa.yaml: metric '{name}' is not served by the adapter rules "
                                f"(they serve {sorted(served)})")
    os.makedirs(work, exist_ok=True)
    parsed, out = promtool_parse(d_exprs + r_exprs + a_exprs, os.path.join(work, "deploy-exprs.rules.yml"))
    if not parsed:
        problems.append("promtool rejected expressions:\n" + out)
    for p in problems:
        print(p)
    used = set().union(*(metric_names(e) for _, e in d_exprs + r_exprs + a_exprs))
    print(f"{len(d_exprs)} dashboard, {len(r_exprs)} rule and {len(a_exprs)} adapter expressions; "
          f"{len(used)} names, checked against {len(real)} names scraped from attnd "
          f"({len(families)} families) and {len(records)} recording rules; promtool: "
          f"{'ok' if parsed else 'FAILED'}")

    # Negative self-check: one misspelt metric in each source must be caught.
    def first_real(exprs):
        for _, e in exprs:
            for n in sorted(metric_names(e)):
                if n in real and n.startswith("attn_"):
                    return n
        return None

    self_failures = []
    n = first_real(d_exprs)
    bad_dash = json.loads(misspell(json.dumps(dash), n))
    if not check_names(dashboard_exprs(bad_dash), known):
        self_failures.append(f"dashboard with '{n}' misspelt passed")
    bad_rules = copy.deepcopy(rule_docs)
    path = next(p for p in bad_rules if "alert" not in p)
    n = first_real(rules_exprs({path: bad_rules[path]})[0])
    bad_rules[path] = yaml.safe_load(misspell(yaml.safe_dump(bad_rules[path]), n))
    if not check_names(rules_exprs(bad_rules)[0], known):
        self_failures.append(f"rules with '{n}' misspelt passed")
    n = first_real(a_exprs)
    bad_values = yaml.safe_load(misspell(yaml.safe_dump(values), n))
    if not check_names(adapter_exprs(bad_values)[0], known_raw):
        self_failures.append(f"adapter values with '{n}' misspelt passed")
    for f in self_failures:
        print("self-check FAILED: " + f)
    if not self_failures:
        print("self-check: a misspelt metric name in the dashboard, the rules and the adapter "
              "values is each rejected")
    sys.exit(1 if problems or self_failures else 0)


if __name__ == "__main__":
    main()
