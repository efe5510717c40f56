#!/usr/bin/env python3
"""The Python client against the C++ client (attn-bench), in one run, on one attnd:

  attend   a 1k-token Attend (32/8 heads, d=128, bf16): p50 and req/s of the Python sync client
           and of attn-bench --mode unary, one caller each (target: Python p50 <= 1.10x C++,
           req/s >= 0.90x)
  step     a decode Step over a 4k-token cache (32/8 heads, d=128, bf16, one session): the Python
           sync client and attn-bench --mode decode --sessions 1 (same targets)
  aio      64 decode Steps in flight, 64 sessions: the asyncio client from one thread, and
           attn-bench --mode decode --sessions 64 (target: Python steps/s >= 0.90x C++); the
           asyncio client sends the steps of one turn of its event loop as one BatchStep
  aio1     the same with attnd.aio.Client(coalesce_steps=False): one Step call per step
  aio/grpcio
           aio with the asyncio client on grpc.aio (transport="grpcio"); aio and aio1 use
           --transport. The asyncio rows add the Python process's CPU time per step (its
           threads, gRPC's among them): what one Python thread could sustain.
  attend/grpcio, step/grpcio
           attend and step with the sync client on grpcio (transport="grpcio"), where attend and
           step use --transport (default: auto, the native transport where its library loads)

Each pair runs back to back, C++ first, --rounds times (alternating the order), and the table
gives each round and the median ratios. attnd needs room for 64 sessions of 4k+64 tokens
(--kv_cache_bytes=2G on the CPU backend). The decode runs keep each cache between 4096 and
4096 + 64 tokens (truncated back every 64 steps, not timed), as attn-bench does.

    bench/python_client_bench.py --target 127.0.0.1:50051 --attn-bench build/client/attn-bench \\
        --duration 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np

if not any(Path(p, "attnd", "__init__.py").is_file() for p in sys.path if p):  # else $PYTHONPATH's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
import attnd  # noqa: E402
import attnd.aio  # noqa: E402

HEADS, KV_HEADS, D = 32, 8, 128
DECODE_WINDOW = 64


def bf16(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """Random bfloat16 values as uint16 bits (round to nearest even)."""
    bits = rng.standard_normal(shape, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def summarize(latencies: List[float], elapsed: float, steps: int = 0) -> Dict[str, float]:
    a = np.asarray(latencies)
    return {"calls": len(a), "requests_per_s": len(a) / elapsed,
            "steps_per_s": (steps or len(a)) / elapsed,
            "p50_ms": float(np.percentile(a, 50)) * 1e3, "p99_ms": float(np.percentile(a, 99)) * 1e3}


def closed_loop(call: Callable[[], Any], duration: float, warmup: float,
                between: Callable[[int], None] = lambda i: None) -> Dict[str, float]:
    end = time.perf_counter() + warmup
    i = 0
    while time.perf_counter() < end:
        call()
        i += 1
        between(i)
    latencies: List[float] = []
    paused = 0.0
    start = time.perf_counter()
    while time.perf_counter() - start - paused < duration:
        t0 = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t0)
        i += 1
        t1 = time.perf_counter()
        between(i)
        paused += time.perf_counter() - t1
    return summarize(latencies, time.perf_counter() - start - paused)


def cpp(args: argparse.Namespace, extra: List[str]) -> List[Dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [args.attn_bench, "--target", args.target, "--heads", str(HEADS), "--kv_heads",
               str(KV_HEADS), "--head_dim", str(D), "--dtype", "bf16", "--duration_s",
               str(args.duration), "--warmup_s", str(args.warmup), "--json", out.name] + extra
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"attn-bench failed ({run.returncode}): {' '.join(cmd)}\n"
                             f"{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        return json.loads(Path(out.name).read_text())


def cpp_attend(args: argparse.Namespace) -> Dict[str, float]:
    row = cpp(args, ["--mode", "unary", "--seq", str(args.tokens), "--concurrency", "1"])[0]
    return {"requests_per_s": row["requests_per_s"], "p50_ms": row["p50_ms"],
            "p99_ms": row["p99_ms"]}


def cpp_decode(args: argparse.Namespace, sessions: int) -> Dict[str, float]:
    rows = cpp(args, ["--mode", "decode", "--sessions", str(sessions), "--layers", "1",
                      "--cache_tokens", str(args.cache), "--decode_window", str(DECODE_WINDOW)])
    row = next(r for r in rows if r["mode"].startswith("step"))
    return {"requests_per_s": row["calls_per_s"], "steps_per_s": row["steps_per_s"],
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"]}


def py_attend(args: argparse.Namespace, client: attnd.Client) -> Dict[str, float]:
    rng = np.random.default_rng(1)
    q = bf16(rng, (args.tokens, HEADS, D))
    k = bf16(rng, (args.tokens, KV_HEADS, D))
    v = bf16(rng, (args.tokens, KV_HEADS, D))
    return closed_loop(lambda: client.attend(q, k, v), args.duration, args.warmup)


_PREFILL_CHUNKS: Dict[int, tuple] = {}


def prefill(session: Any, tokens: int, chunk: int = 1024) -> None:
    """Fills a session's cache (not measured). One random chunk per size serves every session:
    drawing fresh bf16 values for 64 sessions of 4k tokens took longer than the runs."""
    for at in range(0, tokens, chunk):
        n = min(chunk, tokens - at)
        if n not in _PREFILL_CHUNKS:
            rng = np.random.default_rng(n)
            _PREFILL_CHUNKS[n] = (bf16(rng, (n, HEADS, D)), bf16(rng, (n, KV_HEADS, D)),
                                  bf16(rng, (n, KV_HEADS, D)))
        session.step(0, *_PREFILL_CHUNKS[n])


class AioSessions:
    """The asyncio parts' sessions: prefilled once through the sync client, used by every run of
    those parts (each run leaves them as it found them), closed at the end."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client: Any = None
        self.ids: List[str] = []

    def get(self) -> List[str]:
        if self.client is None:
            self.client = attnd.Client(self.args.target)
            for _ in range(self.args.aio_sessions):
                s = self.client.create_session(1, KV_HEADS, D, "bf16")
                self.ids.append(s.id)
                prefill(s, self.args.cache)
        return self.ids

    def close(self) -> None:
        if self.client is not None:
            for sid in self.ids:
                self.client.close_session(sid)
            self.client.close()


