#!/usr/bin/env python3
"""Calls each forward kernel once per shape, for Nsight Compute to count its memory traffic.

Usage: ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
           -k 'regex:FlashFwdSm90|cudnn|fmha|flash' --csv --page raw \
           python3 memory_traffic.py --lib gen2=./libattn_kernels_capi.so@2 [--shapes 128:1024:1]
(the --lib syntax is bench_vs_torch.py's). Prints, before the profiled calls, the order in which
the kernels run: per shape each --lib variant, then torch's cuDNN backend, each called twice (the
second call is the one to read: the first may include one-time work).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_vs_torch import dtype_of, load_libs, packed_inputs, run_ours, sweep_shape


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--shapes", default="128:1024:1,128:2048:1")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    libs = load_libs(args.lib)
    dtype, dcode = dtype_of(args.dtype)
    dev = torch.device("cuda")
    order = []
    calls = []
    for shape in args.shapes.split(","):
        d, s, causal, h, b = sweep_shape(shape, args.tokens)
        q, k, v, cu, (qt, kt, vt) = packed_inputs(b, s, h, d, dtype, dev)
        o = torch.empty_like(q)
        stream = torch.cuda.current_stream().cuda_stream
        for name, fn in libs:
            order.append(f"{d}:{s}:{causal} {name}")
            calls.append(lambda fn=fn, a=(q, k, v, o, cu, b, s, h, d, causal, stream):
                         run_ours(fn, dcode, *a))

        def cudnn(qt=qt, kt=kt, vt=vt, causal=causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
        order.append(f"{d}:{s}:{causal} cudnn")
        calls.append(cudnn)
    print("order: " + "; ".join(order), flush=True)
    for fn in calls:
        fn()
        fn()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
