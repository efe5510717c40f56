"""Per-call durations of named parts, for the Python client's benchmarks (bench/python_*.py,
which import it from beside them)."""
from __future__ import annotations

import statistics
from typing import Dict, List


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
