#!/usr/bin/env python3
"""Checks deploy/grafana/attnd-dashboard.json:
  * every PromQL expression (panel targets and label_values() variable queries), with Grafana
    variables substituted ($__rate_interval -> 5m, $job/$instance/... -> .*), parses: they are
    written as recording rules into a temporary rules file and checked with `promtool check rules`;
  * every metric name referenced is a real attnd metric (histograms with _bucket/_sum/_count),
    a recording rule from deploy/prometheus/rules, or `up`.
usage: grafana_check.py DASHBOARD RULES_DIR WORK_DIR
"""
import glob
import json
import os
import re
import subprocess
import sys

COUNTERS = ["attn_requests_total", "attn_received_bytes_total", "attn_sent_bytes_total"]
HISTOGRAMS = ["attn_request_duration_seconds", "attn_queue_duration_seconds",
              "attn_compute_duration_seconds", "attn_transfer_duration_seconds",
              "attn_batch_requests", "attn_batch_tokens",
              "attn_kernel_memory_bandwidth_bytes_per_second", "attn_kernel_flops_per_second"]
GAUGES = ["attn_pending_requests", "attn_max_queue_size", "attn_device_pool_bytes",
          "attn_pinned_pool_bytes", "attn_kv_cache_pages", "attn_sessions", "attn_gpu_memory_bytes",
          "attn_build_info"]
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


def walk_panels(panels):
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def main():
    dashboard, rules_dir, work = sys.argv[1:4]
    with open(dashboard) as f:
        dash = json.load(f)
    exprs = []  # (where, expr)
    ids = set()
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
            exprs.append((f"panel '{p.get('title')}' {t.get('refId')}", t["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.match(r"^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", q)
        if m:
            exprs.append((f"variable ${v['name']}", m.group(1)))
        elif q.strip().startswith("query_result("):
            exprs.append((f"variable ${v['name']}", q.strip()[len("query_result("):-1]))
        elif q.strip():
            sys.exit(f"variable ${v['name']}: unsupported query {q!r}")
    if not exprs:
        sys.exit("no expressions found in the dashboard")

    known = set(COUNTERS) | set(GAUGES) | {"up"}
    for h in HISTOGRAMS:
        known |= {h + "_bucket", h + "_sum", h + "_count"}
    rules = set()
    for path in glob.glob(os.path.join(rules_dir, "*.yml")):
        with open(path) as f:
            rules |= set(re.findall(r"^\s*- record:\s*(\S+)\s*$", f.read(), re.M))
    if not rules:
        sys.exit(f"no recording rules found in {rules_dir}")
    known |= rules

    bad = 0
    os.makedirs(work, exist_ok=True)
    tmp = os.path.join(work, "grafana-exprs.rules.yml")
    with open(tmp, "w") as f:
        f.write("groups:\n  - name: grafana_dashboard_exprs\n    rules:\n")
        for i, (where, e) in enumerate(exprs):
            s = substitute(e)
            f.write(f"      # {where}\n      - record: grafana_expr_{i}\n        expr: {json.dumps(s)}\n")
            names = metric_names(s)
            if not names:
                print(f"{where}: references no metric: {e}")
                bad += 1
            for n in sorted(names - known):
                print(f"{where}: unknown metric '{n}' in: {e}")
                bad += 1
    r = subprocess.run(["promtool", "check", "rules", tmp], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        print(r.stdout + r.stderr)
        print(f"promtool rejected dashboard expressions (see {tmp})")
        bad += 1
    used = set().union(*(metric_names(substitute(e)) for _, e in exprs))
    print(f"{len(exprs)} expressions, {len(used)} metric/rule names, promtool: "
          f"{'ok' if r.returncode == 0 else 'FAILED'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
