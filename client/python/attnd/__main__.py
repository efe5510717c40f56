"""python3 -m attnd [--target HOST:PORT] info | health | attend [--check] | session [--check]

info     GetServerInfo (backend, device, limits, KV cache, replica id)
health   exit 0 when attnd is SERVING (grpc.health.v1), 1 otherwise
attend   random inputs of the given shape; prints each call's latency and server timing; with
         --check compares every answer with a float64 reference and ends with PASS (exit 0) or
         FAIL (exit 3) and the tolerance; --dtype fp8 (q, k, v) or --kv-dtype fp8 (k, v) send
         E4M3 codes with their descales
session  a KV-cache session through prefill, decode, truncate, fork and close; --check compares
         every step with the float64 reference over the cache it sent
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, List, Optional

import numpy as np

from . import _reference
from .client import Client
from .errors import AttndError

# Largest error relative to the largest |reference| value that passes, per dtype (attnctl's).
# FP8: the server computes on exactly the values the codes and descales stand for, so o's type
# decides, but for the FP8 tensor-core kernel, which rounds P to e4m3 too.
TOLERANCE = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 1.5e-2, "fp8-tensor-cores": 4e-2}


def _tolerance(args: argparse.Namespace, c: Client, dtype: str) -> float:
    """The check's tolerance: float32 is computed as sent only on the CPU backend; the CUDA
    backend's kernels read it as fp16 (or bf16, where a value exceeds fp16's range)."""
    if args.check_tolerance:
        return args.check_tolerance
    if dtype == "fp32" and c.info().backend != "cpu":
        return TOLERANCE["bf16"]
    return TOLERANCE[dtype]


def _client(args: argparse.Namespace) -> Client:
    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    return Client(args.target, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                  tls_server_name=args.tls_server_name, token=token, timeout=args.timeout,
                  transport=args.transport)


def _random(rng: np.random.Generator, shape: tuple, dtype: str) -> tuple:
    """(array to send, its exact values as float64, its descale: FP8 only)."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "fp8":  # E4M3 codes with one descale per tensor
        scale = float(np.abs(x).max()) / 448 or 1.0
        codes, values = _reference.quantize_e4m3(x, scale)
        return codes, values, scale
    return _random_16(x, dtype) + (None,)


def _random_16(x: np.ndarray, dtype: str) -> tuple:
    if dtype == "fp32":
        return x, x.astype(np.float64)
    if dtype == "fp16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    bits = _reference.float_to_bf16_bits(x)
    return bits, _reference.bf16_bits_to_float(bits).astype(np.float64)


