#!/usr/bin/env python3
"""attnd decode (split-KV, contiguous and paged K/V) and paged chunked prefill vs PyTorch SDPA.

Usage: python3 bench_decode.py --lib path/to/libattn_kernels_capi.so --out table.md

Decode: GQA 32/8, d=128, bf16, one query token per sequence, batch x cache as in --decode.
  TB/s = bytes of K and V read (batch * cache * 8 heads * 128 * 2 B * 2) / time. Ours on
  contiguous K/V and on page pools of --pages tokens (pages in shuffled order); torch SDPA
  (flash and cuDNN backends, enable_gqa, the same contiguous K/V: torch has no paged SDPA).
  Inputs are rotated over enough copies that K+V of one launch is never L2-resident from the
  previous launch (>= 4x the L2 over the copies), for every implementation alike.
Chunked prefill: a chunk of C queries over P cached keys plus the chunk (s_k = P + C, causal,
  bottom-right aligned), batch 1, 32/8 heads, d in --prefill-dims: ours paged (pages shuffled, the
  last one padded with NaN; Run's choice, and generation 1 forced) vs ours contiguous (the forward
  kernel), all with the workspace, and torch flash with a lower-right causal bias where it runs.
  TFLOP/s with FLOPs 4 * H * D * sum over queries of keys seen.
Multi-token steps (--steps BxQxL): B sequences of Q queries over L cached keys, paged: the decode
  kernel (Run's choice for Q <= 16) against the generation-2 forward kernel forced.
Merging the splits (--fused-combine, on by default): at the decode points with KV splits, the
  plan's splits merged by a combine kernel after the split kernel (the library's default) against
  the split kernel's last CTA of each group merging them (PlanOptions::decode_fused_combine, one
  launch fewer), timed in alternation, contiguous and on the first page size; each one's error
  against the combine kernel's result.
Small-batch splits (--split-sweep S1,S2,...): at the decode points the GPU is not full at without
  splits (batch x KV heads < 90% of the SMs), ours with each forced KV
  split count beside the plan's own.
FP8 K/V decode (--fp8 BxL,...): GQA 32/8, d=128, bf16 queries, one token per sequence: ours over
  bf16 K/V against ours over e4m3 K/V (the same values quantized per (sequence, KV head) with scale
  amax / 448), contiguous and on pages of 16; steps/s and the ratio, and each one's error against
  torch SDPA on the values it computes with (bf16: the bf16 K/V; FP8: the dequantized K/V).
Times: CUDA events around N back-to-back launches (N so that one timing covers >= --min-ms),
  divided by N; median of --reps timings after warm-up.
"""
import argparse
import ctypes
import datetime
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

P = ctypes.c_void_p
I = ctypes.c_int


def load(path):
    lib = ctypes.CDLL(path)
    lib.attn_run.restype = I
    lib.attn_run.argtypes = [I] + [P] * 7 + [I] * 8 + [ctypes.c_float, I, I, I, I, I, P, P, P, P,
                                                        ctypes.c_size_t]
    lib.attn_workspace_bytes.restype = ctypes.c_size_t
    lib.attn_workspace_bytes.argtypes = [I] * 11
    try:  # libraries built before attn_run_gen have only Run's own choice
        lib.attn_run_gen.restype = I
        lib.attn_run_gen.argtypes = lib.attn_run.argtypes + [I]
    except AttributeError:
        pass
    try:  # FP8 K/V and the decode plan's splits (newer libraries)
        lib.attn_run_fp8kv.restype = I
        lib.attn_run_fp8kv.argtypes = lib.attn_run.argtypes[:-2] + [P, P, P, ctypes.c_size_t]
        lib.attn_plan_decode_splits.restype = I
        lib.attn_plan_decode_splits.argtypes = [I] * 8
        lib.attn_set_plan_option.restype = I
        lib.attn_set_plan_option.argtypes = [ctypes.c_char_p, I]
    except AttributeError:
        pass
    return lib


def events_ms(fn, n):
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def time_ms(fn, warmup, reps, min_ms):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    one = events_ms(fn, 1)
    n = max(1, min(2000, math.ceil(min_ms / max(one, 1e-3))))
    events_ms(fn, n)
    times = [events_ms(fn, n) / n for _ in range(reps)]
    return statistics.median(times)


def time_pair_ms(fa, fb, warmup, reps, min_ms):
    """time_ms of fa and of fb with their timings alternated (one of each per round), so that a
    drift of the host or the clocks meets both alike."""
    for _ in range(warmup):
        fa()
        fb()
    torch.cuda.synchronize()
    n = [max(1, min(2000, math.ceil(min_ms / max(events_ms(f, 1), 1e-3)))) for f in (fa, fb)]
    ta, tb = [], []
    for _ in range(reps):
        ta.append(events_ms(fa, n[0]) / n[0])
        tb.append(events_ms(fb, n[1]) / n[1])
    return statistics.median(ta), statistics.median(tb)


class Rotor:
    """Calls fn(i) with i cycling over the input copies."""

    def __init__(self, fn, n):
        self.fn, self.n, self.i = fn, n, 0

    def __call__(self):
        self.fn(self.i)
        self.i = (self.i + 1) % self.n


