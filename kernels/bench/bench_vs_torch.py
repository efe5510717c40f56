#!/usr/bin/env python3
"""attnd flash forward vs PyTorch SDPA (flash and cuDNN backends) on one GPU.

Usage: python3 bench_vs_torch.py --lib path/to/libattn_kernels_capi.so --out table.md
       python3 bench_vs_torch.py --lib v1=a.so,v2=b.so --out table.md   (variants side by side;
       the first is "ours" in the summary lines, each gets its own ratio columns and summary)
       python3 bench_vs_torch.py --lib gen1=a.so@1,gen2=a.so@2 --dims 64,128,256 --out t.md
       (NAME=PATH@G forces forward generation G of that library: 1 = mma.sync, 2 = sm_90a)
       python3 bench_vs_torch.py --lib a=x.so@2,b=x.so@2%tma_o=0 --out t.md
       (PATH%NAME=VALUE%...: plan options set while that variant runs and is timed, by the names
       of capi.cc's attn_set_plan_option: tiling, row_cut, l2_mib, l2_phases, tile_counter,
       dynamic, tma_o, decode_splits)
Sweep: bf16 and fp16; B*S = 16k tokens; H*D = 2048; s = 512..16k; d = 64, 128; causal off/on.
FLOPs = 4*B*H*S*S*D (halved for causal). Times: CUDA events around N back-to-back launches
(N chosen per function so that one timing covers >= --min-ms, default 20 ms), divided by N;
median over --reps such timings after warm-up, the functions' timings interleaved in alternating
order, or with --soak-ms each function soaked alone first (time_all says why). torch's
sdpa_kernel backend context is entered outside the timed region, so neither it nor a single
launch's host overhead is counted.
"""
import math
import argparse
import contextlib
import ctypes
import datetime
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def load_lib(spec):
    """PATH, or PATH@G: attn_flash_fwd, or attn_flash_fwd_gen with generation G bound; each
    %NAME=VALUE suffix is a plan option (attn_set_plan_option) set around every call of that
    variant."""
    spec, *opts = spec.split("%")
    options = [(k.encode(), int(v)) for k, v in (o.split("=", 1) for o in opts)]
    if options:
        inner = load_lib(spec)
        lib = ctypes.CDLL(spec.rsplit("@", 1)[0])
        lib.attn_set_plan_option.restype = ctypes.c_int
        lib.attn_set_plan_option.argtypes = [ctypes.c_char_p, ctypes.c_int]
        for k, v in options:  # fail early on an unknown name
            if lib.attn_set_plan_option(k, v) != 0:
                raise ValueError(f"unknown plan option {k.decode()}")
        lib.attn_set_plan_option(b"reset", 0)

        def with_options(*a):
            for k, v in options:
                lib.attn_set_plan_option(k, v)
            try:
                return inner(*a)
            finally:
                lib.attn_set_plan_option(b"reset", 0)
        return with_options
    path, gen = spec.rsplit("@", 1) if "@" in spec else (spec, None)
    lib = ctypes.CDLL(path)
    argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int] * 8 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t]
    if gen is None:
        fn = lib.attn_flash_fwd
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
        return fn
    fn = lib.attn_flash_fwd_gen
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes + [ctypes.c_int]
    return lambda *a: fn(*a, int(gen))


def load_libs(spec):
    """--lib's value, comma-separated items NAME=SPEC (SPEC as load_lib's; an item without a name
    is v<index>): [(name, function)]."""
    libs = []
    for i, item in enumerate(spec.split(",")):
        name, path = item.split("=", 1) if "=" in item else (f"v{i}", item)
        libs.append((name, load_lib(path)))
    return libs


def dtype_of(name):
    """'bf16' or 'fp16': the torch dtype and the C API's dtype code."""
    return (torch.bfloat16, 2) if name == "bf16" else (torch.float16, 1)


def sweep_shape(shape, tokens):
    """'d:s:causal' of the standard sweep (H * D = 2048, B * S = tokens): d, s, causal, h, b."""
    d, s, causal = (int(x) for x in shape.split(":"))
    return d, s, causal, 2048 // d, max(1, tokens // s)


