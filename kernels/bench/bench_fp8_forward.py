#!/usr/bin/env python3
"""attnd's FP8 forward path (e4m3 inputs converted to 16 bits in the workspace, then the 16-bit
forward kernel) beside the bf16 forward kernel on the same shapes, in one run.

Usage: python3 bench_fp8_forward.py --lib path/to/libattn_kernels_capi.so --out table.md

FP8-KV paged prefill: batch 1, GQA 32/8, d=128, a chunk of C queries over P cached keys plus the
  chunk (causal, bottom-right aligned), K/V in page pools of --pages tokens in shuffled order.
  bf16: the bf16 pools (the plan's kernel); FP8: the e4m3 codes of the same values (one scale per
  (sequence, KV head), amax / 448) and the plan's path (conversion + the 16-bit forward kernel).
FP8 Attend: q, k and v in e4m3 (scales per (sequence, KV head)), MHA with 2048 / d heads, batch
  16384 / s sequences of s queries and s keys, non-causal; FP8 is DequantizeFp8Q of q, then the FP8
  K/V run, both timed; bf16: generation 2 forced on the bf16 values.
TFLOP/s with FLOPs 4 * H * D * (keys each query sees). err: relative L2 against a float32
  reference (torch SDPA) on the values each one computes with (bf16: the bf16 inputs; FP8: the
  dequantized codes), for sequence 0.
The conversion path computes in 16 bits (no FP8 tensor-core math), so its FP8 / bf16 is expected a
little under 1.0. FP8 Attend also runs the FP8 tensor-core kernel (attn_run_fp8_attention: e4m3
wgmma for both products, V transposed first, both timed) and torch SDPA's cuDNN backend, bf16 and,
where this torch accepts float8_e4m3fn inputs, FP8; where it does not, cuDNN's FP8 SDPA through
cuDNN's Python frontend (the `cudnn` module) where the host has it.
Times: CUDA events around N back-to-back launches (>= --min-ms), median of --reps.
"""
import argparse
import ctypes
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import time_ms, warm_up_clocks  # noqa: E402

P = ctypes.c_void_p
I = ctypes.c_int
BF16 = 2


def load(path):
    lib = ctypes.CDLL(path)
    run_args = [I] + [P] * 7 + [I] * 8 + [ctypes.c_float, I, I, I, I, I, P, P, P]
    lib.attn_run_gen.restype = I
    lib.attn_run_gen.argtypes = run_args + [P, ctypes.c_size_t, I]
    lib.attn_run_fp8kv_gen.restype = I
    lib.attn_run_fp8kv_gen.argtypes = run_args + [P, P, P, ctypes.c_size_t, I]
    lib.attn_run_fp8_attention.restype = I
    lib.attn_run_fp8_attention.argtypes = ([I] + [P] * 7 + [I] * 8 + [ctypes.c_float, I, I, I] +
                                           [P] * 4 + [ctypes.c_size_t])
    lib.attn_set_plan_option.restype = I
    lib.attn_set_plan_option.argtypes = [ctypes.c_char_p, I]
    lib.attn_dequantize_fp8_q.restype = I
    lib.attn_dequantize_fp8_q.argtypes = [I, P, P, P, P, I, I, I, I, I, ctypes.c_size_t]
    return lib


def ptr(t):
    return t.data_ptr() if t is not None else None


class Shape:
    def __init__(self, b, sq, sk, h, hkv, d, causal):
        self.b, self.sq, self.sk, self.h, self.hkv, self.d, self.causal = b, sq, sk, h, hkv, d, causal
        dev = torch.device("cuda")
        self.cu_q = (torch.arange(b + 1, device=dev, dtype=torch.int32) * sq).contiguous()
        self.cu_k = (torch.arange(b + 1, device=dev, dtype=torch.int32) * sk).contiguous()

    def flops(self):
        seen = self.sq * self.sk
        if self.causal:
            p = self.sk - self.sq
            seen = sum(min(self.sk, i + p + 1) for i in range(self.sq))
        return 4.0 * self.b * self.h * self.d * seen


