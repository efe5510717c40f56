#!/usr/bin/env python3
"""Exact expectations for deploy/tests/prometheus_e2e.sh, computed from raw samples read back
through the Prometheus HTTP API, and compared with what Prometheus itself answers.

  prom_exact.py API_URL GOOD BAD

API_URL is http://HOST:PORT/api/v1. GOOD and BAD are the Attend requests that attnd answered with
OK and INVALID_ARGUMENT (all of them already scraped). The script re-implements, in Python:
  * histogram_quantile (promql bucketQuantile: sort by le, max-so-far monotonicity fix, linear
    interpolation inside the bucket holding rank q * count, lowest bucket starting at 0, the +Inf
    bucket answered with the highest finite bound);
  * rate()'s extrapolation (promql extrapolatedRate) over the rules' 5m window, in both forms
    Prometheus has shipped: up to 2.51 the zero-point limit is applied before the half-interval
    cap, from 2.52 after it. The two differ only when avg/2 < duration-to-zero < 1.1 * avg; a
    result matching either form is accepted.
and checks, each within 1e-6 relative:
  1. histogram_quantile(0.5, sum by (le) (buckets)) at a fixed time T (time=T) == the quantile of
     the bucket counts read at T;
  2. the recording rules job_rpc:attn_request_duration_seconds:p50_rate5m,
     job:attn_request_errors:ratio_rate5m and job:attn_requests:rate5m, at each of their last
     evaluations t_e (their own sample timestamps), == the value computed from the raw samples of
     the 5m window ending at t_e. A rule evaluation can miss a scrape that started just before t_e
     but was committed after it, so the window without the samples of (t_e - 0.3 s, t_e] is a
     second accepted candidate;
  3. the error ratio == BAD / (GOOD + BAD): exact when the OK and INVALID_ARGUMENT series were
     first scraped together and their first scraped values were in the same proportion as the
     whole traffic (the e2e script arranges this: then rate()'s extrapolation factor is the same
     for both series and cancels in the ratio). Tolerance 1e-6 relative then; when the two series
     were first scraped at different times (a scrape fell between the priming requests) the
     factors differ and the stated tolerance is 10% relative;
  4. the request rate lies within what the window's increase implies: increase / 300 s at least,
     and at most increase * (sampled + 2.2 * avg spacing) / sampled / 300 s (rate() extrapolates
     by at most 1.1 sample spacings at each end).
Exit status 0 when every check passes, 1 otherwise.
"""
import json
import math
import sys
import time
import urllib.parse
import urllib.request

RANGE_S = 300.0  # the rules' [5m]
REL = 1e-6


def ms(t):
    """A timestamp as Prometheus keeps it: integer milliseconds (the API writes seconds as JSON
    numbers, whose float form loses sub-microsecond precision at today's epoch)."""
    return int(round(float(t) * 1000))


