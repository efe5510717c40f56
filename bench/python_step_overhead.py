#!/usr/bin/env python3
"""Where a Python decode Step's time goes, against the C++ client, on one attnd (one session,
GQA 32/8, d=128, bf16, the cache kept between --cache and --cache + 64 tokens):

  library, coded once   the native transport's library called with a Step's bytes coded once
                        (no Python per call but the ctypes call): the transport's own cost
  Client.step native    the blocking client on the native transport, split into the Python
                        before its compiled part (attnd._fast.step where it loads, else the
                        library call of the message the package coded), that part, and the
                        Python after it
  Client.step grpcio    the same client on grpcio
  attn-bench            the C++ client's Step and its Echo of the same bytes

Rows alternate over --rounds; each prints its p50 in us.

    bench/python_step_overhead.py --target 127.0.0.1:50051 --attn-bench build/client/attn-bench
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

if not any(Path(p, "attnd", "__init__.py").is_file() for p in sys.path if p):  # else $PYTHONPATH's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
import attnd  # noqa: E402
from attnd import _core, _native  # noqa: E402

HEADS, KV_HEADS, D, WINDOW = 32, 8, 128, 64


def bf16(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    bits = rng.uniform(-1, 1, shape).astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def p50(call: Callable[[], None], session: attnd.Session, calls: int) -> float:
    """p50 of calls (after 100 unmeasured) of a step that appends one token, the cache truncated
    back every WINDOW steps and at the end (not timed)."""
    out: List[float] = []
    for i in range(calls + 100):
        t0 = time.perf_counter()
        call()
        if i >= 100:
            out.append(time.perf_counter() - t0)
        if i % WINDOW == WINDOW - 1:
            session.truncate(WINDOW)
    if (calls + 100) % WINDOW:
        session.truncate((calls + 100) % WINDOW)
    return statistics.median(out) * 1e6


def cpp(args: argparse.Namespace) -> Dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [args.attn_bench, "--target", args.target, "--mode", "decode", "--heads",
               str(HEADS), "--kv_heads", str(KV_HEADS), "--head_dim", str(D), "--dtype", "bf16",
               "--cache_tokens", str(args.cache), "--decode_window", str(WINDOW), "--duration_s",
               str(args.duration), "--json", out.name]
        subprocess.run(cmd, check=True, capture_output=True)
        rows = json.loads(Path(out.name).read_text())
    step = next(r for r in rows if r["mode"].startswith("step"))
    echo = next(r for r in rows if r["mode"].startswith("echo"))
    return {"attn-bench Step": step["p50_ms"] * 1e3, "attn-bench Echo": echo["p50_ms"] * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--attn-bench", required=True)
    p.add_argument("--cache", type=int, default=64)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--duration", type=float, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--without-fast", action="store_true",
                   help="leave attnd._fast out, as on an interpreter it does not load in")
    args = p.parse_args()
    native = attnd.Client(args.target, transport="native")
    grpcio = attnd.Client(args.target, transport="grpcio")
    lib, why = _native.load()
    assert lib is not None, why
    if args.without_fast:
        _native._fast = None
    rng = np.random.default_rng(1)
    session = native.create_session(1, KV_HEADS, D, "bf16")
    for at in range(0, args.cache, 1024):
        n = min(1024, args.cache - at)
        session.step(0, bf16(rng, (n, HEADS, D)), bf16(rng, (n, KV_HEADS, D)),
                     bf16(rng, (n, KV_HEADS, D)))
    q, k, v = bf16(rng, (1, HEADS, D)), bf16(rng, (1, KV_HEADS, D)), bf16(rng, (1, KV_HEADS, D))
    coded = _core.prepare_step(native.regions, session, 0, q, k, v, 0.0, False, None, None,
                               None).message
    handle = native._native._handle
    response, message = ctypes.c_void_p(), ctypes.create_string_buffer(512)

    def library() -> None:
        code = lib.attn_c_call(handle, b"Step", coded, len(coded), 60000,
                               ctypes.byref(response), message, 512)
        assert code == 0, message.value
        lib.attn_c_response_free(response)

    # The native Client.step, its call into compiled code (attnd._fast.step where that module
    # loads, else the library call of the message the package coded) timed apart from the Python
    # before and after it.
    marks: Dict[str, float] = {}
    fast = _native._fast
    real = fast.step if fast is not None else native._native.call_parts

    def timed(*a):
        marks["in"] = time.perf_counter()
        r = real(*a)
        marks["out"] = time.perf_counter()
        return r

    def time_calls(on: bool) -> None:
        if fast is not None:
            _native._fast = type("Fast", (), {"step": staticmethod(timed)}) if on else fast
        elif on:
            native._native.call_parts = timed
        else:
            del native._native.call_parts

    splits: Dict[str, List[float]] = {"before": [], "after": []}

    def native_step() -> None:
        t0 = time.perf_counter()
        session.step(0, q, k, v)
        t1 = time.perf_counter()
        splits["before"].append(marks["in"] - t0)
        splits["after"].append(t1 - marks["out"])

    grpcio_session = grpcio.session(session.id)
    print(f"attnd at {args.target}; Python {sys.version.split()[0]}, grpcio "
          f"{__import__('grpc').__version__}; cache {args.cache}; p50 us per call; the native "
          f"step's compiled part: "
          f"{'attnd._fast.step' if fast is not None else 'attn_c_call_parts (ctypes)'}",
          flush=True)
    print(f"{'round':>5} {'library, coded once':>20} {'Client.step native':>19} "
          f"{'(Python before':>14} {'after)':>7} {'Client.step grpcio':>19} "
          f"{'attn-bench Step':>16} {'attn-bench Echo':>16}", flush=True)
    for r in range(args.rounds):
        row = {"library": p50(library, session, args.calls)}
        time_calls(True)
        splits["before"].clear()
        splits["after"].clear()
        row["native"] = p50(native_step, session, args.calls)
        time_calls(False)
        row["before"] = statistics.median(splits["before"]) * 1e6
        row["after"] = statistics.median(splits["after"]) * 1e6
        row["grpcio"] = p50(lambda: grpcio_session.step(0, q, k, v), session, args.calls)
        row.update(cpp(args))
        print(f"{r:>5} {row['library']:>20.1f} {row['native']:>19.1f} {row['before']:>14.1f} "
              f"{row['after']:>7.1f} {row['grpcio']:>19.1f} {row['attn-bench Step']:>16.1f} "
              f"{row['attn-bench Echo']:>16.1f}", flush=True)
    session.close()
    native.close()
    grpcio.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