def run_bf16(lib, s, q, k, v, o, stream, paged=None, gen=0):
    ps, npg, indptr, indices, seqlens = paged if paged else (0, 0, None, None, None)
    rc = lib.attn_run_gen(BF16, ptr(q), ptr(k), ptr(v), ptr(o), None, ptr(s.cu_q),
                          None if paged else ptr(s.cu_k), s.b, s.b * s.sq, 0 if paged else s.b * s.sk,
                          s.sq, s.sk, s.h, s.hkv, s.d, 0.0, int(s.causal), -1, -1, ps, npg,
                          ptr(indptr), ptr(indices), ptr(seqlens), None, stream, gen)
    if rc != 0:
        raise RuntimeError(f"attn_run_gen returned {rc}")


def run_fp8(lib, s, q, k, v, o, ks, vs, stream, paged=None, gen=0):
    ps, npg, indptr, indices, seqlens = paged if paged else (0, 0, None, None, None)
    rc = lib.attn_run_fp8kv_gen(BF16, ptr(q), ptr(k), ptr(v), ptr(o), None, ptr(s.cu_q),
                                None if paged else ptr(s.cu_k), s.b, s.b * s.sq,
                                0 if paged else s.b * s.sk, s.sq, s.sk, s.h, s.hkv, s.d, 0.0,
                                int(s.causal), -1, -1, ps, npg, ptr(indptr), ptr(indices),
                                ptr(seqlens), ptr(ks), ptr(vs), None, stream, gen)
    if rc != 0:
        raise RuntimeError(f"attn_run_fp8kv_gen returned {rc}")


def run_fp8_tc(lib, s, qc, kc, vc, o, qs, ks, vs, stream):
    rc = lib.attn_run_fp8_attention(BF16, ptr(qc), ptr(kc), ptr(vc), ptr(o), None, ptr(s.cu_q),
                                    ptr(s.cu_k), s.b, s.b * s.sq, s.b * s.sk, s.sq, s.sk, s.h, s.hkv,
                                    s.d, 0.0, int(s.causal), -1, -1, ptr(qs), ptr(ks), ptr(vs), None,
                                    stream)
    if rc != 0:
        raise RuntimeError(f"attn_run_fp8_attention returned {rc}")