def api_query(api, expr, t_ms):
    data = urllib.parse.urlencode(
        {"query": expr, "time": f"{t_ms // 1000}.{t_ms % 1000:03d}"}).encode()
    with urllib.request.urlopen(api + "/query", data=data, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise SystemExit(f"query {expr!r} at {t}: {body}")
    return body["data"]


def close(a, b, rel=REL):
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


# --- promql re-implementations ------------------------------------------------------------------

def extrapolated_rate(samples, range_start, range_end, variant):
    """rate() of one counter series; samples: [(t_ms, value)] inside (start, end] (ms); None when
    fewer than two samples (Prometheus drops such series)."""
    if len(samples) < 2:
        return None
    result = samples[-1][1] - samples[0][1]
    last = None
    for _, v in samples:  # counter resets
        if last is not None and v < last:
            result += last
        last = v
    first_t, first_v = samples[0]
    last_t = samples[-1][0]
    to_start = (first_t - range_start) / 1000
    to_end = (range_end - last_t) / 1000
    sampled = (last_t - first_t) / 1000
    avg = sampled / (len(samples) - 1)
    threshold = avg * 1.1
    if variant == "pre-2.52":
        if result > 0 and first_v >= 0:
            to_zero = sampled * (first_v / result)
            if to_zero < to_start:
                to_start = to_zero
        interval = sampled + (to_start if to_start < threshold else avg / 2)
    else:  # 2.52 and later
        if to_start >= threshold:
            to_start = avg / 2
        if result > 0 and first_v >= 0:
            to_zero = sampled * (first_v / result)
            if to_zero < to_start:
                to_start = to_zero
        interval = sampled + to_start
    interval += to_end if to_end < threshold else avg / 2
    return result * (interval / sampled) / RANGE_S


def bucket_quantile(q, buckets):
    """buckets: {le (float): cumulative count}."""
    b = sorted(buckets.items())
    if len(b) < 2 or not math.isinf(b[-1][0]):
        return math.nan
    counts, mx = [], -math.inf  # ensureMonotonic
    for _, c in b:
        mx = max(mx, c)
        counts.append(mx)
    total = counts[-1]
    if total == 0:
        return math.nan
    rank = q * total
    i = next((k for k in range(len(b) - 1) if counts[k] >= rank), len(b) - 1)
    if i == len(b) - 1:
        return b[-2][0]
    if i == 0 and b[0][0] <= 0:
        return b[0][0]
    start, end, count = 0.0, b[i][0], counts[i]
    if i > 0:
        start = b[i - 1][0]
        count -= counts[i - 1]
        rank -= counts[i - 1]
    return start + (end - start) * (rank / count)


# --- reading raw samples --------------------------------------------------------------------------

def range_samples(api, selector, t, drop_after=None):
    """{frozenset(labels): [(t, v)]} of selector[5m] at time t (raw samples, as rate() sees)."""
    d = api_query(api, f"{selector}[5m]", t)
    assert d["resultType"] == "matrix", d
    out = {}
    for s in d["result"]:
        pts = [(ms(ts), float(v)) for ts, v in s["values"]]
        if drop_after is not None:
            pts = [p for p in pts if p[0] <= drop_after]
        out[frozenset(s["metric"].items())] = pts
    return out


def rates(api, selector, t, variant, drop_after=None):
    out = {}
    for labels, pts in range_samples(api, selector, t, drop_after).items():
        r = extrapolated_rate(pts, t - int(RANGE_S * 1000), t, variant)
        if r is not None:
            out[labels] = r
    return out


def candidates(api, t, compute):
    """compute(variant, drop_after) for both extrapolation forms, with and without a scrape that
    the rule evaluation at t may not have seen yet."""
    out = []
    for variant in ("pre-2.52", "2.52+"):
        for drop in (None, t - 300):
            try:
                out.append((f"{variant}{'' if drop is None else ', last scrape unseen'}",
                            compute(variant, drop)))
            except ZeroDivisionError:
                pass
    return out


def rule_samples(api, rule, t, n=4):
    """The last n evaluations of a recording rule before t: [(t_e, value)]."""
    d = api_query(api, f"{rule}[20s]", t)
    if len(d["result"]) != 1:
        raise SystemExit(f"{rule}: expected one series at {t}, got {d['result']}")
    return [(ms(ts), float(v)) for ts, v in d["result"][0]["values"]][-n:]


# --- the checks -----------------------------------------------------------------------------------

def main():
    api, good, bad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    failures = []

    def check(ok, msg):
        print(("ok: " if ok else "FAIL: ") + msg)
        if not ok:
            failures.append(msg)

    # The latest scrape, one second back so that every sample up to T is committed.
    up = api_query(api, 'timestamp(up{job="attnd"})', ms(time.time()))["result"]
    T = ms(up[0]["value"][1]) - 1000

    # 1. histogram_quantile of the raw buckets at T.
    sel = 'attn_request_duration_seconds_bucket{job="attnd",rpc="Attend"}'
    d = api_query(api, sel, T)
    buckets = {float(s["metric"]["le"]): float(s["value"][1]) for s in d["result"]}
    total = buckets.get(math.inf, 0)
    check(total == good + bad, f"Attend latency observations at T = {total:g}, sent {good + bad}")
    want = bucket_quantile(0.5, buckets)
    got = float(api_query(api, f"histogram_quantile(0.5, sum by (le) ({sel}))", T)["result"][0]["value"][1])
    check(close(got, want), f"histogram_quantile(0.5) at T = {got!r}, from the {len(buckets)} bucket "
          f"counts {want!r}")

    # 2. recording rules against the raw 5m windows at their evaluation times.
    def p50(variant, drop):
        per_le = {}
        for labels, r in rates(api, sel, t_e, variant, drop).items():
            le = float(dict(labels)["le"])
            per_le[le] = per_le.get(le, 0.0) + r
        return bucket_quantile(0.5, per_le)

    def ratio(variant, drop):
        r = rates(api, 'attn_requests_total{job="attnd"}', t_e, variant, drop)
        num = sum(v for k, v in r.items() if dict(k)["code"] != "OK")
        return num / sum(r.values())

    def total_rate(variant, drop):
        return sum(rates(api, 'attn_requests_total{job="attnd"}', t_e, variant, drop).values())

    rules = [
        ('job_rpc:attn_request_duration_seconds:p50_rate5m{job="attnd",rpc="Attend"}', p50),
        ('job:attn_request_errors:ratio_rate5m{job="attnd"}', ratio),
        ('job:attn_requests:rate5m{job="attnd"}', total_rate),
    ]
    for rule, compute in rules:
        for t_e, v in rule_samples(api, rule, T):
            cands = candidates(api, t_e, compute)
            match = [name for name, c in cands if close(v, c)]
            groups = {}
            for name, c in cands:
                groups.setdefault(repr(c), []).append(name)
            check(bool(match), f"{rule.split('{')[0]} at {t_e / 1000:.3f} = {v!r}; from the raw samples: "
                  + "; ".join(f"{c} ({', '.join(names)})" for c, names in groups.items()))

    # 3. the error ratio the traffic implies.
    t_e, v = rule_samples(api, 'job:attn_request_errors:ratio_rate5m{job="attnd"}', T, 1)[0]
    series = range_samples(api, 'attn_requests_total{job="attnd",rpc="Attend"}', t_e)
    firsts = {dict(k)["code"]: pts[0] for k, pts in series.items() if pts}
    ok_first, bad_first = firsts.get("OK"), firsts.get("INVALID_ARGUMENT")
    aligned = (ok_first and bad_first and ok_first[0] == bad_first[0]
               and ok_first[1] * bad == bad_first[1] * good)
    tol = REL if aligned else 0.10
    implied = bad / (good + bad)
    check(close(v, implied, tol),
          f"error ratio {v!r} vs B/(N+B) = {bad}/{good + bad} = {implied!r} within {tol:g} relative "
          f"({'series first scraped together, in proportion' if aligned else 'series first scraped apart: extrapolation differs per series'}; "
          f"first samples OK {ok_first}, INVALID_ARGUMENT {bad_first})")

    # 4. the request rate against the window's increase.
    t_e, v = rule_samples(api, 'job:attn_requests:rate5m{job="attnd"}', T, 1)[0]
    series = range_samples(api, 'attn_requests_total{job="attnd"}', t_e)
    lo = hi = 0.0
    for pts in series.values():
        if len(pts) < 2:
            continue
        inc = pts[-1][1] - pts[0][1]
        sampled = (pts[-1][0] - pts[0][0]) / 1000
        avg = sampled / (len(pts) - 1)
        lo += inc / RANGE_S
        hi += inc * (sampled + 2.2 * avg) / sampled / RANGE_S
    check(lo * (1 - REL) <= v <= hi * (1 + REL),
          f"request rate {v!r} within [{lo!r}, {hi!r}] (the window's increase / 300 s, plus at "
          "most 1.1 sample spacings of extrapolation at each end)")

    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("exact checks: ok")


if __name__ == "__main__":
    main()
