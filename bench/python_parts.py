"""Per-call durations of named parts, for the Python client's benchmarks (bench/python_*.py,
which import it from beside them)."""
from __future__ import annotations

import argparse
import statistics
from typing import Dict, List


def add_batch_shape_args(p: argparse.ArgumentParser, cache: int, calls_help: str) -> None:
    """The arguments both batch benchmarks take: the batch of sessions, their attention shape,
    their caches (cache tokens to start with, as many added before a truncate) and the rounds."""
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="layers per session (calls cycle them)")
    p.add_argument("--cache", type=int, default=cache, help="tokens in each cache to start with")
    p.add_argument("--window", type=int, default=cache, help="tokens added before a truncate")
    p.add_argument("--calls", type=int, default=200, help=calls_help)
    p.add_argument("--rounds", type=int, default=3)


class Parts:
    """Per-call durations (seconds) of named parts."""

    def __init__(self) -> None:
        self.times: Dict[str, List[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def row(self, name: str) -> Dict[str, float]:
        xs = self.times.get(name, [])
        if not xs:
            return {"p50_us": float("nan"), "mean_us": float("nan"), "n": 0}
        return {"p50_us": statistics.median(xs) * 1e6, "mean_us": statistics.fmean(xs) * 1e6,
                "n": len(xs)}
