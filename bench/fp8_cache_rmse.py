#!/usr/bin/env python3
"""The error of an FP8 (E4M3) session cache's elements against the 16-bit values it was given:
each value x of KV head g is stored as E4M3(x / scale[g]) (round to nearest, ties to even,
saturating at +-448) and read back as code * scale[g], the rule attnd applies on append. Prints
the RMSE, the RMSE relative to the inputs' RMS, and the fraction saturated, for two input
distributions and three choices of scale. numpy only:  /usr/bin/python3 bench/fp8_cache_rmse.py"""

import numpy as np


def e4m3_values() -> np.ndarray:
    """Every finite E4M3FN value, ascending, from its bit fields."""
    codes = np.arange(256)
    e, m = (codes >> 3) & 0xF, codes & 0x7
    v = np.where(codes & 0x80, -1.0, 1.0) * np.where(e == 0, m / 8 * 2.0 ** -6,
                                                     (1 + m / 8) * 2.0 ** (e - 7.0))
    return np.unique(v[(codes & 0x7F) != 0x7F])


def quantize(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The nearest finite E4M3 value to each x (saturating at the ends of the table)."""
    i = np.clip(np.searchsorted(table, x), 1, len(table) - 1)
    lo, hi = table[i - 1], table[i]
    return np.where(np.abs(x - lo) <= np.abs(hi - x), lo, hi)


def main() -> None:
    rng = np.random.default_rng(1)
    table = e4m3_values()
    n = 2_000_000
    cases = [("uniform[-1,1]", rng.uniform(-1, 1, n)), ("normal N(0,1)", rng.standard_normal(n))]
    print("| inputs | scale | RMSE | RMSE / RMS(x) | saturated |")
    print("|---|---|---:|---:|---:|")
    for name, x in cases:
        for scale_name, scale in (("amax / 448", np.abs(x).max() / 448),
                                  ("amax / 448 / 8 (too small)", np.abs(x).max() / 448 / 8),
                                  ("amax / 448 * 4096 (too large)", np.abs(x).max() / 448 * 4096)):
            q = np.float32(x) / np.float32(scale)
            got = quantize(q.astype(np.float64), table) * scale
            rmse = np.sqrt(np.mean((got - x) ** 2))
            print(f"| {name} | {scale_name} | {rmse:.3e} | {rmse / np.sqrt(np.mean(x ** 2)):.3e} "
                  f"| {np.mean(np.abs(q) > 448):.2e} |")


if __name__ == "__main__":
    main()