def paged_pool(kc, b, L, ps, gen):
    """Page pool [pages, ps, Hkv, D] holding contiguous kc [b*L, Hkv, D] in shuffled page order,
    and the CSR table (indptr, indices) and seqlens."""
    npg = b * L // ps
    perm = torch.randperm(npg, generator=gen).to(kc.device)
    pool = torch.empty((npg, ps) + tuple(kc.shape[1:]), dtype=kc.dtype, device=kc.device)
    pool[perm] = kc.view((npg, ps) + tuple(kc.shape[1:]))
    indices = perm.to(torch.int32).contiguous()  # logical page p of the batch lives at perm[p]
    indptr = (torch.arange(b + 1, device=kc.device, dtype=torch.int32) * (L // ps)).contiguous()
    seqlens = torch.full((b,), L, dtype=torch.int32, device=kc.device)
    return pool, indptr, indices, seqlens, npg


def paged_pools(ks, vs, b, L, ps, gen):
    """paged_pool of each K copy in ks, and each V copy of vs in the same page placement as its K:
    (the K pools with their tables, the V pools)."""
    pk = [paged_pool(x, b, L, ps, gen) for x in ks]
    pv = []
    for i, x in enumerate(vs):
        pool = torch.empty_like(pk[i][0])
        pool[pk[i][2].long()] = x.view(pool.shape)
        pv.append(pool)
    return pk, pv


H, HKV = 32, 8


def run_args(lib, q, k, v, o, cu_q, cu_k, b, tq, tk, mq, mk, D, causal, ws, stream, paged=None,
             gen=0):
    """One attn_run (gen 0) or attn_run_gen call; raises on a non-zero return."""
    ps, npg, indptr, indices, seqlens = paged if paged else (0, 0, None, None, None)
    a = [2, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), None, cu_q.data_ptr(),
         cu_k.data_ptr() if cu_k is not None else None, b, tq, tk, mq, mk, H, HKV, D, 0.0,
         int(causal), -1, -1, ps, npg, indptr.data_ptr() if paged else None,
         indices.data_ptr() if paged else None, seqlens.data_ptr() if paged else None,
         ws.data_ptr() if ws is not None else None, stream]
    rc = lib.attn_run(*a) if gen == 0 else lib.attn_run_gen(*a, gen)
    if rc != 0:
        raise RuntimeError(f"attn_run returned {rc}")


def workspace_of(lib, b, tq, tk, mq, mk, D, dev, ps=0, npg=0):
    n = lib.attn_workspace_bytes(2, b, tq, tk, mq, mk, H, HKV, D, ps, npg)
    return torch.empty(max(n, 16), dtype=torch.uint8, device=dev), n


def paged_copy(k, v, ps, gen):
    """K and V [L, HKV, D] as page pools of ps tokens in shuffled order (the last page padded with
    NaN), with the table: (pool_k, pool_v, indptr, indices, seqlens, num_pages)."""
    L = k.shape[0]
    Lp = (L + ps - 1) // ps * ps
    kp = torch.full((Lp,) + tuple(k.shape[1:]), float("nan"), device=k.device, dtype=k.dtype)
    vp = torch.full_like(kp, float("nan"))
    kp[:L] = k
    vp[:L] = v
    pool_k, indptr, indices, _, npg = paged_pool(kp, 1, Lp, ps, gen)
    pool_v = torch.empty_like(pool_k)
    pool_v[indices.long()] = vp.view(pool_v.shape)
    seqlens = torch.tensor([L], device=k.device, dtype=torch.int32)
    return pool_k, pool_v, indptr, indices, seqlens, npg


def prefill_point(lib, C, Pc, D, ppages, args, gen, dev, dt):
    """One chunk of C queries over Pc cached keys, head dim D: contiguous, paged (Run's choice and
    generation 1 forced) and torch; TFLOP/s and errors."""
    stream = torch.cuda.current_stream().cuda_stream
    warm_up_clocks(dev)
    L = Pc + C
    q = torch.randn(C, H, D, device=dev, dtype=dt)
    k = torch.randn(L, HKV, D, device=dev, dtype=dt)
    v = torch.randn(L, HKV, D, device=dev, dtype=dt)
    o = torch.full_like(q, float("nan"))
    cu_q = torch.tensor([0, C], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, L], device=dev, dtype=torch.int32)
    flops = 4.0 * H * D * (C * Pc + C * (C + 1) / 2)
    ws, _ = workspace_of(lib, 1, C, L, C, L, D, dev)
    res = {}
    contig = lambda: run_args(lib, q, k, v, o, cu_q, cu_k, 1, C, L, C, L, D, True, ws, stream)
    res["contig"] = time_ms(contig, args.warmup, args.reps, args.min_ms)
    contig()
    torch.cuda.synchronize()
    ours_o = o.float().clone()
    has_gen = hasattr(lib, "attn_run_gen")
    for ps in ppages:
        pk, pv, indptr, indices, seqlens, npg = paged_copy(k, v, ps, gen)
        wsp, _ = workspace_of(lib, 1, C, 0, C, L, D, dev, ps, npg)
        for g, key in ((0, f"page{ps}"), (1, f"page{ps}_g1"), (2, f"page{ps}_g2")):
            if (g and not has_gen) or g not in args.prefill_gens:
                continue
            call = lambda g=g: run_args(lib, q, pk, pv, o, cu_q, None, 1, C, 0, C, L, D, True, wsp,
                                        stream, (ps, npg, indptr, indices, seqlens), g)
            res[key] = time_ms(call, args.warmup, args.reps, args.min_ms)
            o.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            res[key + "_err"] = ((o.float() - ours_o).norm() / ours_o.norm()).item()
        del pk, pv
    qt = q.view(1, C, H, D).transpose(1, 2)
    kt = k.view(1, L, HKV, D).transpose(1, 2)
    vt = v.view(1, L, HKV, D).transpose(1, 2)
    res["flash"] = None
    res["err"] = float("nan")
    res["torch_be"] = "n/a"
    from torch.nn.attention.bias import causal_lower_right
    bias = causal_lower_right(C, L)
    for be_name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                        ("mem-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(be):
                out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, enable_gqa=True)
                res["flash"] = time_ms(lambda: F.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=bias, enable_gqa=True), args.warmup, args.reps,
                    args.min_ms)
            ref = out.transpose(1, 2).reshape(C, H, D).float()
            res["err"] = ((ours_o - ref).norm() / ref.norm()).item()
            res["torch_be"] = be_name
            break
        except Exception as e:
            print(f"# torch {be_name} lower-right causal failed for {C}x{Pc}: {e}", file=sys.stderr)
    tf = lambda t: flops / (t * 1e-3) / 1e12 if t else None
    row = dict(kind="prefill", C=C, P=Pc, D=D,
               **{k2: (tf(v2) if not k2.endswith(("err", "_be")) else v2) for k2, v2 in res.items()})
    f = lambda x: f"{x:.1f}" if x is not None else "n/a"
    print(f"prefill d={D} chunk {C} over {Pc}: contig {f(row['contig'])} "
          + " ".join(f"page{ps} {f(row.get(f'page{ps}'))} (g1 {f(row.get(f'page{ps}_g1'))}, "
                     f"g2 {f(row.get(f'page{ps}_g2'))}, "
                     f"err {row.get(f'page{ps}_err', float('nan')):.1e})" for ps in ppages)
          + f" torch {f(row['flash'])} TFLOP/s", flush=True)
    return row


