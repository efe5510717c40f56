#!/usr/bin/env python3
"""A large BatchStep over gRPC (tensors in the messages) from the Python client, sent over one
connection or spread over several: one prefill chunk of --chunk tokens for each of --batch sessions
(default 32 x 512; 32/8 heads, d=128, bf16), as examples/remote_decoder.py's prefill sends a layer.

With connections=1, Client.batch_step cuts a batch larger than half of max_message_bytes into
calls sent one after the other; with connections=N it cuts a batch of more than 8 MiB into about N
calls sent at once, one per connection. Each row times --calls calls (after one untimed) per round,
the settings in turn for --rounds rounds; the caches are truncated back after each call (untimed).
"echo" is one Echo call of the batch's request and answer bytes on one connection: the transport's
floor for one message. GB/s counts request plus answer bytes.

    PYTHONPATH=build/python bench/python_prefill_spread_bench.py --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import grpc
import numpy as np

if not any(Path(p, "attnd", "__init__.py").is_file() for p in sys.path if p):  # else $PYTHONPATH's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
import attnd  # noqa: E402


def bf16_bits(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


class Prefill:
    """--batch sessions of one layer on a client of `connections` connections."""

    def __init__(self, args: argparse.Namespace, connections: int, q, k, v):
        self.args = args
        self.client = attnd.Client(args.target, timeout=600, connections=connections,
                                   transport=args.transport)
        self.sessions = [self.client.create_session(1, args.kv_heads, args.head_dim, "bfloat16")
                         for _ in range(args.batch)]
        self.items = [attnd.StepItem(s, 0, q[i], k[i], v[i]) for i, s in enumerate(self.sessions)]
        self.calls = 0
        unary = self.client._unary

        def counted(method, *a, **kw):  # BatchStep calls per batch_step
            self.calls += method == "BatchStep"
            return unary(method, *a, **kw)

        self.client._unary = counted

    def once(self) -> float:
        self.calls = 0
        t0 = time.perf_counter()
        results = self.client.batch_step(self.items)
        t = time.perf_counter() - t0
        assert all(r.cached_tokens == self.args.chunk for r in results)
        for s in self.sessions:
            s.truncate(self.args.chunk)
        return t

    def close(self) -> None:
        for s in self.sessions:
            s.close()
        self.client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--connections", default="1,2,4,8", help="settings, comma separated")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--transport", default=None, help="native, grpcio or None (auto)")
    args = p.parse_args()
    b, t, h, hkv, d = args.batch, args.chunk, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(11)
    q, k, v = (bf16_bits(rng, s) for s in ((b, t, h, d), (b, t, hkv, d), (b, t, hkv, d)))
    request = q.nbytes + k.nbytes + v.nbytes
    answer = q.nbytes
    settings = [int(c) for c in args.connections.split(",")]
    print(f"# {b} x {t} tokens, {h}/{hkv} heads, d={d}, bf16: request {request / 2**20:.0f} MiB, "
          f"answer {answer / 2**20:.0f} MiB; Python {platform.python_version()}, "
          f"numpy {np.__version__}, grpcio {grpc.__version__}")
    times: Dict[str, List[float]] = {}
    calls: Dict[str, int] = {}
    transport = ""
    for _ in range(args.rounds):
        for c in settings:
            run = Prefill(args, c, q, k, v)
            transport = run.client.transport
            run.once()
            name = f"connections={c}"
            for _ in range(args.calls):
                times.setdefault(name, []).append(run.once())
            calls[name] = run.calls
            run.close()
        with attnd.Client(args.target, timeout=600, transport=args.transport) as client:
            payload = np.zeros(request, np.uint8)
            client.echo(payload, answer)
            for _ in range(args.calls):
                t0 = time.perf_counter()
                client.echo(payload, answer)
                times.setdefault("echo", []).append(time.perf_counter() - t0)
            calls["echo"] = 1
    print(f"# transport: {transport}")
    print("| way | calls per batch | s p50 | s min | GB/s (p50) |")
    print("| --- | --- | --- | --- | --- |")
    for name, ts in times.items():
        p50 = statistics.median(ts)
        print(f"| {name} | {calls[name]} | {p50:.3f} | {min(ts):.3f} | "
              f"{(request + answer) / p50 / 1e9:.2f} |")


if __name__ == "__main__":
    main()