def py_step(args: argparse.Namespace, client: attnd.Client) -> Dict[str, float]:
    rng = np.random.default_rng(2)
    q, k, v = bf16(rng, (1, HEADS, D)), bf16(rng, (1, KV_HEADS, D)), bf16(rng, (1, KV_HEADS, D))
    with client.create_session(1, KV_HEADS, D, "bf16") as s:
        prefill(s, args.cache)

        def between(i: int) -> None:
            if i % DECODE_WINDOW == 0:
                s.truncate(DECODE_WINDOW)
        return closed_loop(lambda: s.step(0, q, k, v), args.duration, args.warmup, between)


def py_aio(args: argparse.Namespace, ids: List[str], coalesce: bool = True,
           transport: Optional[str] = None) -> Dict[str, float]:
    rng = np.random.default_rng(3)
    q, k, v = bf16(rng, (1, HEADS, D)), bf16(rng, (1, KV_HEADS, D)), bf16(rng, (1, KV_HEADS, D))

    async def main() -> Dict[str, float]:
        async with attnd.aio.Client(args.target, connections=args.aio_connections,
                                    coalesce_steps=coalesce,
                                    max_coalesced_steps=args.aio_max_batch,
                                    transport=transport or args.transport) as c:
            latencies: List[float] = []
            state = {"measure": False, "stop": False}

            async def worker(sid: str) -> None:
                s = c.session(sid)
                i = 0
                while not state["stop"]:
                    t0 = time.perf_counter()
                    await s.step(0, q, k, v)
                    if state["measure"]:
                        latencies.append(time.perf_counter() - t0)
                    i += 1
                    if i % DECODE_WINDOW == 0:
                        await s.truncate(DECODE_WINDOW)
                if i % DECODE_WINDOW:  # back to the prefilled length for the next run
                    await s.truncate(i % DECODE_WINDOW)
            tasks = [asyncio.ensure_future(worker(sid)) for sid in ids]
            await asyncio.sleep(args.warmup)
            state["measure"] = True
            start, cpu = time.perf_counter(), time.process_time()
            loop_cpu = time.thread_time()  # the event loop's thread: the bound of one loop
            await asyncio.sleep(args.duration)
            state["measure"] = False
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            loop_cpu = time.thread_time() - loop_cpu
            state["stop"] = True
            await asyncio.gather(*tasks)
            out = summarize(latencies, elapsed)
            out["cpu_us_per_step"] = 1e6 * cpu / max(len(latencies), 1)
            out["loop_cpu_us_per_step"] = 1e6 * loop_cpu / max(len(latencies), 1)
            out["transport"] = c.transport
            return out
    return asyncio.run(main())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--attn-bench", default=str(Path(__file__).resolve().parents[1] / "build" /
                                               "client" / "attn-bench"))
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="Attend tokens")
    p.add_argument("--cache", type=int, default=4096, help="decode: cached tokens")
    p.add_argument("--aio-sessions", type=int, default=64)
    p.add_argument("--aio-connections", type=int, default=4)
    p.add_argument("--aio-max-batch", type=int, default=16,
                   help="the asyncio client's max_coalesced_steps")
    p.add_argument("--only", default="attend,step,step/grpcio,aio,aio/grpcio,aio1",
                   help="comma-separated parts to run")
    p.add_argument("--transport", default=None,
                   help="the sync client's transport in attend and step: auto (default, or "
                        "$ATTND_TRANSPORT), native or grpcio")
    p.add_argument("--json", default=None)
    p.add_argument("--dump-stacks-after", type=float, default=0,
                   help="print every thread's stack if still running after this many seconds "
                        "(0: never); for runs under a time limit")
    args = p.parse_args()
    if args.dump_stacks_after > 0:
        faulthandler.dump_traceback_later(args.dump_stacks_after, exit=False)
    parts = args.only.split(",")
    client = attnd.Client(args.target, transport=args.transport)
    grpcio_client = attnd.Client(args.target, transport="grpcio")
    info = client.info()
    print(f"attnd {info.version} ({info.backend}, {info.device_name}) at {args.target}; "
          f"{args.duration:g} s per run, {args.rounds} rounds; Python "
          f"{sys.version.split()[0]}, grpcio {__import__('grpc').__version__}, protobuf "
          f"{__import__('google.protobuf').protobuf.__version__}; sync client transport "
          f"{client.transport}{' (' + client.transport_note + ')' if client.transport_note else ''}",
          flush=True)
    runs: Dict[str, List[Dict[str, Any]]] = {}
    aio_sessions = AioSessions(args)
    plan = {
        "attend": (lambda: cpp_attend(args), lambda: py_attend(args, client)),
        "step": (lambda: cpp_decode(args, 1), lambda: py_step(args, client)),
        "attend/grpcio": (lambda: cpp_attend(args), lambda: py_attend(args, grpcio_client)),
        "step/grpcio": (lambda: cpp_decode(args, 1), lambda: py_step(args, grpcio_client)),
        "aio": (lambda: cpp_decode(args, args.aio_sessions),
                lambda: py_aio(args, aio_sessions.get())),
        "aio1": (lambda: cpp_decode(args, args.aio_sessions),
                 lambda: py_aio(args, aio_sessions.get(), coalesce=False)),
        "aio/grpcio": (lambda: cpp_decode(args, args.aio_sessions),
                       lambda: py_aio(args, aio_sessions.get(), transport="grpcio")),
    }
    targets = {"attend": ("p50", 1.10, "req/s", 0.90), "step": ("p50", 1.10, "req/s", 0.90),
               "attend/grpcio": ("p50", 1.10, "req/s", 0.90),
               "step/grpcio": ("p50", 1.10, "req/s", 0.90),
               "aio": (None, None, "steps/s", 0.90), "aio1": (None, None, "steps/s", 0.90),
               "aio/grpcio": (None, None, "steps/s", 0.90)}
    summary: Dict[str, Any] = {}
    # Each row is printed as soon as its round is done, and each run's wall time with it, so that
    # a run cut off by a time limit still shows what it measured and where the time went.
    print(f"\n{'part':13} {'round':>5} {'C++ p50 ms':>10} {'Py p50 ms':>10} {'p50 Py/C++':>10} "
          f"{'C++ /s':>9} {'Py /s':>9} {'/s Py/C++':>9}  wall s (C++, Py)", flush=True)
    for part in parts:
        runs[part] = []
        rate_key = "steps_per_s" if part.startswith("aio") else "requests_per_s"
        p50s, rates = [], []
        for i in range(args.rounds):
            order = ["cpp", "py"] if i % 2 == 0 else ["py", "cpp"]
            r: Dict[str, Any] = {}
            wall: Dict[str, float] = {}
            for who in order:
                t0 = time.perf_counter()
                r[who] = plan[part][0 if who == "cpp" else 1]()
                wall[who] = time.perf_counter() - t0
            runs[part].append(r)
            p50 = r["py"]["p50_ms"] / r["cpp"]["p50_ms"]
            rate = r["py"][rate_key] / r["cpp"][rate_key]
            p50s.append(p50)
            rates.append(rate)
            print(f"{part:13} {i:>5} {r['cpp']['p50_ms']:>10.3f} {r['py']['p50_ms']:>10.3f} "
                  f"{p50:>10.3f} {r['cpp'][rate_key]:>9.1f} {r['py'][rate_key]:>9.1f} {rate:>9.3f}"
                  f"  {wall['cpp']:.1f}, {wall['py']:.1f}"
                  + (f"  Py cpu {r['py']['cpu_us_per_step']:.1f} us/step, loop thread "
                     f"{r['py']['loop_cpu_us_per_step']:.1f} ({r['py']['transport']})"
                     if "cpu_us_per_step" in r["py"] else ""), flush=True)
        p50_max, rate_min = targets[part][1], targets[part][3]
        med_p50, med_rate = statistics.median(p50s), statistics.median(rates)
        met = med_rate >= rate_min and (p50_max is None or med_p50 <= p50_max)
        summary[part] = {"median_p50_ratio": med_p50, "median_rate_ratio": med_rate,
                         "target": (f"p50 <= {p50_max}x and " if p50_max else "") +
                                   f"{targets[part][2]} >= {rate_min}x", "met": met}
        print(f"{part:13} {'median':>5} {'':>10} {'':>10} {med_p50:>10.3f} {'':>9} {'':>9} "
              f"{med_rate:>9.3f}  target {summary[part]['target']}: {'met' if met else 'NOT met'}",
              flush=True)
    aio_sessions.close()
    client.close()
    grpcio_client.close()
    if args.json:
        Path(args.json).write_text(json.dumps({
            "attnd": {"version": info.version, "backend": info.backend, "device": info.device_name},
            "args": vars(args), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