def steps_point(lib, b, nq, L, ps, args, gen, dev, dt):
    """b sequences of nq new queries over L cached keys each (causal), paged: the decode kernel
    (Run's choice) against generation 2 forced; microseconds and TB/s of K+V."""
    stream = torch.cuda.current_stream().cuda_stream
    D = 128
    Lt = L + nq
    q = torch.randn(b * nq, H, D, device=dev, dtype=dt)
    k = torch.randn(b * Lt, HKV, D, device=dev, dtype=dt)
    v = torch.randn(b * Lt, HKV, D, device=dev, dtype=dt)
    o = torch.full_like(q, float("nan"))
    Lp = (Lt + ps - 1) // ps * ps
    kpad = torch.zeros(b * Lp, HKV, D, device=dev, dtype=dt)
    vpad = torch.zeros_like(kpad)
    for i in range(b):
        kpad[i * Lp:i * Lp + Lt] = k[i * Lt:(i + 1) * Lt]
        vpad[i * Lp:i * Lp + Lt] = v[i * Lt:(i + 1) * Lt]
    pool_k, indptr, indices, _, npg = paged_pool(kpad, b, Lp, ps, gen)
    pool_v = torch.empty_like(pool_k)
    pool_v[indices.long()] = vpad.view(pool_v.shape)
    seqlens = torch.full((b,), Lt, dtype=torch.int32, device=dev)
    cu_q = (torch.arange(b + 1, device=dev, dtype=torch.int32) * nq).contiguous()
    ws, _ = workspace_of(lib, b, b * nq, 0, nq, Lt, D, dev, ps, npg)
    paged = (ps, npg, indptr, indices, seqlens)
    res = {}
    outs = {}
    for g, key in ((0, "decode"), (2, "gen2")):
        if g and not hasattr(lib, "attn_run_gen"):
            res[key] = None
            continue
        call = lambda g=g: run_args(lib, q, pool_k, pool_v, o, cu_q, None, b, b * nq, 0, nq, Lt, D,
                                    True, ws, stream, paged, g)
        res[key] = time_ms(call, args.warmup, args.reps, args.min_ms)
        o.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        outs[key] = o.float().clone()
    err = ((outs["gen2"] - outs["decode"]).norm() / outs["decode"].norm()).item() \
        if "gen2" in outs else float("nan")
    kv = 2.0 * b * Lt * HKV * D * 2
    tb = lambda t: kv / (t * 1e-3) / 1e12 if t else None
    row = dict(kind="steps", b=b, nq=nq, L=L, decode_us=res["decode"] * 1e3,
               gen2_us=res["gen2"] * 1e3 if res["gen2"] else None, decode_tb=tb(res["decode"]),
               gen2_tb=tb(res["gen2"]), err=err)
    print(f"steps {b}x{nq}x{L}: decode {row['decode_us']:.1f} us, gen2 "
          f"{row['gen2_us'] if row['gen2_us'] else float('nan'):.1f} us, err {err:.1e}", flush=True)
    return row


