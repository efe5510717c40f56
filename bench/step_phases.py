#!/usr/bin/env python3
"""Where a session step's host time goes, from attnd's attn_step_phase_duration_seconds.

  step_phases.py scrape http://HOST:PORT/metrics FILE      save one scrape
  step_phases.py diff BEFORE AFTER LABEL [--header]        print a table row of the means (us)
                                                           of each phase between the scrapes,
                                                           and the mean new tokens per launch
  step_phases.py diff BEFORE AFTER LABEL --less B2 A2      the same less what changed from B2
                                                           to A2 (a run with the same set-up,
                                                           e.g. the same prefill, and a tiny
                                                           measured part)
"""
import re
import sys
import urllib.request

PHASES = ["decode", "stage", "enqueue", "wait", "finish", "answer", "send"]
LINE = re.compile(r'^attn_step_phase_duration_seconds_(sum|count)\{phase="(\w+)"\} (\S+)$')
# The mean of its per-batch values: new tokens per launch (one query token a decode step).
TOKENS = re.compile(r'^attn_step_tokens_per_launch_(sum|count) (\S+)$')


def parse(path):
    values = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line.strip())
            if m:
                values[(m.group(2), m.group(1))] = float(m.group(3))
            m = TOKENS.match(line.strip())
            if m:
                values[("tokens", m.group(1))] = float(m.group(2))
    return values


def main():
    if sys.argv[1] == "scrape":
        with urllib.request.urlopen(sys.argv[2], timeout=10) as r, open(sys.argv[3], "wb") as f:
            f.write(r.read())
        return
    before, after, label = parse(sys.argv[2]), parse(sys.argv[3]), sys.argv[4]
    rest = sys.argv[5:]
    header = "--header" in rest
    less_before = less_after = {}
    if "--less" in rest:
        i = rest.index("--less")
        less_before, less_after = parse(rest[i + 1]), parse(rest[i + 2])

    def delta(p, what):
        return (after.get((p, what), 0) - before.get((p, what), 0)
                - (less_after.get((p, what), 0) - less_before.get((p, what), 0)))

    cells = []
    for p in PHASES:
        n, s = delta(p, "count"), delta(p, "sum")
        cells.append(f"{1e6 * s / n:.1f} ({int(n)})" if n > 0 else "-")
    n, s = delta("tokens", "count"), delta("tokens", "sum")
    cells.append(f"{s / n:.2f}" if n > 0 else "-")
    if header:
        print("| level | " + " | ".join(f"{p} us (n)" for p in PHASES) + " | tokens per launch |")
        print("| --- " * (len(PHASES) + 2) + "|")
    print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