def _as_float(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return _reference.bf16_bits_to_float(np.asarray(x).view(np.uint16)).astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(want))), 1e-30)
    return float(np.max(np.abs(got - want))) / scale


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(c.info(), end="")
        note = f" ({c.transport_note})" if c.transport_note else ""
        print(f"# client transport: {c.transport}{note}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    with _client(args) as c:
        serving = c.health(args.service)
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


def cmd_attend(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    kv_heads = args.kv_heads or args.heads
    seq = args.seq
    total = args.batch * seq
    cu = [i * seq for i in range(args.batch + 1)] if args.batch > 1 else None
    worst = 0.0
    fp8_q = args.dtype == "fp8"
    kv_dtype = "fp8" if fp8_q or args.kv_dtype == "fp8" else args.dtype
    o_dtype = args.o_dtype if fp8_q else args.dtype  # what o comes back in
    with _client(args) as c:
        tol = _tolerance(args, c, o_dtype)
        if fp8_q and args.check and not args.check_tolerance and seq > 16 and \
                args.head_dim in c.info().fp8.attend_tensor_core_head_dims:
            tol = TOLERANCE["fp8-tensor-cores"]
        for i in range(args.count):
            q, q64, qs = _random(rng, (total, args.heads, args.head_dim), args.dtype)
            k, k64, ks = _random(rng, (total, kv_heads, args.head_dim), kv_dtype)
            v, v64, vs = _random(rng, (total, kv_heads, args.head_dim), kv_dtype)
            fp8 = {}
            if kv_dtype == "fp8":
                fp8 = dict(k_descale=[ks], v_descale=[vs])
            if fp8_q:
                fp8.update(q_descale=[qs], o_dtype={"fp16": "float16", "bf16": "bfloat16"}[o_dtype])
            start = time.perf_counter()
            r = c.attend(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=args.causal,
                         return_lse=args.check, **fp8)
            ms = (time.perf_counter() - start) * 1e3
            t = r.timing
            line = (f"attend {i}: {ms:.2f} ms (server: total {t.total_us:.0f} us, queue "
                    f"{t.queue_us:.0f}, transfer {t.transfer_us:.0f}, compute {t.compute_us:.0f})")
            if args.check:
                o_ref, lse_ref = _reference.attention(q64, k64, v64, cu, cu, args.causal)
                err = max(_relative_error(_as_float(r.o, o_dtype), o_ref),
                          _relative_error(np.asarray(r.lse, np.float64), lse_ref))
                worst = max(worst, err)
                line += f", relative error {err:.2e}"
            print(line)
    if not args.check:
        return 0
    if worst <= tol:
        print(f"check: PASS: {args.count} answers agree with the float64 reference: largest "
              f"relative error {worst:.2e} <= tolerance {tol:.1e} ({args.dtype})")
        return 0
    print(f"check: FAIL: largest relative error {worst:.2e} > tolerance {tol:.1e} ({args.dtype})")
    return 3


def cmd_session(args: argparse.Namespace) -> int:
    if args.dtype == "fp8":
        print("attnd session: --dtype is the steps' q and o type: fp32, fp16 or bf16", file=sys.stderr)
        return 64
    rng = np.random.default_rng(args.seed)
    kv_heads = args.kv_heads or args.heads
    dtype = "bf16" if args.dtype == "fp32" else args.dtype
    tol = args.check_tolerance or TOLERANCE[dtype]
    worst = 0.0
    cache: List[List[np.ndarray]] = [[np.zeros((0, kv_heads, args.head_dim))] * 2
                                     for _ in range(args.layers)]

    def step(session: Any, layer_cache: List[List[np.ndarray]], n: int) -> None:
        nonlocal worst
        for layer in range(args.layers):
            q, q64, _ = _random(rng, (n, args.heads, args.head_dim), dtype)
            k, k64, _ = _random(rng, (n, kv_heads, args.head_dim), dtype)
            v, v64, _ = _random(rng, (n, kv_heads, args.head_dim), dtype)
            r = session.step(layer, q, k, v)
            keys = np.concatenate([layer_cache[layer][0], k64])
            values = np.concatenate([layer_cache[layer][1], v64])
            layer_cache[layer] = [keys, values]
            if r.cached_tokens != keys.shape[0]:
                raise AssertionError(f"the server reports {r.cached_tokens} cached tokens, "
                                     f"{keys.shape[0]} were sent")
            if args.check:
                o_ref, _ = _reference.attention(q64, keys, values, causal=True)
                worst = max(worst, _relative_error(_as_float(r.o, dtype), o_ref))

    with _client(args) as c:
        with c.create_session(args.layers, kv_heads, args.head_dim, dtype) as s:
            print(f"session {s.id}: {args.layers} layers, {kv_heads} KV heads, d={args.head_dim}, "
                  f"{dtype}")
            for at in range(0, args.prefill, args.chunk):
                step(s, cache, min(args.chunk, args.prefill - at))
            for _ in range(args.decode):
                step(s, cache, 1)
            t = s.truncate(args.truncate)
            cache = [[kv[0][:kv[0].shape[0] - args.truncate], kv[1][:kv[1].shape[0] - args.truncate]]
                     for kv in cache]
            print(f"truncated {args.truncate} tokens: {t.cached_tokens[0]} left, "
                  f"{t.freed_pages} pages freed")
            with s.fork() as child:
                child_cache = [list(kv) for kv in cache]
                for _ in range(args.decode):
                    step(child, child_cache, 1)
                    step(s, cache, 1)
                print(f"forked {child.id}: decoded {args.decode} tokens on both")
    print(f"session closed after {args.prefill} prefill and {3 * args.decode} decode tokens")
    if not args.check:
        return 0
    if worst <= tol:
        print(f"check: PASS: every step agrees with the float64 reference over its cache: largest "
              f"relative error {worst:.2e} <= tolerance {tol:.1e} ({dtype})")
        return 0
    print(f"check: FAIL: largest relative error {worst:.2e} > tolerance {tol:.1e} ({dtype})")
    return 3


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m attnd", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[2:]))
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--tls-ca", default=None, help="PEM CA of attnd's certificate (TLS)")
    parser.add_argument("--tls-cert", default=None, help="client certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="client key (mTLS)")
    parser.add_argument("--tls-server-name", default=None)
    parser.add_argument("--token-file", default=None, help="file holding a bearer token")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline per call, seconds")
    parser.add_argument("--transport", choices=("auto", "native", "grpcio"), default=None,
                        help="how calls go out (default: $ATTND_TRANSPORT, else auto: native "
                             "where libattn_client_c.so loads)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GetServerInfo")
    health = sub.add_parser("health", help="exit 0 when SERVING")
    health.add_argument("--service", default="")
    for name in ("attend", "session"):
        p = sub.add_parser(name)
        p.add_argument("--heads", type=int, default=8)
        p.add_argument("--kv-heads", type=int, default=2)
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--dtype", choices=("fp32", "fp16", "bf16", "fp8"), default="bf16",
                       help="attend: fp8 sends q, k and v as E4M3 codes (o in --o-dtype)")
        p.add_argument("--check", action="store_true", help="compare with a float64 reference")
        p.add_argument("--check-tolerance", type=float, default=0.0)
        p.add_argument("--seed", type=int, default=1)
    attend = sub.choices["attend"]
    attend.add_argument("--batch", type=int, default=2)
    attend.add_argument("--seq", type=int, default=256)
    attend.add_argument("--causal", action="store_true")
    attend.add_argument("--count", type=int, default=3)
    attend.add_argument("--kv-dtype", choices=("fp8",), default=None,
                        help="fp8: k and v as E4M3 codes with a descale each (q in --dtype)")
    attend.add_argument("--o-dtype", choices=("fp16", "bf16"), default="bf16",
                        help="the output's type with --dtype fp8")
    session = sub.choices["session"]
    session.add_argument("--layers", type=int, default=2)
    session.add_argument("--prefill", type=int, default=100)
    session.add_argument("--chunk", type=int, default=32)
    session.add_argument("--decode", type=int, default=8)
    session.add_argument("--truncate", type=int, default=3)
    args = parser.parse_args(argv)
    commands = {"info": cmd_info, "health": cmd_health, "attend": cmd_attend,
                "session": cmd_session}
    try:
        return commands[args.command](args)
    except AttndError as e:
        print(f"python3 -m attnd {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