def quantize_e4m3(x, b, L):
    """x [b*L, HKV, D] -> (codes as uint8 [b*L, HKV, D], scales float32 [b, HKV]): per (sequence,
    KV head) scale amax / 448, round to nearest even, clamped to +-448."""
    xs = x.float().view(b, L, HKV, -1)
    amax = xs.abs().amax(dim=(1, 3))  # [b, HKV]
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (xs / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view_as(x).contiguous(), scale.contiguous()


def dequantize_e4m3(codes, scale, b, L):
    """The float32 values the codes of quantize_e4m3 stand for, [b*L, HKV, D]."""
    v = codes.view(torch.float8_e4m3fn).float().view(b, L, HKV, -1)
    return (v * scale[:, None, :, None]).view_as(codes)


def run_fp8(lib, q, k, v, o, cu_q, cu_k, b, tq, tk, mq, mk, D, ks, vs, stream, paged=None):
    ps, npg, indptr, indices, seqlens = paged if paged else (0, 0, None, None, None)
    rc = lib.attn_run_fp8kv(2, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), None,
                            cu_q.data_ptr(), cu_k.data_ptr() if cu_k is not None else None, b, tq,
                            tk, mq, mk, H, HKV, D, 0.0, 0, -1, -1, ps, npg,
                            indptr.data_ptr() if paged else None,
                            indices.data_ptr() if paged else None,
                            seqlens.data_ptr() if paged else None, ks.data_ptr(), vs.data_ptr(),
                            None, stream)
    if rc != 0:
        raise RuntimeError(f"attn_run_fp8kv returned {rc}")


