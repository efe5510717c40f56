#!/usr/bin/env python3
"""Where the Python client's time goes in a decode BatchStep over shared-memory regions: one step
of --batch sessions (default 32; 32/8 heads, d=128, bf16, one new token each), q, k_new, v_new
and o slices of a registered region, as examples/remote_decoder.py's attention layers send it.

Parts, microseconds per call (p50 and mean over --calls calls, in --rounds rounds alternating the
two ways):

  ordinary   what Client.batch_step does each call: the items (region rows sliced out of the
             batch's tensors, as attnd.torch did), coding the request, the CUDA stream
             synchronization (GPU regions), grpcio's call, reading the answer
  prepared   Client.prepare_batch_step once, then per call: the message of the layer, the
             synchronization, grpcio's call, the one-pass check of the answer
  e2e        the whole call as a user makes it (batch_step with its items / prepared.step)
  torch      attnd.torch.RemoteKVCache.step of one layer over the region (copies of q, k, v
             into it, the step, o as a view): transport "shm" (host region) or "cuda-ipc", its
             requests prepared per shape (the default) or coded per call (prepare_batches=False)

grpcio's call includes attnd's work; the table gives the server's own total_us of item 0 (its
ServerTiming) beside it, what the call took beyond it (transport, attnd's decoding and encoding),
and an Echo of the same request and answer sizes (grpcio's own floor on this host). "client" is
the Python time of a call but grpcio's: the target for a prepared 32-step call is <= 50 us. The sessions are kept between --cache and --cache + --window tokens (truncated back,
not timed).

    bench/python_batch_regions_bench.py --target 127.0.0.1:50051 --region host      # any backend
    bench/python_batch_regions_bench.py --target 127.0.0.1:50051 --region cuda      # CUDA backend

attnd must run on this host with --allow_shared_memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

if not any(Path(p, "attnd", "__init__.py").is_file() for p in sys.path if p):  # else $PYTHONPATH's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
import attnd  # noqa: E402
from attnd import _core  # noqa: E402
from python_parts import Parts, add_batch_shape_args  # noqa: E402  (beside this file)

try:
    import torch
except ImportError:  # numpy arrays in a host region, and no torch rows
    torch = None


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.client = attnd.Client(args.target, timeout=120)
        self.cuda = args.region == "cuda"
        b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
        self.use_torch = torch is not None and (self.cuda or args.lib == "torch")
        if self.cuda:
            self.region = attnd.CudaRegion(64 << 20, 0)
        else:
            self.region = attnd.HostRegion(64 << 20)
        self.client.register_region(self.region)
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
        if self.use_torch:
            tdt = getattr(torch, dtype)
            make = lambda shape: self.region.tensor(shape, tdt)  # noqa: E731
        else:
            npdt = np.uint16 if args.dtype == "bf16" else np.float16
            make = lambda shape: self.region.array(shape, npdt)  # noqa: E731
        self.q, self.k, self.v, self.o = (make(s) for s in ((b, 1, h, d), (b, 1, hkv, d),
                                                             (b, 1, hkv, d), (b, 1, h, d)))
        rng = np.random.default_rng(7)
        for x in (self.q, self.k, self.v):
            src = rng.standard_normal(tuple(x.shape), dtype=np.float32)
            if self.use_torch:
                x.copy_(torch.from_numpy(src))
            else:
                x[...] = src.view(np.uint32) >> 16 if args.dtype == "bf16" else src
        self.sessions = [self.client.create_session(args.layers, hkv, d, dtype)
                         for _ in range(b)]
        self.layer = 0
        self.calls = 0
        self.fill(args.cache)
        self.prepared = self.client.prepare_batch_step(self.items())

    def items(self) -> List[attnd.StepItem]:
        """The step's items, region rows sliced out of the batch's tensors (each call)."""
        q, k, v, o = self.q, self.k, self.v, self.o
        return [attnd.StepItem(s, self.layer, q[i], k[i], v[i], out=o[i])
                for i, s in enumerate(self.sessions)]

    def fill(self, tokens: int) -> None:
        for _ in range(tokens):
            for layer in range(self.args.layers):
                self.layer = layer
                self.client.batch_step(self.items())
        self.layer = 0

    def advance(self) -> None:
        """Next layer; every --window tokens the caches go back to --cache tokens (untimed)."""
        self.calls += 1
        self.layer = self.calls % self.args.layers
        if self.calls % (self.args.layers * self.args.window) == 0:
            for s in self.sessions:
                s.truncate(self.args.window)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(0).synchronize()

    # ---- one call, by parts -----------------------------------------------------------------

    def ordinary(self, parts: Parts) -> None:
        t0 = time.perf_counter()
        items = self.items()
        t1 = time.perf_counter()
        message, prepared = _core.prepare_batch_step(self.client.regions, items)
        t2 = time.perf_counter()
        _core.synchronize_inputs(prepared)
        t3 = time.perf_counter()
        buf = self.client._unary("BatchStep", message, 120)
        t4 = time.perf_counter()
        results = _core.read_batch_step(buf, prepared)
        t5 = time.perf_counter()
        if any(isinstance(r, attnd.AttndError) for r in results):
            raise attnd.BatchStepError(results)
        for name, a, b in (("items (region rows)", t0, t1), ("coding", t1, t2), ("cuda sync", t2, t3),
                           ("grpcio call", t3, t4), ("reading", t4, t5), ("sum", t0, t5)):
            parts.add(name, b - a)
        parts.add("server total_us", results[0].timing.total_us * 1e-6)
        parts.add("grpcio call - server total_us", (t4 - t3) - results[0].timing.total_us * 1e-6)
        parts.add("client (sum - grpcio call)", (t5 - t0) - (t4 - t3))
        self.advance()

    def prepared_parts(self, parts: Parts) -> None:
        t = self.prepared.template
        t0 = time.perf_counter()
        message = t.message(self.layer)
        t1 = time.perf_counter()
        if t.devices:
            t.synchronize()
        t2 = time.perf_counter()
        buf = self.client._unary("BatchStep", message, 120)
        t3 = time.perf_counter()
        results = t.read(buf, False)
        t4 = time.perf_counter()
        for name, a, b in (("coding", t0, t1), ("cuda sync", t1, t2), ("grpcio call", t2, t3),
                           ("reading", t3, t4), ("sum", t0, t4)):
            parts.add(name, b - a)
        parts.add("items (region rows)", 0.0)
        parts.add("server total_us", results[0].timing.total_us * 1e-6)
        parts.add("grpcio call - server total_us", (t3 - t2) - results[0].timing.total_us * 1e-6)
        parts.add("client (sum - grpcio call)", (t4 - t0) - (t3 - t2))
        self.advance()

    def e2e_ordinary(self, parts: Parts) -> None:
        t0 = time.perf_counter()
        self.client.batch_step(self.items())
        parts.add("e2e", time.perf_counter() - t0)
        self.advance()

    def e2e_prepared(self, parts: Parts) -> None:
        t0 = time.perf_counter()
        self.prepared.step(self.layer)
        parts.add("e2e", time.perf_counter() - t0)
        self.advance()

    def echo_floor(self, parts: Parts, request: bytes, answer_bytes: int) -> None:
        t0 = time.perf_counter()
        self.client.echo(request, answer_bytes)
        parts.add("echo (same sizes)", time.perf_counter() - t0)

    def close(self) -> None:
        for s in self.sessions:
            s.close()
        self.client.unregister_region(self.region)
        self.region.close()


def torch_layers(args: argparse.Namespace, client: Any, prepared: bool, parts: Parts) -> None:
    """RemoteKVCache.step of one layer, the same q, k, v each call (and a device synchronize
    before and after it on the GPU, so that its time includes the step's device work)."""
    import attnd.torch as at

    transport = "cuda-ipc" if args.region == "cuda" else "shm"
    device = "cuda" if args.region == "cuda" else "cpu"
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    cache = at.RemoteKVCache(client, args.layers, hkv, d, kv_dtype=dt, transport=transport,
                             copy_outputs=False, prepare_batches=prepared)
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(b, 1, h, d, generator=gen, device=device).to(dt)
    k = torch.randn(b, 1, hkv, d, generator=gen, device=device).to(dt)
    v = torch.randn(b, 1, hkv, d, generator=gen, device=device).to(dt)
    name = "torch RemoteKVCache.step (prepared)" if prepared else \
        "torch RemoteKVCache.step (per call)"
    try:
        for _ in range(args.cache):
            for layer in range(args.layers):
                cache.step(layer, q, k, v)
        for i in range(args.calls):
            for layer in range(args.layers):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                cache.step(layer, q, k, v)
                if device == "cuda":
                    torch.cuda.synchronize()
                parts.add(name, time.perf_counter() - t0)
            if (i + 1) % args.window == 0:
                cache.truncate(args.window)
    finally:
        cache.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--region", choices=("host", "cuda"), default="host")
    p.add_argument("--lib", choices=("torch", "numpy"), default="torch",
                   help="host region views as torch CPU tensors (as attnd.torch) or numpy arrays")
    add_batch_shape_args(p, cache=16, calls_help="calls per part per round")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--no-torch-layers", action="store_true", help="leave out the torch rows")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.region == "cuda" and torch is None:
        p.error("--region cuda needs torch")

    bench = Bench(args)
    info = bench.client.info()
    ways = {"ordinary": Parts(), "prepared": Parts()}
    try:
        request = bench.prepared.template.message(0)
        answer = len(bench.client._unary("BatchStep", request, 120))
        for r in range(args.rounds):
            order = ("ordinary", "prepared") if r % 2 == 0 else ("prepared", "ordinary")
            for way in order:
                step = bench.ordinary if way == "ordinary" else bench.prepared_parts
                e2e = bench.e2e_ordinary if way == "ordinary" else bench.e2e_prepared
                for _ in range(args.calls):
                    step(ways[way])
                for _ in range(args.calls):
                    e2e(ways[way])
            for _ in range(args.calls):
                bench.echo_floor(ways["ordinary"], request, answer)
        ways["prepared"].times["echo (same sizes)"] = ways["ordinary"].times["echo (same sizes)"]
        if torch is not None and not args.no_torch_layers:
            for r in range(args.rounds):
                for prepared in ((False, True) if r % 2 == 0 else (True, False)):
                    torch_layers(args, bench.client, prepared,
                                 ways["prepared" if prepared else "ordinary"])
    finally:
        bench.close()

    rows = ["items (region rows)", "coding", "cuda sync", "grpcio call", "reading", "sum",
            "client (sum - grpcio call)", "e2e", "server total_us", "grpcio call - server total_us",
            "echo (same sizes)",
            "torch RemoteKVCache.step (per call)", "torch RemoteKVCache.step (prepared)"]
    print(f"BatchStep of {args.batch} decode steps ({args.heads}/{args.kv_heads} heads, "
          f"d={args.head_dim}, {args.dtype}), {args.region} region "
          f"({'torch' if bench.use_torch else 'numpy'} views); attnd {info.version} "
          f"({info.backend}); request {len(request)} bytes, answer {answer} bytes; "
          f"{args.rounds} rounds x {args.calls} calls")
    print(f"python {platform.python_version()}, grpcio {__import__('grpc').__version__}, "
          f"protobuf {__import__('google.protobuf').protobuf.__version__}, numpy {np.__version__}"
          f"{', torch ' + torch.__version__ if torch is not None else ''}")
    print()
    print("| part (us per call) | ordinary p50 | ordinary mean | prepared p50 | prepared mean |")
    print("| --- | --- | --- | --- | --- |")
    out: Dict[str, Any] = {"args": vars(args), "request_bytes": len(request),
                           "answer_bytes": answer, "rows": {}}
    for name in rows:
        a, b = ways["ordinary"].row(name), ways["prepared"].row(name)
        if a["n"] == 0 and b["n"] == 0:
            continue
        out["rows"][name] = {"ordinary": a, "prepared": b}

        def f(x: float) -> str:
            return "-" if x != x else f"{x:.1f}"
        print(f"| {name} | {f(a['p50_us'])} | {f(a['mean_us'])} | {f(b['p50_us'])} | "
              f"{f(b['mean_us'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
