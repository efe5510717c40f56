#!/usr/bin/env python3
"""Where the Python client's time goes in a decode BatchStep whose tensors travel in the messages
(no regions): one step of --batch sessions (default 32; 32/8 heads, d=128, bf16, one new token
each), as examples/remote_decoder.py's attention layers send it over gRPC
(attnd.torch.RemoteKVCache(transport="grpc").step -> Client.batch_step).

Ways, each timed per call (p50 and mean over --calls calls per round, --rounds rounds, the ways
in turn), all on one attnd:

  numpy/<transport>   Client.batch_step of StepItems over rows of numpy arrays [batch, 1, h, d]
                      (uint16 holding bf16), items made each call; by parts: the items, coding
                      (_core.prepare_batch_steps), the call (_unary: transport and attnd),
                      reading (_core.read_batch_step)
  torch/native        the same with rows of CPU torch tensors
  RemoteKVCache.step  attnd.torch's step of one layer, CPU tensors [batch, 1, h, d] (its host
                      copies, the items, the call, o as one tensor)
  echo                Client.echo of the same request and answer sizes (the transport's floor)
  attn-bench          the C++ client's BatchStep of the same shape (attn-bench --mode decode
                      --batch_step N --callers 1), run once after the Python ways

"server" is item 0's ServerTiming.total_us (attnd's own time for the call); "e2e - server" is
what the call costs beyond attnd's work: the client and the transport. Compare those: on a small
host the CPU backend's attention is most of a call and varies with the cache length, which the
runs keep between --cache and --cache + --window tokens (truncated back, not timed).

    PYTHONPATH=build/python bench/python_batch_grpc_bench.py --target 127.0.0.1:50051 \\
        --attn-bench build/client/attn-bench
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np

if not any(Path(p, "attnd", "__init__.py").is_file() for p in sys.path if p):  # else $PYTHONPATH's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
import attnd  # noqa: E402
from attnd import _core  # noqa: E402
from python_parts import Parts, add_batch_shape_args  # noqa: E402  (beside this file)

try:
    import torch
except ImportError:  # numpy ways only
    torch = None


def bf16_bits(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


class Steps:
    """--batch sessions on one client, stepped a layer at a time by Client.batch_step."""

    def __init__(self, args: argparse.Namespace, transport: str, lib: str):
        self.args = args
        self.client = attnd.Client(args.target, timeout=120, transport=transport)
        b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
        rng = np.random.default_rng(7)
        q, k, v = (bf16_bits(rng, s) for s in ((b, 1, h, d), (b, 1, hkv, d), (b, 1, hkv, d)))
        if lib == "torch":
            q, k, v = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (q, k, v))
        self.q, self.k, self.v = q, k, v
        self.sessions = [self.client.create_session(args.layers, hkv, d, "bfloat16")
                         for _ in range(b)]
        self.calls = 0
        for _ in range(args.cache):
            for layer in range(args.layers):
                self.client.batch_step(self.items(layer))

    def items(self, layer: int) -> List[attnd.StepItem]:
        q, k, v = self.q, self.k, self.v
        return [attnd.StepItem(s, layer, q[i], k[i], v[i]) for i, s in enumerate(self.sessions)]

    def layer(self) -> int:
        return self.calls % self.args.layers

    def advance(self) -> None:
        """Next layer; every --window tokens the caches go back to --cache tokens (untimed)."""
        self.calls += 1
        if self.calls % (self.args.layers * self.args.window) == 0:
            for s in self.sessions:
                s.truncate(self.args.window)

    def by_parts(self, parts: Parts) -> None:
        c = self.client
        t0 = time.perf_counter()
        items = self.items(self.layer())
        t1 = time.perf_counter()
        (message, prepared), = _core.prepare_batch_steps(c.regions, items,
                                                         c.options.max_message_bytes // 2)
        t2 = time.perf_counter()
        buf = c._unary("BatchStep", message, 120)
        t3 = time.perf_counter()
        results = _core.read_batch_step(buf, prepared)
        t4 = time.perf_counter()
        server = results[0].timing.total_us * 1e-6
        for name, a, z in (("items", t0, t1), ("coding", t1, t2), ("call", t2, t3),
                           ("reading", t3, t4)):
            parts.add(name, z - a)
        parts.add("call - server", (t3 - t2) - server)
        parts.add("client (items + coding + reading)", (t4 - t0) - (t3 - t2))
        self.advance()

    def e2e(self, parts: Parts) -> None:
        t0 = time.perf_counter()
        results = self.client.batch_step(self.items(self.layer()))
        t1 = time.perf_counter()
        server = results[0].timing.total_us * 1e-6
        parts.add("e2e", t1 - t0)
        parts.add("server", server)
        parts.add("e2e - server", t1 - t0 - server)
        self.advance()

    def close(self) -> None:
        for s in self.sessions:
            s.close()
        self.client.close()


class TimedClient:
    """A Client whose batch_step keeps item 0's server time (for RemoteKVCache's calls)."""

    def __init__(self, client: Any):
        self._client = client
        self.server = 0.0

    def batch_step(self, items: Any, **kw: Any) -> Any:
        results = self._client.batch_step(items, **kw)
        self.server = results[0].timing.total_us * 1e-6
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class TorchSteps:
    """attnd.torch.RemoteKVCache(transport="grpc").step of one layer, CPU tensors."""

    def __init__(self, args: argparse.Namespace, client: Any):
        import attnd.torch as at

        self.args = args
        self.timed = TimedClient(client)
        b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
        self.cache = at.RemoteKVCache(self.timed, args.layers, hkv, d, kv_dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(3)
        self.q, self.k, self.v = (torch.randn(b, 1, x, d, generator=gen).to(torch.bfloat16)
                                  for x in (h, hkv, hkv))
        self.calls = 0
        for _ in range(args.cache):
            for layer in range(args.layers):
                self.cache.step(layer, self.q, self.k, self.v)

    def e2e(self, parts: Parts) -> None:
        layer = self.calls % self.args.layers
        t0 = time.perf_counter()
        self.cache.step(layer, self.q, self.k, self.v)
        t1 = time.perf_counter()
        parts.add("e2e", t1 - t0)
        parts.add("server", self.timed.server)
        parts.add("e2e - server", t1 - t0 - self.timed.server)
        self.calls += 1
        if self.calls % (self.args.layers * self.args.window) == 0:
            self.cache.truncate(self.args.window)

    def close(self) -> None:
        self.cache.close()


def attn_bench(args: argparse.Namespace) -> Dict[str, str]:
    """attn-bench's BatchStep row (stub and wire codings) and its Echo row, as printed."""
    cmd = [args.attn_bench, "--target", args.target, "--mode", "decode",
           "--sessions", str(args.batch), "--batch_step", str(args.batch),
           "--heads", str(args.heads),
           "--kv_heads", str(args.kv_heads), "--head_dim", str(args.head_dim), "--dtype", "bf16",
           "--layers", str(args.layers), "--cache_tokens", str(args.cache),
           "--decode_window", str(args.window), "--duration_s", str(args.attn_bench_seconds),
           "--warmup_s", "1", "--tcp_ceiling_s", "0", "--step_coding", "stub,wire"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    lines = [ln for ln in out.splitlines() if re.match(r"^(mode|batch_step|echo)\b", ln)]
    return {"command": " ".join(cmd), "rows": "\n".join(lines)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--target", default="127.0.0.1:50051")
    add_batch_shape_args(p, cache=8, calls_help="calls per way per round")
    p.add_argument("--attn-bench", default="", help="attn-bench binary ('' leaves its row out)")
    p.add_argument("--attn-bench-seconds", type=float, default=4.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    ways: Dict[str, Parts] = {}
    runs: Dict[str, Callable[[Parts], None]] = {}
    closers = []
    steps = {}
    for transport in ("native", "grpcio"):
        s = Steps(args, transport, "numpy")
        steps[transport] = s
        closers.append(s.close)
        runs[f"numpy/{transport} batch_step"] = s.e2e
        runs[f"numpy/{transport} by parts"] = s.by_parts
    if torch is not None:
        s = Steps(args, "native", "torch")
        closers.append(s.close)
        runs["torch/native batch_step"] = s.e2e
        runs["torch/native by parts"] = s.by_parts
        t = TorchSteps(args, steps["native"].client)
        closers.append(t.close)
        runs["RemoteKVCache.step (native)"] = t.e2e
    native = steps["native"]
    (request, prepared), = _core.prepare_batch_steps(native.client.regions, native.items(0), None)
    answer = len(native.client._unary("BatchStep", request, 120))
    for s in native.sessions:
        s.truncate(1)

    def echo(parts: Parts) -> None:
        t0 = time.perf_counter()
        native.client.echo(request, answer)
        parts.add("e2e", time.perf_counter() - t0)
    runs["echo (native, same sizes)"] = echo
    try:
        for _ in range(args.rounds):
            for name, run in runs.items():
                parts = ways.setdefault(name, Parts())
                for _ in range(args.calls):
                    run(parts)
    finally:
        for close in reversed(closers):  # the torch cache uses the first client
            close()
    bench = attn_bench(args) if args.attn_bench else None

    info_client = attnd.Client(args.target)
    info = info_client.info()
    info_client.close()
    print(f"BatchStep of {args.batch} decode steps ({args.heads}/{args.kv_heads} heads, "
          f"d={args.head_dim}, bf16), tensors in the messages; attnd {info.version} "
          f"({info.backend}); request {len(request)} bytes, answer {answer} bytes; "
          f"{args.rounds} rounds x {args.calls} calls; caches {args.cache}.."
          f"{args.cache + args.window} tokens")
    print(f"python {platform.python_version()}, grpcio {__import__('grpc').__version__}, "
          f"numpy {np.__version__}{', torch ' + torch.__version__ if torch is not None else ''}, "
          f"attnd._fast {'loaded' if _core.FAST is not None else 'missing'}")
    print()
    print("| way | part | p50 us | mean us |")
    print("| --- | --- | --- | --- |")
    out: Dict[str, Any] = {"args": vars(args), "request_bytes": len(request),
                           "answer_bytes": answer, "ways": {}}
    for name, parts in ways.items():
        out["ways"][name] = {}
        for part in parts.times:
            r = parts.row(part)
            out["ways"][name][part] = r
            print(f"| {name} | {part} | {r['p50_us']:.1f} | {r['mean_us']:.1f} |")
    if bench is not None:
        out["attn_bench"] = bench
        print()
        print("attn-bench (C++ client, same attnd, after the Python ways):")
        print()
        print("```")
        print(bench["rows"])
        print("```")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