def fp8_point(lib, b, L, args, dev, dt, l2):
    """Decode of b sequences over L cached keys: ours over bf16 K/V vs ours over FP8 K/V
    (contiguous and pages of 16); steps/s."""
    stream = torch.cuda.current_stream().cuda_stream
    D = 128
    bf16_bytes = 2 * b * L * HKV * D * 2
    copies = max(1, min(16, math.ceil(4 * l2 / (bf16_bytes // 2))))
    qs = [torch.randn(b, H, D, device=dev, dtype=dt) for _ in range(copies)]
    ks = [torch.randn(b * L, HKV, D, device=dev, dtype=dt) for _ in range(copies)]
    vs = [torch.randn(b * L, HKV, D, device=dev, dtype=dt) for _ in range(copies)]
    fk = [quantize_e4m3(x, b, L) for x in ks]
    fv = [quantize_e4m3(x, b, L) for x in vs]
    o = torch.full((b, H, D), float("nan"), device=dev, dtype=dt)
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
    cu_k = (torch.arange(b + 1, device=dev, dtype=torch.int32) * L).contiguous()
    res = {}
    # bf16 K/V (the bf16 copies rotate over as many copies as the FP8 ones: >= 4x L2 each)
    bf = lambda i: run_args(lib, qs[i], ks[i], vs[i], o, cu_q, cu_k, b, b, b * L, 1, L, D, False,
                            None, stream)
    res["bf16"] = time_ms(Rotor(bf, copies), args.warmup, args.reps, args.min_ms)
    bf(0)
    torch.cuda.synchronize()
    o_bf = o.float().clone()
    f8 = lambda i: run_fp8(lib, qs[i], fk[i][0], fv[i][0], o, cu_q, cu_k, b, b, b * L, 1, L, D,
                           fk[i][1], fv[i][1], stream)
    res["fp8"] = time_ms(Rotor(f8, copies), args.warmup, args.reps, args.min_ms)
    o.fill_(float("nan"))
    f8(0)
    torch.cuda.synchronize()
    o_f8 = o.float().clone()
    gen_p = torch.Generator().manual_seed(b * 13 + L)
    pk, pv = paged_pools([x[0] for x in fk], [x[0] for x in fv], b, L, 16, gen_p)
    f8p = lambda i: run_fp8(lib, qs[i], pk[i][0], pv[i], o, cu_q, None, b, b, 0, 1, L, D, fk[i][1],
                            fv[i][1], stream, (16, pk[i][4], pk[i][1], pk[i][2], pk[i][3]))
    res["fp8_page16"] = time_ms(Rotor(f8p, copies), args.warmup, args.reps, args.min_ms)
    o.fill_(float("nan"))
    f8p(0)
    torch.cuda.synchronize()
    page_err = ((o.float() - o_f8).norm() / o_f8.norm()).item()  # before o_f8 is cut to bb rows
    # Each against torch SDPA (math in float32) on the values it computes with, over the first
    # few sequences (the math backend expands K/V to every query head).
    bb = min(b, 4)
    def sdpa(kk, vv):
        qt = qs[0][:bb].float().view(bb, H, 1, D)
        kt = kk[:bb * L].float().view(bb, L, HKV, D).transpose(1, 2)
        vt = vv[:bb * L].float().view(bb, L, HKV, D).transpose(1, 2)
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).view(bb, H, D)
    ref_bf = sdpa(ks[0], vs[0])
    ref_f8 = sdpa(dequantize_e4m3(*fk[0], b, L), dequantize_e4m3(*fv[0], b, L))
    o_bf, o_f8 = o_bf[:bb], o_f8[:bb]
    err = lambda x, r: ((x - r).norm() / r.norm()).item()
    splits = lib.attn_plan_decode_splits(2, 1, b, 1, L, H, HKV, D)
    splits_bf = lib.attn_plan_decode_splits(2, 0, b, 1, L, H, HKV, D)
    row = dict(kind="fp8", b=b, L=L, splits=splits, splits_bf=splits_bf,
               bf16_us=res["bf16"] * 1e3, fp8_us=res["fp8"] * 1e3, fp8p_us=res["fp8_page16"] * 1e3,
               err_bf=err(o_bf, ref_bf), err_f8=err(o_f8, ref_f8), err_quant=err(ref_f8, ref_bf),
               page_err=page_err, bf16_bytes=bf16_bytes)
    print(f"fp8 {b}x{L}: bf16 {row['bf16_us']:.1f} us, fp8 {row['fp8_us']:.1f} us "
          f"(x{row['bf16_us'] / row['fp8_us']:.2f}), fp8 page16 {row['fp8p_us']:.1f} us, "
          f"err bf16 {row['err_bf']:.1e} fp8 {row['err_f8']:.1e} quant {row['err_quant']:.1e}",
          flush=True)
    del qs, ks, vs, fk, fv, pk, pv
    torch.cuda.empty_cache()
    return row


def warm_up_clocks(dev, seconds=2.0):
    """Keeps the GPU busy for a while first: the first point of a run is otherwise timed while the
    clocks are still rising (batch-1 4k measured 18.4 us first, 12.4 us once warm)."""
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode", default="1x4096,16x4096,64x4096,16x32768,128x8192")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--prefill", default="512x4096,2048x4096,512x32768,2048x32768",
                    help="CHUNKxCACHED list for chunked prefill")
    ap.add_argument("--prefill-pages", default="16,64")
    ap.add_argument("--prefill-dims", default="128", help="head dims of the chunked prefill points")
    ap.add_argument("--prefill-gens", default="0,1,2",
                    help="paged prefill kernels timed: 0 the plan's choice, 1 / 2 generation 1 / 2 forced")
    ap.add_argument("--steps", default="", help="BATCHxQUERIESxCACHED list of multi-token steps")
    ap.add_argument("--steps-page", type=int, default=16)
    ap.add_argument("--split-sweep", default="", help="forced KV splits timed at small-batch points")
    ap.add_argument("--fused-combine", type=int, default=1,
                    help="1: time the splits merged in the split kernel against the combine kernel")
    ap.add_argument("--fp8", default="", help="BATCHxCACHED list of FP8 K/V decode points")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--min-ms", type=float, default=20.0)
    args = ap.parse_args()
    args.prefill_gens = {int(x) for x in args.prefill_gens.split(",") if x}

    lib = load(args.lib)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    D = 128
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    pages = [int(x) for x in args.pages.split(",") if x]
    lines = []
    rows = []

    def run_ours(q, k, v, o, cu_q, cu_k, b, tq, tk, mq, mk, causal, ws, paged=None):
        ps, npg, indptr, indices, seqlens = paged if paged else (0, 0, None, None, None)
        rc = lib.attn_run(2, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), None,
                          cu_q.data_ptr(), cu_k.data_ptr() if cu_k is not None else None, b, tq, tk,
                          mq, mk, H, HKV, D, 0.0, int(causal), -1, -1, ps, npg,
                          indptr.data_ptr() if paged else None,
                          indices.data_ptr() if paged else None,
                          seqlens.data_ptr() if paged else None,
                          ws.data_ptr() if ws is not None else None, stream)
        if rc != 0:
            raise RuntimeError(f"attn_run returned {rc}")

    def workspace(b, tq, tk, mq, mk, ps=0, npg=0):
        n = lib.attn_workspace_bytes(2, b, tq, tk, mq, mk, H, HKV, D, ps, npg)
        return (torch.empty(n, dtype=torch.uint8, device=dev) if n else None), n

    ppages = [int(x) for x in args.prefill_pages.split(",") if x]
    pdims = [int(x) for x in args.prefill_dims.split(",") if x]
    items = [x for x in args.prefill.split(",") if x]

    def write_table(final):
        """The tables of the rows so far, to --out (printed too when final): after each
        section, so that a run cut short keeps what it measured."""
        lines = []
        f2 = lambda x: f"{x:.2f}" if x is not None else "n/a"
        r3 = lambda a, c: f"{a / c:.3f}" if (a and c) else "n/a"
        lines += [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                  f"date {datetime.date.today().isoformat()}, L2 {l2 >> 20} MiB. Median of {args.reps} "
                  f"timings after {args.warmup} warm-up, each N back-to-back launches >= "
                  f"{args.min_ms:g} ms (CUDA events), inputs rotated over copies (>= 4x L2).", "",
                  "Decode, GQA 32/8, d=128, bf16, 1 query token: TB/s of K+V read.", "",
                  "| batch x cache | splits | ours contig | " +
                  " | ".join(f"ours page{ps}" for ps in pages) +
                  " | torch flash | torch cuDNN | ours/cuDNN | " +
                  " | ".join(f"page{ps}/contig" for ps in pages) + " | ours us | cuDNN us | err vs torch |",
                  "|---" * (9 + 2 * len(pages)) + "|"]
        for r in rows:
            if r["kind"] != "decode":
                continue
            lines.append(f"| {r['b']} x {r['L'] // 1024}k | {r['splits']} | {f2(r['ours'])} | " +
                         " | ".join(f2(r[f'page{ps}']) for ps in pages) +
                         f" | {f2(r.get('flash'))} | {f2(r.get('cudnn'))} | {r3(r['ours'], r.get('cudnn'))} | " +
                         " | ".join(r3(r[f'page{ps}'], r['ours']) for ps in pages) +
                         f" | {r['us']['ours']:.1f} | {r['us'].get('cudnn', float('nan')):.1f} | {r['err']:.1e} |")
        fused = [r for r in rows if r["kind"] == "decode" and r.get("fused")]
        if fused:
            lines += ["", "Merging the splits: combine kernel vs the split kernel's last CTA (decode_fused_combine), "
                      "us per launch timed in alternation; errors against the combine kernel's contiguous result.", "",
                      "| batch x cache | splits | layout | combine us | fused us | fused/combine | err combine | err fused |",
                      "|---" * 8 + "|"]
            for r in fused:
                fr = r["fused"]
                for name in [k[:-len("_comb_us")] for k in fr if k.endswith("_comb_us")]:
                    c, fu = fr[f"{name}_comb_us"], fr[f"{name}_fused_us"]
                    lines.append(f"| {r['b']} x {r['L'] // 1024}k | {r['splits']} | {name} | {c:.2f} | {fu:.2f} | "
                                 f"{fu / c:.3f} | {fr[f'{name}_comb_err']:.1e} | {fr[f'{name}_fused_err']:.1e} |")
        sweeps = [r for r in rows if r["kind"] == "decode" and r.get("sweep")]
        if sweeps:
            sps = sorted({sp for r in sweeps for sp in r["sweep"]})
            lines += ["", "Small-batch decode, KV splits forced (GQA 32/8, d=128, bf16): us per launch (TB/s); "
                      "plan: the plan's own choice (its splits in brackets).", "",
                      "| batch x cache | plan | " + " | ".join(f"{sp} splits" for sp in sps) + " | torch cuDNN | "
                      "plan/cuDNN speed | max err vs plan |", "|---" * (5 + len(sps)) + "|"]
            for r in sweeps:
                kvb = 2 * r["b"] * r["L"] * HKV * 128 * 2
                cell = lambda t: f"{t * 1e3:.1f} ({kvb / (t * 1e-3) / 1e12:.2f})"
                cud = r["us"].get("cudnn")
                lines.append(f"| {r['b']} x {r['L'] // 1024}k | {r['us']['ours']:.1f} ({r['ours']:.2f}) [{r['splits']}] | " +
                             " | ".join(cell(r["sweep"][sp][0]) if sp in r["sweep"] else "n/a" for sp in sps) +
                             f" | {f2(cud)} | {r3(cud, r['us']['ours'])} | "
                             f"{max(e for _, e in r['sweep'].values()):.1e} |")
        fp8s = [r for r in rows if r["kind"] == "fp8"]
        if fp8s:
            lines += ["", "FP8 (e4m3) K/V decode vs bf16 K/V decode, GQA 32/8, d=128, bf16 queries, 1 token: "
                      "steps/s (launches per second) and us; TB/s counts the bytes read (FP8: half). err: "
                      "relative L2 vs torch SDPA (math, float32) on the K/V values each computes with; quant: "
                      "the quantization's own effect (SDPA on dequantized vs bf16 K/V).", "",
                      "| batch x cache | splits bf16/fp8 | bf16 steps/s | fp8 steps/s | fp8/bf16 | fp8 page16 steps/s | "
                      "bf16 TB/s | fp8 TB/s | err bf16 | err fp8 | quant | page16 vs contig |",
                      "|---" * 12 + "|"]
            for r in fp8s:
                lines.append(f"| {r['b']} x {r['L'] // 1024}k | {r['splits_bf']}/{r['splits']} | "
                             f"{1e6 / r['bf16_us']:.0f} | {1e6 / r['fp8_us']:.0f} | {r['bf16_us'] / r['fp8_us']:.3f} | "
                             f"{1e6 / r['fp8p_us']:.0f} | {r['bf16_bytes'] / (r['bf16_us'] * 1e-6) / 1e12:.2f} | "
                             f"{r['bf16_bytes'] / 2 / (r['fp8_us'] * 1e-6) / 1e12:.2f} | {r['err_bf']:.1e} | "
                             f"{r['err_f8']:.1e} | {r['err_quant']:.1e} | {r['page_err']:.1e} |")
        # Forced generations measured (libraries with attn_run_gen): g1, g2.
        gens = [g for g in ("g1", "g2")
                if ppages and any(r["kind"] == "prefill" and f"page{ppages[0]}_{g}" in r for r in rows)]
        lines += ["", "Chunked prefill, batch 1, GQA 32/8, bf16, causal (bottom-right): TFLOP/s. contig: "
                  "the forward kernel the plan picks on contiguous K/V (generation 2 on Hopper); pageN: "
                  "the plan's choice on pages of N tokens in shuffled order; pageN g1 / g2: generation 1 "
                  "/ 2 forced. All with the workspace (generation 2's tile counter).", "",
                  "| d | chunk | cached | ours contig | " + " | ".join(f"ours page{ps}" for ps in ppages) +
                  "".join(f" | page{ps} {g}" for ps in ppages for g in gens) + " | " +
                  " | ".join(f"page{ps}/contig" for ps in ppages) +
                  "".join(f" | page{ps} {g}/contig" for ps in ppages for g in gens) +
                  " | torch SDPA (lower-right bias) | torch backend | err vs torch | max err page vs contig |",
                  "|---" * (8 + 2 * len(ppages) * (1 + len(gens))) + "|"]
        for r in rows:
            if r["kind"] != "prefill":
                continue
            perr = max((r[k] for k in r if k.startswith("page") and k.endswith("_err")), default=float("nan"))
            lines.append(f"| {r['D']} | {r['C']} | {r['P'] // 1024}k | {r['contig']:.1f} | " +
                         " | ".join(f"{r[f'page{ps}']:.1f}" for ps in ppages) +
                         "".join(f" | {f2(r.get(f'page{ps}_{g}'))}" for ps in ppages for g in gens) + " | " +
                         " | ".join(r3(r[f'page{ps}'], r['contig']) for ps in ppages) +
                         "".join(f" | {r3(r.get(f'page{ps}_{g}'), r['contig'])}" for ps in ppages for g in gens) +
                         f" | {f2(r['flash'])} | {r['torch_be']} | {r['err']:.1e} | {perr:.1e} |")
        if any(r["kind"] == "steps" for r in rows):
            lines += ["", f"Multi-token steps over paged caches (pages of {args.steps_page}, shuffled), GQA "
                      "32/8, d=128, bf16, causal: us per launch and TB/s of K+V read. decode: Run's choice "
                      "(the split-KV decode kernel for <= 16 queries); gen2: the generation-2 forward "
                      "kernel forced.", "",
                      "| batch x queries x cache | decode us | gen2 us | decode TB/s | gen2 TB/s | gen2/decode speed | err gen2 vs decode |",
                      "|---|---|---|---|---|---|---|"]
            for r in rows:
                if r["kind"] != "steps":
                    continue
                lines.append(f"| {r['b']} x {r['nq']} x {r['L'] // 1024}k | {r['decode_us']:.1f} | "
                             f"{f2(r['gen2_us'])} | {r['decode_tb']:.2f} | {f2(r['gen2_tb'])} | "
                             f"{r3(r['decode_us'], r['gen2_us'])} | {r['err']:.1e} |")
        text = "\n".join(lines) + "\n"
        if final:
            print(text)
        with open(args.out, "w") as fh:
            fh.write(text)

    def fused_point(b, L, splits, qs, ks, vs, o, cu_q, cu_k, ours_o, copies):
        """The combine kernel against the merge in the split kernel at a decode point with splits
        (contiguous, then pages of pages[0]): us of each, timed in alternation, and each one's
        relative error against ours_o (the combine kernel's contiguous result). {} where the point
        has no splits or the library lacks the option."""
        if not args.fused_combine or splits <= 1 or not hasattr(lib, "attn_set_plan_option"):
            return {}
        res = {}
        gen = torch.Generator().manual_seed(b * 13 + L)
        layouts = [("contig", None)]
        if pages:
            layouts.append((f"page{pages[0]}", paged_pools(ks, vs, b, L, pages[0], gen)))
        for name, paged in layouts:
            def call(i, paged=paged):
                if paged is None:
                    run_ours(qs[i], ks[i], vs[i], o, cu_q, cu_k, b, b, b * L, 1, L, False, None)
                else:
                    pk, pv = paged
                    run_ours(qs[i], pk[i][0], pv[i], o, cu_q, None, b, b, 0, 1, L, False, None,
                             (pages[0], pk[i][4], pk[i][1], pk[i][2], pk[i][3]))

            def fused(i, call=call):
                lib.attn_set_plan_option(b"decode_fused_combine", 1)
                try:
                    call(i)
                finally:
                    lib.attn_set_plan_option(b"decode_fused_combine", 0)

            t_comb, t_fused = time_pair_ms(Rotor(call, copies), Rotor(fused, copies), args.warmup,
                                           args.reps, args.min_ms)
            for tag, fn in (("comb", call), ("fused", fused)):
                o.fill_(float("nan"))
                fn(0)
                fn(0)  # twice: the second launch finds the counters the first left
                torch.cuda.synchronize()
                res[f"{name}_{tag}_err"] = ((o.float() - ours_o).norm() / ours_o.norm()).item()
            res[f"{name}_comb_us"] = t_comb * 1e3
            res[f"{name}_fused_us"] = t_fused * 1e3
        torch.cuda.empty_cache()
        return res

    # ---------------- decode ----------------
    for item in args.decode.split(","):
        if not item:
            continue
        b, L = (int(x) for x in item.split("x"))
        kv_bytes = 2 * b * L * HKV * D * 2
        copies = max(1, min(16, math.ceil(4 * l2 / kv_bytes)))
        qs = [torch.randn(b, H, D, device=dev, dtype=dt) for _ in range(copies)]
        ks = [torch.randn(b * L, HKV, D, device=dev, dtype=dt) for _ in range(copies)]
        vs = [torch.randn(b * L, HKV, D, device=dev, dtype=dt) for _ in range(copies)]
        o = torch.full((b, H, D), float("nan"), device=dev, dtype=dt)
        cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
        cu_k = (torch.arange(b + 1, device=dev, dtype=torch.int32) * L).contiguous()
        ws, wsn = workspace(b, b, b * L, 1, L)
        splits = wsn // (b * H * (D + 1) * 4) if wsn else 1
        res = {}
        res["ours"] = time_ms(Rotor(lambda i: run_ours(qs[i], ks[i], vs[i], o, cu_q, cu_k, b, b,
                                                       b * L, 1, L, False, ws), copies),
                              args.warmup, args.reps, args.min_ms)
        run_ours(qs[0], ks[0], vs[0], o, cu_q, cu_k, b, b, b * L, 1, L, False, ws)
        torch.cuda.synchronize()
        ours_o = o.float().clone()
        if hasattr(lib, "attn_plan_decode_splits"):
            splits = lib.attn_plan_decode_splits(2, 0, b, 1, L, H, HKV, D)
        fused = fused_point(b, L, splits, qs, ks, vs, o, cu_q, cu_k, ours_o, copies)
        sweep = {}
        if 10 * b * HKV < 9 * 132 and args.split_sweep and hasattr(lib, "attn_set_plan_option"):
            for sp in [int(x) for x in args.split_sweep.split(",") if x]:
                lib.attn_set_plan_option(b"decode_splits", sp)
                try:
                    t = time_ms(Rotor(lambda i: run_ours(qs[i], ks[i], vs[i], o, cu_q, cu_k, b, b,
                                                         b * L, 1, L, False, None), copies),
                                args.warmup, args.reps, args.min_ms)
                    o.fill_(float("nan"))
                    run_ours(qs[0], ks[0], vs[0], o, cu_q, cu_k, b, b, b * L, 1, L, False, None)
                    torch.cuda.synchronize()
                    sweep[sp] = (t, ((o.float() - ours_o).norm() / ours_o.norm()).item())
                finally:
                    lib.attn_set_plan_option(b"reset", 0)
        # torch [B, H, S, D] views of the same data
        qt = [x.view(b, H, 1, D) for x in qs]
        kt = [x.view(b, L, HKV, D).transpose(1, 2) for x in ks]
        vt = [x.view(b, L, HKV, D).transpose(1, 2) for x in vs]
        ref = None
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    out = F.scaled_dot_product_attention(qt[0], kt[0], vt[0], enable_gqa=True)
                    if ref is None:
                        ref = out.view(b, H, D).float()
                    res[name] = time_ms(Rotor(lambda i: F.scaled_dot_product_attention(
                        qt[i], kt[i], vt[i], enable_gqa=True), copies), args.warmup, args.reps,
                        args.min_ms)
            except Exception as e:  # backend not available for this shape
                print(f"# {name} failed for {b}x{L}: {e}", file=sys.stderr)
                res[name] = None
        err = ((ours_o - ref).norm() / ref.norm()).item() if ref is not None else float("nan")
        gen_p = torch.Generator().manual_seed(b * 7 + L)
        for ps in pages:
            pk, pv = paged_pools(ks, vs, b, L, ps, gen_p)
            wsp, _ = workspace(b, b, 0, 1, L, ps, pk[0][4])

            def paged_call(i, ps=ps, pk=pk, pv=pv, wsp=wsp):
                run_ours(qs[i], pk[i][0], pv[i], o, cu_q, None, b, b, 0, 1, L, False, wsp,
                         (ps, pk[i][4], pk[i][1], pk[i][2], pk[i][3]))

            res[f"page{ps}"] = time_ms(Rotor(paged_call, copies), args.warmup, args.reps, args.min_ms)
            o.fill_(float("nan"))
            paged_call(0)
            torch.cuda.synchronize()
            perr = ((o.float() - ours_o).norm() / ours_o.norm()).item()
            res[f"page{ps}_err"] = perr
            del pk, pv
            torch.cuda.empty_cache()
        tb = lambda t: kv_bytes / (t * 1e-3) / 1e12 if t else None
        row = dict(kind="decode", b=b, L=L, splits=splits, copies=copies, err=err, sweep=sweep, fused=fused,
                   **{k2: (tb(v2) if not k2.endswith("_err") else v2) for k2, v2 in res.items()},
                   us={k2: v2 * 1e3 for k2, v2 in res.items() if not k2.endswith("_err") and v2})
        rows.append(row)
        f = lambda x: f"{x:.2f}" if x is not None else "n/a"
        print(f"decode {b}x{L}: splits {splits} ours {f(row['ours'])} TB/s "
              + " ".join(f"page{ps} {f(row[f'page{ps}'])}" for ps in pages)
              + f" flash {f(row.get('flash'))} cudnn {f(row.get('cudnn'))} err {err:.1e}",
              flush=True)
        del qs, ks, vs, qt, kt, vt, o, ref
        torch.cuda.empty_cache()

    write_table(False)

    # ---------------- FP8 K/V decode ----------------
    for item in [x for x in args.fp8.split(",") if x]:
        b, L = (int(x) for x in item.split("x"))
        rows.append(fp8_point(lib, b, L, args, dev, dt, l2))

    write_table(False)

    # ---------------- chunked prefill ----------------
    for D in pdims:
        for item in items:
            C, Pc = (int(x) for x in item.split("x"))
            rows.append(prefill_point(lib, C, Pc, D, ppages, args, gen, dev, dt))
            torch.cuda.empty_cache()

    write_table(False)

    # ---------------- multi-token steps ----------------
    for item in [x for x in args.steps.split(",") if x]:
        b, nq, L = (int(x) for x in item.split("x"))
        rows.append(steps_point(lib, b, nq, L, args.steps_page, args, gen, dev, dt))
        torch.cuda.empty_cache()
    write_table(True)



if __name__ == "__main__":
    main()
