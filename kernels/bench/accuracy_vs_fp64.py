#!/usr/bin/env python3
"""Error of each forward kernel against a float64 reference computed on the GPU.

Usage: python3 accuracy_vs_fp64.py --lib gen1=libattn_kernels_capi.so@1,gen2=libattn_kernels_capi.so@2
                                   [--dims 64,128,256] [--s 1024] [--out table.md]
(the --lib syntax is bench_vs_torch.py's). For each dtype, head dim and causal flag, on fresh
N(0, 1) inputs (B*S = --tokens, H*D = 2048): the relative Frobenius error and the largest absolute
error of each library variant and of torch's flash and cuDNN backends against float64 attention
of the same (rounded) inputs; then, for every variant after the first, the share of output
elements that differ from the first's and the mean |difference| per output column class (column
mod 8), which shows a layout-bound error as one class standing out.
"""
import argparse
import datetime

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_vs_torch import dtype_of, load_libs, packed_inputs, run_ours, write_text


def reference(qt, kt, vt, causal):
    """float64 attention of [B, H, S, D] views."""
    q, k, v = (x.double() for x in (qt, kt, vt))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def errors(out, ref):
    d = (out.double() - ref).abs()
    return (d.norm() / ref.norm()).item(), d.max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args()
    libs = load_libs(args.lib)
    dev = torch.device("cuda")
    torch.manual_seed(1)
    names = [n for n, _ in libs] + ["flash", "cudnn"]
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{datetime.date.today()}, s = {args.s}, B*S = {args.tokens}, H*D = 2048, N(0, 1) "
             "inputs; errors against float64 attention of the same rounded inputs.", "",
             "| dtype | causal | d | " + " | ".join(f"{n} rel | {n} max" for n in names) + " |",
             "|---|---|---|" + "---|---|" * len(names)]
    diff_lines = []
    s = args.s
    b = max(1, args.tokens // s)
    for dname in args.dtypes.split(","):
        dtype, dcode = dtype_of(dname)
        for causal in [bool(int(x)) for x in args.causal.split(",")]:
            for d in [int(x) for x in args.dims.split(",")]:
                h = 2048 // d
                q, k, v, cu, (qt, kt, vt) = packed_inputs(b, s, h, d, dtype, dev)
                ref = reference(qt, kt, vt, causal).transpose(1, 2).reshape(b * s, h, d)
                outs = {}
                for name, fn in libs:
                    o = torch.full_like(q, float("nan"))
                    run_ours(fn, dcode, q, k, v, o, cu, b, s, h, d, causal,
                             torch.cuda.current_stream().cuda_stream)
                    torch.cuda.synchronize()
                    outs[name] = o
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                                 ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel(be):
                        outs[name] = F.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=causal).transpose(1, 2).reshape(b * s, h, d)
                cells = []
                for n in names:
                    rel, mx = errors(outs[n], ref)
                    cells.append(f"{rel:.2e} | {mx:.2e}")
                lines.append(f"| {dname} | {int(causal)} | {d} | " + " | ".join(cells) + " |")
                first = libs[0][0]
                for n, _ in libs[1:]:
                    diff = (outs[n].float() - outs[first].float()).abs()
                    share = (diff > 0).float().mean().item()
                    per_class = diff.view(-1, d // 8, 8).mean(dim=(0, 1))
                    diff_lines.append(f"| {dname} | {int(causal)} | {d} | {n} vs {first} | {share:.3f} | "
                                      + " ".join(f"{x:.1e}" for x in per_class.tolist()) + " |")
    lines += ["", "| dtype | causal | d | pair | share of elements differing | "
              "mean abs difference by column mod 8 |", "|---|---|---|---|---|---|"] + diff_lines
    write_text("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