def sdpa_cudnn(q, k, v, s, fp8):
    """torch SDPA on the cuDNN backend over the batch ([b, h, s, d] views), bf16 or, where this
    torch takes them, float8_e4m3fn inputs; None when the backend refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    def view(x):
        return x.view(s.b, s.sq, s.h, s.d).transpose(1, 2)
    qt, kt, vt = view(q), view(k), view(v)
    if fp8:
        qt, kt, vt = (x.to(torch.float8_e4m3fn) for x in (qt, kt, vt))
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=s.causal)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        print(f"torch SDPA cuDNN ({'fp8' if fp8 else 'bf16'}) refused: {str(e).splitlines()[0][:200]}",
              flush=True)
        return None
    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=s.causal)
    return call


def cudnn_frontend_fp8(q, k, v, s):
    """cuDNN's FP8 SDPA forward through cuDNN's Python frontend (the `cudnn` module), where this
    host has it: q, k, v quantized per tensor (amax / 448, the descales the graph takes), P scaled
    by 448 before its e4m3 rounding (descale 1/448 after P V), O written in e4m3 with unit scale
    (the output type Hopper's engine writes). Returns (call, o, the values its codes stand for)
    with o and the values [b*s, h, d], or (None, why, None)."""
    try:
        import cudnn
    except ImportError as e:
        return None, f"no cudnn frontend module ({e})", None
    try:
        dev = q.device
        f32 = cudnn.data_type.FLOAT
        e4m3 = cudnn.data_type.FP8_E4M3
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

        def per_tensor(x):  # quantize's scale groups made one: the whole tensor
            codes, scale, values = quantize(x, 1, x.shape[0], 1)
            return codes.view(torch.float8_e4m3fn), scale.reshape(1, 1, 1, 1), values

        (qc, dq, qv), (kc, dk, kv), (vc, dv, vv) = per_tensor(q), per_tensor(k), per_tensor(v)
        o8 = torch.empty_like(qc)
        one = lambda x: torch.full((1, 1, 1, 1), x, device=dev, dtype=torch.float32)  # noqa: E731
        scalars = {"dq": dq, "dk": dk, "dv": dv, "ds": one(1.0 / 448.0), "ss": one(448.0),
                   "so": one(1.0)}
        amax_s, amax_o = one(0.0), one(0.0)
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32,
                              compute_data_type=f32, handle=handle)
        dims = (s.b, s.h, s.sq, s.d)
        strides = (s.sq * s.h * s.d, s.d, s.h * s.d, 1)  # [b, s, h, d] in memory
        tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3)
                      for n in ("q", "k", "v"))
        ts = {n: graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
              for n in scalars}
        to, _, tas, tao = graph.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=ts["dq"], descale_k=ts["dk"],
                                         descale_v=ts["dv"], descale_s=ts["ds"], scale_s=ts["ss"],
                                         scale_o=ts["so"], is_inference=True,
                                         attn_scale=1.0 / math.sqrt(s.d), use_causal_mask=s.causal)
        to.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        for t in (tas, tao):
            t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        workspace = torch.empty(max(1, graph.get_workspace_size()), device=dev, dtype=torch.uint8)
        pack = {tq: qc, tk: kc, tv: vc, to: o8, tas: amax_s, tao: amax_o}
        pack.update({ts[n]: x for n, x in scalars.items()})

        def call():
            graph.execute(pack, workspace, handle=handle)

        call()
        torch.cuda.synchronize()
        return call, o8, (qv, kv, vv)
    except Exception as e:  # an engine missing for this shape, or an older frontend's API
        return None, f"cudnn frontend: {type(e).__name__}: {e}", None


def dequantize_q(lib, s, q_codes, q_scale, q_out, stream):
    rc = lib.attn_dequantize_fp8_q(BF16, ptr(q_codes), ptr(q_scale), ptr(q_out), ptr(s.cu_q), s.b,
                                   s.b * s.sq, s.h, s.hkv, s.d, stream)
    if rc != 0:
        raise RuntimeError(f"attn_dequantize_fp8_q returned {rc}")


def quantize(x, b, rows, heads):
    """x [b*rows, heads*g, d] -> (uint8 codes, float32 scales [b, heads]) with one scale per
    (sequence, head group) of amax / 448, and the float32 values the codes stand for."""
    xs = x.float().reshape(b, rows, heads, -1)
    amax = xs.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    c = (xs / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    deq = c.float() * scale[:, None, :, None]
    return (c.view(torch.uint8).reshape(x.shape).contiguous(), scale.contiguous(),
            deq.reshape(x.shape))


def pool_of(x, ps, perm, fill):
    """x [L, Hkv, D] as a page pool of ps-token pages placed by perm (the last page padded)."""
    L = x.shape[0]
    npg = perm.numel()
    xp = torch.full((npg * ps,) + tuple(x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    xp[:L] = x
    pool = torch.empty((npg, ps) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    pool[perm] = xp.view(pool.shape)
    return pool


def reference(s, q, k, v):
    """float32 attention of sequence 0 (bottom-right causal when s.causal), [sq, h, d]."""
    g = s.h // s.hkv
    qt = q[:s.sq].float().transpose(0, 1)
    kt = k[:s.sk].float().repeat_interleave(g, dim=1).transpose(0, 1)
    vt = v[:s.sk].float().repeat_interleave(g, dim=1).transpose(0, 1)
    mask = None
    if s.causal:
        i = torch.arange(s.sq, device=q.device)[:, None]
        j = torch.arange(s.sk, device=q.device)[None, :]
        mask = j <= i + (s.sk - s.sq)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(0, 1)


def rel_err(o, ref, s):
    got = o[:s.sq].float()
    return ((got - ref).norm() / ref.norm()).item()


def timed_and_checked(call, o, ref, s, args, poisoned=()):
    """call's time (time_ms), then one more call on NaN-poisoned o (and `poisoned`) and the
    relative error of o against ref."""
    t = time_ms(call, args.warmup, args.reps, args.min_ms)
    for x in (o, *poisoned):
        x.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    return t, rel_err(o, ref, s)


def prefill_point(lib, C, Pc, ps, args, dev):
    stream = torch.cuda.current_stream().cuda_stream
    s = Shape(1, C, Pc + C, 32, 8, 128, True)
    L = s.sk
    q = torch.randn(C, s.h, s.d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(L, s.hkv, s.d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(L, s.hkv, s.d, device=dev, dtype=torch.bfloat16)
    kc, ks, kd = quantize(k, 1, L, s.hkv)
    vc, vs, vd = quantize(v, 1, L, s.hkv)
    npg = (L + ps - 1) // ps
    perm = torch.randperm(npg, device=dev)
    paged = (ps, npg, torch.tensor([0, npg], device=dev, dtype=torch.int32),
             perm.to(torch.int32).contiguous(), torch.tensor([L], device=dev, dtype=torch.int32))
    pk, pv = pool_of(k, ps, perm, float("nan")), pool_of(v, ps, perm, float("nan"))
    pkc, pvc = pool_of(kc, ps, perm, 0x7F), pool_of(vc, ps, perm, 0x7F)
    o = torch.full_like(q, float("nan"))
    warm_up_clocks(dev)
    t_bf, err_bf = timed_and_checked(lambda: run_bf16(lib, s, q, pk, pv, o, stream, paged), o,
                                     reference(s, q, k, v), s, args)
    ref_f8 = reference(s, q, kd, vd)
    fp8_call = lambda: run_fp8(lib, s, q, pkc, pvc, o, ks, vs, stream, paged)  # noqa: E731
    t_f8, err_f8 = timed_and_checked(fp8_call, o, ref_f8, s, args)
    # The same call planned onto the FP8 tensor cores (q quantized on the device, pages gathered):
    # with the plan's tile rows, then with 192-row tiles forced (the rule's alternative at d=128).
    lib.attn_set_plan_option(b"fp8_tensor_cores", 1)
    try:
        t_tc, err_tc = timed_and_checked(fp8_call, o, ref_f8, s, args)
        lib.attn_set_plan_option(b"fp8_tile_rows", 192)
        t_wide, err_wide = timed_and_checked(fp8_call, o, ref_f8, s, args)
    finally:
        lib.attn_set_plan_option(b"fp8_tile_rows", 0)
        lib.attn_set_plan_option(b"fp8_tensor_cores", 0)
    tf = lambda t: s.flops() / (t * 1e-3) / 1e12
    row = dict(kind="prefill", C=C, P=Pc, ps=ps, bf=tf(t_bf), f8=tf(t_f8), tc=tf(t_tc),
               wide=tf(t_wide), bf_us=t_bf * 1e3, f8_us=t_f8 * 1e3, tc_us=t_tc * 1e3,
               err_bf=err_bf, err_f8=err_f8, err_tc=max(err_tc, err_wide))
    print(f"prefill chunk {C} over {Pc}, pages {ps}: bf16 {row['bf']:.1f} TFLOP/s, fp8-kv "
          f"conversion {row['f8']:.1f} (x{row['f8'] / row['bf']:.3f}), tensor cores "
          f"{row['tc']:.1f} (x{row['tc'] / row['bf']:.3f}; 192-row tiles {row['wide']:.1f}), "
          f"err {err_bf:.1e} / {err_f8:.1e} / {row['err_tc']:.1e}", flush=True)
    return row


def attend_point(lib, d, sl, args, dev):
    stream = torch.cuda.current_stream().cuda_stream
    b = max(1, 16384 // sl)
    h = 2048 // d
    s = Shape(b, sl, sl, h, h, d, False)
    q = torch.randn(b * sl, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b * sl, h, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b * sl, h, d, device=dev, dtype=torch.bfloat16)
    qc, qs, qd = quantize(q, b, sl, h)
    kc, ks, kd = quantize(k, b, sl, h)
    vc, vs, vd = quantize(v, b, sl, h)
    q16 = torch.empty_like(q)  # where the FP8 path widens q
    o = torch.full_like(q, float("nan"))
    warm_up_clocks(dev)
    t_bf, err_bf = timed_and_checked(lambda: run_bf16(lib, s, q, k, v, o, stream, gen=2), o,
                                     reference(s, q, k, v), s, args)

    def fp8_call():
        dequantize_q(lib, s, qc, qs, q16, stream)
        run_fp8(lib, s, q16, kc, vc, o, ks, vs, stream)

    ref_f8 = reference(s, qd, kd, vd)
    t_f8, err_f8 = timed_and_checked(fp8_call, o, ref_f8, s, args, poisoned=(q16,))
    # The FP8 tensor-core kernel on the same codes (P rounded to e4m3 inside it).
    t_tc, err_tc = timed_and_checked(lambda: run_fp8_tc(lib, s, qc, kc, vc, o, qs, ks, vs, stream),
                                     o, ref_f8, s, args)
    cudnn = {}
    for name, fp8 in (("cudnn_bf", False), ("cudnn_f8", True)):
        call = sdpa_cudnn(q, k, v, s, fp8)
        cudnn[name] = time_ms(call, args.warmup, args.reps, args.min_ms) if call else None
    # Where torch's SDPA takes no float8 inputs: cuDNN's FP8 SDPA through its own frontend, its
    # output checked against float32 SDPA on the values of its per-tensor codes.
    f8_via, err_cudnn_f8 = ("torch SDPA" if cudnn["cudnn_f8"] else None), None
    if cudnn["cudnn_f8"] is None:
        call, o8, values = cudnn_frontend_fp8(q, k, v, s)
        if call is None:
            print(f"cuDNN FP8 not reached: {o8}", flush=True)
        else:
            cudnn["cudnn_f8"] = time_ms(call, args.warmup, args.reps, args.min_ms)
            f8_via = "cudnn frontend"
            o8.view(torch.uint8).fill_(0x7F)  # NaN in e4m3
            call()
            torch.cuda.synchronize()
            err_cudnn_f8 = rel_err(o8, reference(s, *values), s)
    tf = lambda t: s.flops() / (t * 1e-3) / 1e12 if t else None
    row = dict(kind="attend", d=d, s=sl, b=b, h=h, bf=tf(t_bf), f8=tf(t_f8), tc=tf(t_tc),
               cudnn_bf=tf(cudnn["cudnn_bf"]), cudnn_f8=tf(cudnn["cudnn_f8"]), bf_us=t_bf * 1e3,
               f8_us=t_f8 * 1e3, tc_us=t_tc * 1e3, err_bf=err_bf, err_f8=err_f8, err_tc=err_tc,
               f8_via=f8_via, err_cudnn_f8=err_cudnn_f8)
    print(f"attend d={d} s={sl} ({b} x {h} heads): bf16 gen2 {row['bf']:.1f} TFLOP/s, fp8 via "
          f"conversion {row['f8']:.1f}, fp8 tensor cores {row['tc']:.1f} (x{row['tc'] / row['bf']:.3f} "
          f"bf16), cuDNN bf16 {fmt(row['cudnn_bf'])}, cuDNN fp8 {fmt(row['cudnn_f8'])}; err "
          f"{err_bf:.1e} / {err_f8:.1e} / {err_tc:.1e}", flush=True)
    return row


def fmt(x):
    return "n/a" if x is None else f"{x:.1f}"


def write_table(rows, out, final):
    lines = [f"# FP8 forward vs bf16 ({torch.cuda.get_device_name(0)}, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", ""]
    pre = [r for r in rows if r["kind"] == "prefill"]
    if pre:
        lines += ["## FP8-KV paged prefill (batch 1, GQA 32/8, d=128, causal)", "",
                  "conv: the conversion path; TC: planned with fp8_tensor_cores (q quantized on the "
                  "device, pages gathered, the FP8 tensor-core kernel on the plan's query tiles); "
                  "TC 192: the same with 192-row tiles forced (fp8_tile_rows); each timed whole. "
                  "err TC: the larger of the two.", "",
                  "| chunk | cached | page | bf16 TFLOP/s | conv TFLOP/s | conv/bf16 | TC TFLOP/s | "
                  "TC/bf16 | TC 192 TFLOP/s | TC/TC 192 | bf16 us | conv us | TC us | err bf16 | "
                  "err conv | err TC |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in pre:
            lines.append(f"| {r['C']} | {r['P']} | {r['ps']} | {r['bf']:.1f} | {r['f8']:.1f} | "
                         f"{r['f8'] / r['bf']:.3f} | {r['tc']:.1f} | {r['tc'] / r['bf']:.3f} | "
                         f"{r['wide']:.1f} | {r['tc'] / r['wide']:.3f} | "
                         f"{r['bf_us']:.1f} | {r['f8_us']:.1f} | {r['tc_us']:.1f} | "
                         f"{r['err_bf']:.1e} | {r['err_f8']:.1e} | {r['err_tc']:.1e} |")
        lines.append("")
    att = [r for r in rows if r["kind"] == "attend"]
    if att:
        lines += ["## FP8 Attend (q, k, v e4m3; MHA, 16k tokens, non-causal) vs bf16 generation 2",
                  "",
                  "conv: the conversion path (16-bit kernel); TC: the FP8 tensor-core kernel; cuDNN: "
                  "torch SDPA's cuDNN backend on the bf16 values and, FP8, where this torch takes "
                  "float8_e4m3fn inputs, on the codes, else cuDNN's FP8 SDPA through its Python "
                  "frontend (per-tensor scales, O in e4m3; 'via' says which; n/a: neither). err: "
                  "relative L2 vs float32 SDPA on the values each computes with.", "",
                  "| d | s | batch x heads | bf16 gen2 TFLOP/s | conv TFLOP/s | TC TFLOP/s | TC/bf16 | "
                  "cuDNN bf16 | cuDNN fp8 | via | TC/cuDNN fp8 | TC us | err bf16 | err conv | "
                  "err TC | err cuDNN fp8 |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in att:
            ratio = f"{r['tc'] / r['cudnn_f8']:.3f}" if r["cudnn_f8"] else "n/a"
            lines.append(f"| {r['d']} | {r['s']} | {r['b']} x {r['h']} | {r['bf']:.1f} | "
                         f"{r['f8']:.1f} | {r['tc']:.1f} | {r['tc'] / r['bf']:.3f} | "
                         f"{fmt(r['cudnn_bf'])} | {fmt(r['cudnn_f8'])} | {r['f8_via'] or 'n/a'} | "
                         f"{ratio} | {r['tc_us']:.1f} | {r['err_bf']:.1e} | {r['err_f8']:.1e} | "
                         f"{r['err_tc']:.1e} | "
                         f"{'n/a' if r['err_cudnn_f8'] is None else format(r['err_cudnn_f8'], '.1e')} |")
        lines.append("")
    text = "\n".join(lines)
    with open(out, "w") as f:
        f.write(text + "\n")
    if final:
        print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefill", default="512x4096,2048x4096", help="CHUNKxCACHED list")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--attend", default="128x4096,128x8192,256x4096,256x8192", help="DxS list")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--min-ms", type=float, default=10.0)
    args = ap.parse_args()
    lib = load(args.lib)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for item in [x for x in args.prefill.split(",") if x]:
        C, Pc = (int(x) for x in item.split("x"))
        for ps in [int(x) for x in args.pages.split(",") if x]:
            rows.append(prefill_point(lib, C, Pc, ps, args, dev))
            write_table(rows, args.out, False)
    for item in [x for x in args.attend.split(",") if x]:
        d, sl = (int(x) for x in item.split("x"))
        rows.append(attend_point(lib, d, sl, args, dev))
        write_table(rows, args.out, False)
        torch.cuda.empty_cache()
    write_table(rows, args.out, True)


if __name__ == "__main__":
    main()
