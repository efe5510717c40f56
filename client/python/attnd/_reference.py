"""Attention in float64 with numpy: the reference `python3 -m attnd attend --check` compares with."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def e4m3_values() -> np.ndarray:
    """The value of each OCP E4M3FN code 0..255 from its bit fields (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 0xF, codes & 0x7
    table = sign * np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
    table[(codes & 0x7F) == 0x7F] = np.nan
    return table


def quantize_e4m3(x: np.ndarray, scale: float) -> Tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes of x / scale as uint8, rounded to nearest with ties to the even code and
    saturating at +-448; the float64 values the codes stand for, times scale)."""
    table = e4m3_values()
    positive = table[:127]  # codes 0..126: 0 up to 448, increasing
    y = np.asarray(x, dtype=np.float64) / scale
    mag = np.minimum(np.abs(y), 448.0)
    hi = np.clip(np.searchsorted(positive, mag), 1, 126)
    lo = hi - 1
    d_lo, d_hi = mag - positive[lo], positive[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    codes = np.where(pick_hi, hi, lo).astype(np.uint8)
    codes = np.where(y < 0, codes | np.uint8(0x80), codes).astype(np.uint8)
    return codes, table[codes] * scale


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
              cu_seqlens_q: Optional[Sequence[int]] = None,
              cu_seqlens_k: Optional[Sequence[int]] = None, causal: bool = False,
              window: Optional[Tuple[int, int]] = None,
              scale: float = 0.0) -> Tuple[np.ndarray, np.ndarray]:
    """o [total_q, heads, d] and lse [heads, total_q] in float64, from float inputs."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    total_q, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = scale or 1.0 / np.sqrt(d)
    cu_q = list(cu_seqlens_q) if cu_seqlens_q is not None else [0, total_q]
    cu_k = list(cu_seqlens_k) if cu_seqlens_k is not None else [0, k.shape[0]]
    o = np.zeros((total_q, heads, d))
    lse = np.full((heads, total_q), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        sq, sk = q1 - q0, k1 - k0
        if sq == 0:
            continue
        pos = np.arange(sq)[:, None] + (sk - sq)  # aligned bottom-right
        j = np.arange(sk)[None, :]
        allowed = np.ones((sq, sk), dtype=bool)
        if causal:
            allowed &= j <= pos
        if window is not None:
            left, right = window
            if left >= 0:
                allowed &= j >= pos - left
            if right >= 0:
                allowed &= j <= pos + right
        for h in range(heads):
            kh = k[k0:k1, h // group]
            vh = v[k0:k1, h // group]
            s = scale * q[q0:q1, h] @ kh.T
            s = np.where(allowed, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            ok = np.isfinite(m[:, 0])
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True)
            o[q0:q1, h] = np.where(ok[:, None], (p @ vh) / np.where(total > 0, total, 1), 0.0)
            lse[h, q0:q1] = np.where(ok, np.log(np.where(total[:, 0] > 0, total[:, 0], 1)) + m[:, 0],
                                     -np.inf)
    return o, lse
