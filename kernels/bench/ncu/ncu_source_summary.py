#!/usr/bin/env python3
"""Where a kernel's warps stall, from Nsight Compute's source page (per-SASS stall samples).

  ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv
  ncu_source_summary.py SOURCE.csv [--top N] [--cuts HEX,HEX,...]

Prints the stall reasons over all samples, the samples by opcode, the N instructions with the
most samples (offset from the kernel's first instruction, executions, the three largest
reasons), and with --cuts the samples of each address range between the cuts (e.g. a loop's S
product, softmax and P V parts, read off the listing --top prints).
"""
import argparse
import collections
import csv


def load(path):
    rows = list(csv.reader(open(path)))
    # The first row names the kernel; the second holds the column names.
    head = rows[1]
    col = {h: i for i, h in enumerate(head)}
    reasons = [h for h in head if h.startswith("stall_") and "(Not Issued)" not in h]
    out = []
    for r in rows[2:]:
        if len(r) < len(head):
            continue
        text = r[col["Source"]].strip()
        words = text.split()
        opcode = (words[1] if text.startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        out.append({
            "addr": int(r[col["Address"]], 16),
            "text": text,
            "opcode": opcode,
            "samples": int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
            "executed": int(r[col["Instructions Executed"]] or 0),
            "reasons": {h[len("stall_"):]: int(r[col[h]] or 0) for h in reasons},
        })
    base = out[0]["addr"] if out else 0
    for i in out:
        i["off"] = i["addr"] - base
    return out


def pct(v, total):
    return 100.0 * v / total if total else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--cuts", default="")
    a = ap.parse_args()
    ins = load(a.csv)
    total = sum(i["samples"] for i in ins)
    by_reason = collections.Counter()
    by_op = collections.Counter()
    for i in ins:
        by_reason.update(i["reasons"])
        by_op[i["opcode"]] += i["samples"]
    print(f"{total} samples over {len(ins)} instructions\n")
    print("| stall reason | share |\n|---|---:|")
    for k, v in by_reason.most_common():
        if v:
            print(f"| {k} | {pct(v, total):.1f}% |")
    print("\n| opcode | share of samples |\n|---|---:|")
    for k, v in by_op.most_common(16):
        print(f"| {k} | {pct(v, total):.1f}% |")
    print("\n| offset | share | executed | instruction | largest reasons |\n|---:|---:|---:|---|---|")
    for i in sorted(ins, key=lambda x: -x["samples"])[: a.top]:
        top3 = sorted(i["reasons"].items(), key=lambda kv: -kv[1])[:3]
        why = " ".join(f"{k}:{v}" for k, v in top3 if v)
        print(f"| {i['off']:x} | {pct(i['samples'], total):.2f}% | {i['executed']} | `{i['text'][:60]}` | {why} |")
    if a.cuts:
        cuts = [int(c, 16) for c in a.cuts.split(",")]
        edges = [0] + cuts + [1 << 40]
        print("\n| range | share | warp instructions | largest reasons (share of all samples) |\n|---|---:|---:|---|")
        for lo, hi in zip(edges, edges[1:]):
            part = [i for i in ins if lo <= i["off"] < hi]
            s = sum(i["samples"] for i in part)
            ex = sum(i["executed"] for i in part)
            rc = collections.Counter()
            for i in part:
                rc.update(i["reasons"])
            why = " ".join(f"{k}:{pct(v, total):.1f}" for k, v in rc.most_common(5) if v)
            top = "end" if hi == 1 << 40 else f"{hi:x}"
            print(f"| [{lo:x}, {top}) | {pct(s, total):.1f}% | {ex} | {why} |")


if __name__ == "__main__":
    main()
