"""Fixtures of the Python client's tests: a real attnd on loopback, and a float64 reference.

attnd is the binary in $ATTND (ctest sets it), else build*/server/attnd of this checkout. Its
backend is the CPU one unless $ATTND_TEST_BACKEND says cuda (the GPU host's run,
client/python/gpu_check.sh). The attnd package comes from $PYTHONPATH (ctest: the build tree's
copy), else from client/python.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if not any(Path(p, "attnd", "__init__.py").is_file() for p in sys.path if p):
    sys.path.insert(0, str(ROOT / "client" / "python"))

import attnd  # noqa: E402

BACKEND = os.environ.get("ATTND_TEST_BACKEND", "cpu")


def attnd_binary() -> str:
    path = os.environ.get("ATTND")
    if path:
        return path
    for candidate in sorted(ROOT.glob("build*/server/attnd")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.skip("no attnd binary: build it (scripts/build.sh) or set ATTND")


class Server:
    """One attnd process on loopback ports the kernel picked."""

    def __init__(self, *flags: str, backend: str = BACKEND, secure_client: Optional[dict] = None):
        self.log = tempfile.NamedTemporaryFile(prefix="attnd-py-", suffix=".log", delete=False)
        args = [attnd_binary(), "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                f"--backend={backend}", "--max_queue_delay_us=100"]
        if backend == "cpu":
            args.append("--threads=2")
        else:  # several attnd share the GPU during a run: each takes a modest share
            args += ["--kv_cache_bytes=4294967296", "--device_pool_bytes=2147483648",
                     "--pinned_pool_bytes=1073741824"]
        self.proc = subprocess.Popen(args + list(flags), stdout=self.log, stderr=subprocess.STDOUT)
        self.port, self.metrics_port = self._ports()
        self.target = f"127.0.0.1:{self.port}"
        with attnd.Client(self.target, wait_for_ready=True, **(secure_client or {})) as c:
            deadline = time.monotonic() + 30
            while not c.health(timeout=5):
                if time.monotonic() > deadline:
                    raise RuntimeError("attnd did not turn SERVING")
                time.sleep(0.1)

    def _ports(self) -> Tuple[int, int]:
        pattern = re.compile(rb"serving attn\.v1 on port (\d+)(?:, metrics on port (\d+))?")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = pattern.search(Path(self.log.name).read_bytes())
            if m:
                return int(m.group(1)), int(m.group(2) or 0)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("attnd did not report its ports:\n" + self.tail())

    def tail(self, n: int = 30) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def server():
    s = Server("--allow_shared_memory")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    with attnd.Client(server.target, timeout=120) as c:
        yield c


def metric(text: str, name: str, **labels: str) -> float:
    """The value of a Prometheus series (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series = head[len(name):]
        if series and not series.startswith("{"):
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return 0.0


# ---- numbers ------------------------------------------------------------------------------------

DTYPES = ["fp32", "fp16", "bf16"]
# Largest |got - reference| over the largest |reference| that passes: the output's rounding to
# its dtype (and the server's float32 accumulation) with a margin. The CUDA kernels also round
# the softmax weights to 16 bits, and float32 requests are computed in 16 bits there.
TOLERANCE = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 1.6e-2} if BACKEND == "cpu" else \
    {"fp32": 4e-3, "fp16": 4e-3, "bf16": 2e-2}
LSE_TOLERANCE = 2e-3 if BACKEND == "cpu" else 1e-2


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def make(rng: np.random.Generator, shape: Sequence[int], dtype: str) -> Tuple[np.ndarray, np.ndarray]:
    """A fresh random array to send in dtype, and its exact values in float64."""
    x = rng.standard_normal(tuple(shape), dtype=np.float32)
    if dtype == "fp32":
        return x, x.astype(np.float64)
    if dtype == "fp16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    if dtype == "bf16-ml":
        import ml_dtypes

        b = x.astype(ml_dtypes.bfloat16)
        return b, b.astype(np.float64)
    bits = bf16_bits(x)
    return bits, bf16_values(bits).astype(np.float64)


def values(x: Any, dtype: str) -> np.ndarray:
    """An answer's values in float64 (dtype as sent)."""
    if hasattr(x, "detach"):  # torch
        return x.detach().float().cpu().numpy().astype(np.float64)
    x = np.asarray(x)
    if dtype == "bf16":
        return bf16_values(x).astype(np.float64)
    return x.astype(np.float64)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_q: Optional[Sequence[int]] = None,
              cu_k: Optional[Sequence[int]] = None, causal: bool = False,
              window: Optional[Tuple[int, int]] = None, scale: float = 0.0
              ) -> Tuple[np.ndarray, np.ndarray]:
    """Attention in float64, one (sequence, head, query row) at a time: o and lse."""
    total_q, heads, d = q.shape
    group = heads // k.shape[1]
    scale = scale or 1 / np.sqrt(d)
    cu_q = list(cu_q) if cu_q is not None else [0, total_q]
    cu_k = list(cu_k) if cu_k is not None else [0, k.shape[0]]
    o = np.zeros(q.shape)
    lse = np.full((heads, total_q), -np.inf)
    for b in range(len(cu_q) - 1):
        sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for i in range(sq):
            p = i + sk - sq
            keys = [j for j in range(sk)
                    if (not causal or j <= p) and
                    (window is None or ((window[0] < 0 or j >= p - window[0]) and
                                        (window[1] < 0 or j <= p + window[1])))]
            if not keys:
                continue
            rows = [cu_k[b] + j for j in keys]
            for h in range(heads):
                s = scale * (k[rows, h // group] @ q[cu_q[b] + i, h])
                m = s.max()
                w = np.exp(s - m)
                o[cu_q[b] + i, h] = w @ v[rows, h // group] / w.sum()
                lse[h, cu_q[b] + i] = m + np.log(w.sum())
    return o, lse


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


def check_lse(got: Any, want: np.ndarray) -> None:
    got = values(got, "fp32")
    assert got.shape == want.shape
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), "lse: -inf rows differ"
    assert np.all(got[~finite] == -np.inf)
    if finite.any():
        assert np.max(np.abs(got[finite] - want[finite])) < LSE_TOLERANCE


def poisoned(shape: Sequence[int], dtype: str) -> np.ndarray:
    """An output buffer full of NaN (0xFFFF bits for bf16)."""
    if dtype == "bf16":
        return np.full(shape, 0xFFFF, dtype=np.uint16)
    return np.full(shape, np.nan, dtype=np.float32 if dtype == "fp32" else np.float16)


def torch_or_skip() -> Any:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed (Debian: apt-get install python3-torch)")
    return torch


def wire_dtype_names() -> List[str]:
    return DTYPES + (["bf16-ml"] if attnd._tensors.BFLOAT16_NP is not None else [])