def packed_inputs(b, s, h, d, dtype, dev):
    """N(0, 1) q, k, v packed as [b * s, h, d], the cu_seqlens of b sequences of s, and torch's
    [B, H, S, D] views of the same data."""
    q, k, v = (torch.randn(b * s, h, d, device=dev, dtype=dtype) for _ in range(3))
    cu = (torch.arange(b + 1, device=dev, dtype=torch.int32) * s).contiguous()
    views = tuple(x.view(b, s, h, d).transpose(1, 2) for x in (q, k, v))
    return q, k, v, cu, views


def run_ours(fn, dcode, q, k, v, o, cu, b, s, h, d, causal, stream):
    """One forward call of a load_lib function on packed tensors (equal lengths, default scale)."""
    rc = fn(dcode, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), None, cu.data_ptr(),
            cu.data_ptr(), b, b * s, b * s, s, s, h, h, d, 0.0, int(causal), -1, -1, stream)
    if rc != 0:
        raise RuntimeError(f"attn_flash_fwd returned {rc}")


def write_text(text, path):
    """Prints text and, when path is set, writes it there."""
    print(text)
    if path:
        with open(path, "w") as fh:
            fh.write(text)


def events_ms(fn, n):
    """Device time of n back-to-back calls of fn, between two CUDA events."""
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def time_all(fns, warmup, reps, min_ms, soak_ms=0.0):
    """Median per-call time (ms) and launches per timing N of each (name, fn, ctx) in fns; ctx()
    is entered around the calls, outside the timed region. The board's clock follows its power
    draw with a lag of tenths of a second, so timing one function right after another favours
    whichever draws less or runs first after a pause. soak_ms = 0: the timings are interleaved in
    alternating order (A B C, C B A, ...), so every function runs at the same mix of clocks (work
    per clock). soak_ms > 0: each function runs alone for soak_ms before its timings, so each is
    timed at the clock its own sustained power draw allows (as in a long run of it)."""
    ns = {}
    for name, fn, ctx in fns:
        with ctx():
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            one = events_ms(fn, 1)
            ns[name] = max(1, min(1000, math.ceil(min_ms / max(one, 1e-3))))
            events_ms(fn, ns[name])  # fill the launch queue once at this N before timing
    times = {name: [] for name, _, _ in fns}
    if soak_ms > 0:
        for name, fn, ctx in fns:
            with ctx():
                per_call = events_ms(fn, ns[name]) / ns[name]
                events_ms(fn, max(1, math.ceil(soak_ms / max(per_call, 1e-3))))
                times[name] = [events_ms(fn, ns[name]) / ns[name] for _ in range(reps)]
    else:
        for r in range(reps):
            for name, fn, ctx in (fns if r % 2 == 0 else fns[::-1]):
                with ctx():
                    times[name].append(events_ms(fn, ns[name]) / ns[name])
    return {name: (statistics.median(t), ns[name]) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True,
                    help="library path, or comma-separated NAME=PATH list of variants")
    ap.add_argument("--out", required=True, help="markdown table output path")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--min-ms", type=float, default=20.0,
                    help="each timing covers N back-to-back launches, N >= min-ms / one launch")
    ap.add_argument("--soak-ms", type=float, default=0.0,
                    help="run each function alone this long before timing it (its own sustained "
                         "clock); 0: interleave the functions' timings (the same clocks for all)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--backends", default="flash,cudnn")
    args = ap.parse_args()

    libs = load_libs(args.lib)
    multi = len(libs) > 1
    backends = [x for x in (("flash", SDPBackend.FLASH_ATTENTION),
                            ("cudnn", SDPBackend.CUDNN_ATTENTION))
                if x[0] in args.backends.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for dname in args.dtypes.split(","):
        dtype, dcode = dtype_of(dname)
        for causal in [bool(int(x)) for x in args.causal.split(",")]:
            for d in [int(x) for x in args.dims.split(",")]:
                h = 2048 // d
                for s in [int(x) for x in args.seqlens.split(",")]:
                    b = max(1, args.tokens // s)
                    # torch wants [B, H, S, D]: transposed views of the same packed data.
                    q, k, v, cu, (qt, kt, vt) = packed_inputs(b, s, h, d, dtype, dev)
                    o = torch.full_like(q, float("nan"))
                    stream = torch.cuda.current_stream().cuda_stream

                    def make_ours(fn):
                      return lambda: run_ours(fn, dcode, q, k, v, o, cu, b, s, h, d, causal, stream)

                    def sdpa():
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                    flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
                    fns = [(name, make_ours(fn), contextlib.nullcontext) for name, fn in libs]
                    ref = None
                    for name, be in backends:
                        try:
                            with sdpa_kernel(be):
                                out = sdpa()
                            if ref is None and name == "flash":
                                ref = out
                            fns.append((name, sdpa, lambda be=be: sdpa_kernel(be)))
                        except Exception as e:  # backend not available for this shape
                            print(f"# {name} failed for {dname} causal={causal} d={d} s={s}: {e}",
                                  file=sys.stderr)
                    timed = time_all(fns, args.warmup, args.reps, args.min_ms, args.soak_ms)
                    t_var = {name: timed[name][0] for name, _ in libs}
                    n_var = {name: timed[name][1] for name, _ in libs}
                    t_ours = t_var[libs[0][0]]
                    res = {name: timed[name][0] if name in timed else None
                           for name in ("flash", "cudnn")}
                    if ref is None:
                        with sdpa_kernel(SDPBackend.MATH):
                            ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                                 is_causal=causal)
                    ref_p = ref.transpose(1, 2).reshape(b * s, h, d).float()
                    errs = {}
                    for name, fn in libs:
                        o.fill_(float("nan"))
                        make_ours(fn)()
                        torch.cuda.synchronize()
                        errs[name] = ((o.float() - ref_p).norm() / ref_p.norm()).item()
                    err = errs[libs[0][0]]
                    tf = lambda t: flops / (t * 1e-3) / 1e12 if t else None
                    row = dict(dtype=dname, causal=causal, d=d, s=s, ours=tf(t_ours),
                               flash=tf(res["flash"]), cudnn=tf(res["cudnn"]), err=err,
                               var={n: tf(t) for n, t in t_var.items()}, errs=errs,
                               n_launch=n_var[libs[0][0]])
                    rows.append(row)
                    fmt = lambda x: f"{x:.1f}" if x is not None else "n/a"
                    rat = lambda a, c: f"{a / c:.3f}" if (a and c) else "n/a"
                    if multi:
                        print(f"{dname} causal={int(causal)} d={d:3d} s={s:5d}: flash "
                              f"{fmt(row['flash'])} cudnn {fmt(row['cudnn'])} N {row['n_launch']} | " + " | ".join(
                                  f"{n} {fmt(row['var'][n])} x{rat(row['var'][n], row['flash'])} "
                                  f"c{rat(row['var'][n], row['cudnn'])} err {errs[n]:.1e}"
                                  for n, _ in libs), flush=True)
                        del q, k, v, o, qt, kt, vt, ref, ref_p
                        torch.cuda.empty_cache()
                        continue
                    print(f"{dname} causal={int(causal)} d={d:3d} s={s:5d}: ours {fmt(row['ours'])} "
                          f"flash {fmt(row['flash'])} cudnn {fmt(row['cudnn'])} "
                          f"ours/flash {rat(row['ours'], row['flash'])} "
                          f"ours/cudnn {rat(row['ours'], row['cudnn'])} err {err:.2e} N {row['n_launch']}",
                          flush=True)
                    del q, k, v, o, qt, kt, vt, ref, ref_p
                    torch.cuda.empty_cache()

    if multi:
        write_multi(args, libs, rows)
        return
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"date {datetime.date.today().isoformat()}, tokens/batch {args.tokens}, H*D = 2048, "
             f"median of {args.reps} timings after {args.warmup} warm-up, each timing N "
             f"back-to-back launches >= {args.min_ms:g} ms (CUDA events), {timing_order(args)}. "
             f"TFLOP/s.", "",
             "| dtype | causal | d | s | ours | flash | cudnn | ours/flash | ours/cudnn | rel err vs torch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda x: f"{x:.1f}" if x is not None else "n/a"
        q = lambda a, c: f"{a / c:.3f}" if (a and c) else "n/a"
        lines.append(f"| {r['dtype']} | {int(r['causal'])} | {r['d']} | {r['s']} | {f(r['ours'])} | "
                     f"{f(r['flash'])} | {f(r['cudnn'])} | {q(r['ours'], r['flash'])} | "
                     f"{q(r['ours'], r['cudnn'])} | {r['err']:.2e} |")
    lines.append("")
    for key in ("flash", "cudnn"):
        ratios = [r["ours"] / r[key] for r in rows if r["s"] >= 1024 and r[key]]
        if ratios:
            lines.append(f"ours/{key} for s>=1k: min {min(ratios):.3f}, median "
                         f"{statistics.median(ratios):.3f} (n={len(ratios)})")
    write_text("\n".join(lines) + "\n", args.out)


def timing_order(args):
    if args.soak_ms > 0:
        return f"each function soaked alone for {args.soak_ms:g} ms before its timings"
    return "the functions' timings interleaved in alternating order"


def write_multi(args, libs, rows):
    names = [n for n, _ in libs]
    f = lambda x: f"{x:.1f}" if x is not None else "n/a"
    q = lambda a, c: f"{a / c:.3f}" if (a and c) else "n/a"
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"date {datetime.date.today().isoformat()}, tokens/batch {args.tokens}, H*D = 2048, "
             f"median of {args.reps} timings after {args.warmup} warm-up, each timing N "
             f"back-to-back launches >= {args.min_ms:g} ms (CUDA events), {timing_order(args)}. "
             f"TFLOP/s; "
             f"variants: {', '.join(names)}.", "",
             "| dtype | causal | d | s | flash | cudnn | " +
             " | ".join(f"{n} | {n}/flash | {n}/cudnn | {n} err" for n in names) + " |",
             "|---" * (6 + 4 * len(names)) + "|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {int(r['causal'])} | {r['d']} | {r['s']} | "
                     f"{f(r['flash'])} | {f(r['cudnn'])} | " + " | ".join(
                         f"{f(r['var'][n])} | {q(r['var'][n], r['flash'])} | "
                         f"{q(r['var'][n], r['cudnn'])} | {r['errs'][n]:.2e}"
                         for n in names) + " |")
    lines.append("")
    for n in names:
        for key in ("flash", "cudnn"):
            ratios = [r["var"][n] / r[key] for r in rows if r["s"] >= 1024 and r[key]]
            if ratios:
                lines.append(f"{n}/{key} for s>=1k: min {min(ratios):.3f}, median "
                             f"{statistics.median(ratios):.3f} (n={len(ratios)})")
    # Per head dim, every variant against cuDNN (the generation-2 target).
    for d in sorted({r["d"] for r in rows}):
        for n in names:
            ratios = [r["var"][n] / r["cudnn"] for r in rows
                      if r["d"] == d and r["s"] >= 1024 and r["cudnn"] and r["var"][n]]
            if ratios:
                lines.append(f"d={d}: {n}/cudnn for s>=1k: min {min(ratios):.3f}, median "
                             f"{statistics.median(ratios):.3f}, max {max(ratios):.3f} "
                             f"(n={len(ratios)})")
    # Per head dim, every variant against the first (for choosing a config per head dim).
    for d in sorted({r["d"] for r in rows}):
        for key in names[1:] + ["flash"]:
            ratios = [r["var"][names[0]] / (r["var"][key] if key in names else r[key])
                      for r in rows if r["d"] == d and r["s"] >= 1024
                      and (r["var"][key] if key in names else r[key])]
            if ratios:
                lines.append(f"d={d}: {names[0]}/{key} for s>=1k: min {min(ratios):.3f}, median "
                             f"{statistics.median(ratios):.3f}, max {max(ratios):.3f} "
                             f"(n={len(ratios)})")
    write_text("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
