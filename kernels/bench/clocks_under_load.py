#!/usr/bin/env python3
"""Rate, SM clock and board power of each forward kernel under sustained load.

Usage: python3 clocks_under_load.py --lib gen2=libattn_kernels_capi.so@2 [--seconds 2]
                                    [--shapes 128:16384:0,64:16384:0] [--backends cudnn,flash]
                                    [--out table.md]
(the --lib syntax is bench_vs_torch.py's; torch's cuDNN and flash backends run alongside). Each
kernel runs back to back for --seconds after a warm-up of the same length while nvidia-smi samples
the SM clock and power every 50 ms; the table gives TFLOP/s over the timed window, the median
clock and power, and TFLOP/s per GHz, the rate with the clock taken out. A kernel that draws more
power runs at a lower clock under the board's power limit: its ratio to another at equal clocks is
the per-GHz ratio.
"""
import argparse
import datetime
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_vs_torch import dtype_of, load_libs, packed_inputs, run_ours, sweep_shape, write_text


def sampled(fn, seconds):
    """Runs fn back to back for `seconds`; returns (calls per second, median MHz, median W)."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)  # nvidia-smi's first sample
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    calls = 0
    a.record()
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(8):
            fn()
        calls += 8
        torch.cuda.synchronize()  # keeps the host from queueing far past the window
    b.record()
    b.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    mhz, watts = [], []
    for line in out.splitlines():
        try:
            c, w = (float(x) for x in line.split(","))
        except ValueError:
            continue
        mhz.append(c)
        watts.append(w)
    return calls / (a.elapsed_time(b) / 1e3), statistics.median(mhz), statistics.median(watts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--shapes", default="64:16384:0,128:16384:0,256:16384:0,128:4096:1,64:4096:1")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--backends", default="cudnn,flash", help="torch SDPA backends run alongside")
    ap.add_argument("--out")
    args = ap.parse_args()
    libs = load_libs(args.lib)
    dtype, dcode = dtype_of(args.dtype)
    dev = torch.device("cuda")
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}, "
             f"{args.dtype}, B*S = {args.tokens}, H*D = 2048; {args.seconds} s of back-to-back calls per "
             "kernel after as long a warm-up; clock and power: medians of nvidia-smi samples every 50 ms.",
             "", "| d | s | causal | kernel | TFLOP/s | SM MHz | W | TFLOP/s per GHz |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        d, s, causal, h, b = sweep_shape(shape, args.tokens)
        q, k, v, cu, (qt, kt, vt) = packed_inputs(b, s, h, d, dtype, dev)
        o = torch.empty_like(q)
        stream = torch.cuda.current_stream().cuda_stream
        flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
        kernels = []
        for name, fn in libs:
            def ours(fn=fn):
                run_ours(fn, dcode, q, k, v, o, cu, b, s, h, d, causal, stream)
            kernels.append((name, ours, None))
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            if name not in args.backends.split(","):
                continue
            kernels.append((name, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal)), be))
        for name, fn, be in kernels:
            if be is not None:
                ctx = sdpa_kernel(be)
                ctx.__enter__()
            sampled(fn, args.seconds)  # warm-up: the clock settles under the power limit
            rate, mhz, watts = sampled(fn, args.seconds)
            if be is not None:
                ctx.__exit__(None, None, None)
            tf = rate * flops / 1e12
            lines.append(f"| {d} | {s} | {causal} | {name} | {tf:.0f} | {mhz:.0f} | {watts:.0f} | "
                         f"{tf / (mhz / 1e3):.0f} |")
            print(lines[-1], flush=True)
    write_text("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
