#!/usr/bin/env python3
"""A Llama-architecture decoder with random weights that generates greedily with its attention and
KV cache in attnd, compared token by token and logit by logit with the same model on local
attention (SDPA, with the model's own KV cache).

Each run, on both backends, with the same prompts:
  1. prefills the prompt in chunks (--chunk tokens a step) and forks the cache there;
  2. decodes --new-tokens tokens greedily (timed: tokens/s, and per-layer attention latency);
  3. speculative decoding from the cache as it was after --spec-from tokens (a fork): rounds of
     --draft proposals (the plain greedy tokens with one of them corrupted, or none), verified in
     one step of draft + 1 tokens, the rejected tokens truncated from the cache; the result must
     equal the plain greedy tokens;
  4. a second continuation from the fork of step 1, starting from the second-best first token.
With --teacher-forced it also feeds the same tokens to the float32 model, the local model and the
model on attnd and compares their top-1 choices at every position.

Sizes:
  --size small  CPU, float32, a small model (CI): the tokens must be identical (exit 1 otherwise).
                attnd's sessions hold float16 (its cache types), so q, k and v are sent rounded
                to float16 and o comes back in float16; the local model computes in float32.
  --size 8b     CUDA, bfloat16, 32 layers, 32/8 heads, d=128 (a Llama-3-8B-shaped model with a
                32000-token vocabulary), 2048-token prompts, 256 new tokens, batch 1 and 32, over
                gRPC and over a CUDA IPC region, with --teacher-forced.
Over a region (--transport cuda-ipc, or shm: a host region for the CPU), q, k and v of each layer
are copied into the region and a batch's step is one BatchStep coded once per shape
(attnd.torch.RemoteKVCache, Client.prepare_batch_step), only its layer rewritten each time.

The model is transformers' LlamaForCausalLM (attn_implementation "sdpa" against "attnd", with
attnd.torch.AttndCache) where transformers is installed, else a small PyTorch decoder of this
file's own (--model own forces it).

    python3 examples/remote_decoder.py --target 127.0.0.1:50051 --size small
    python3 examples/remote_decoder.py --target 127.0.0.1:50051 --size 8b --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if not any(Path(p, "attnd", "__init__.py").is_file() for p in sys.path if p):  # else $PYTHONPATH's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
import attnd  # noqa: E402
import attnd.torch as at  # noqa: E402


@dataclass
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


SIZES = {
    "small": Shape(vocab=512, hidden=128, intermediate=256, layers=3, heads=4, kv_heads=2,
                   head_dim=64),
    "8b": Shape(vocab=32000, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                head_dim=128),
}


# ---- timing -------------------------------------------------------------------------------------


class LayerTimer:
    """Wall (CPU) or CUDA-event time of each attention call while on."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.on = False
        self.cpu: List[float] = []
        self.events: List[Tuple[Any, Any]] = []

    def start(self) -> Any:
        if not self.on:
            return None
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, token: Any) -> None:
        if token is None:
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append((token, e))
        else:
            self.cpu.append(time.perf_counter() - token)

    def seconds(self) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self.events]
        return list(self.cpu)

    def reset(self) -> None:
        self.cpu, self.events = [], []


def percentiles(xs: List[float]) -> Dict[str, float]:
    if not xs:
        return {"p50_us": float("nan"), "p99_us": float("nan"), "n": 0}
    a = np.sort(np.asarray(xs)) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "n": len(xs)}


# ---- the model of this file (no transformers) ---------------------------------------------------


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention aligned bottom-right: q [B, S, H, D] over k, v [B, T, Hkv, D] (T >= S)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s, t = q.shape[1], k.shape[1]
    mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if hasattr(F, "scaled_dot_product_attention"):
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    else:  # torch < 2.0: the same in plain operations
        scores = (qt @ kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.float().masked_fill(~mask, float("-inf"))
        o = torch.softmax(scores, dim=-1).to(q.dtype) @ vt
    return o.transpose(1, 2)


class LocalCache:
    """The own model's local KV cache: per layer [B, T, Hkv, D]."""

    def __init__(self, layers: int):
        self.k: List[Optional[torch.Tensor]] = [None] * layers
        self.v: List[Optional[torch.Tensor]] = [None] * layers

    def seq_length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[1]


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """Rotary embedding of x [B, S, H, D] at positions [S] (halves rotated, as Llama does)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, s: Shape, index: int):
        super().__init__()
        self.s, self.index = s, index
        self.norm1, self.norm2 = RMSNorm(s.hidden), RMSNorm(s.hidden)
        self.q = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.gate = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down = nn.Linear(s.intermediate, s.hidden, bias=False)
        self.remote = at.RemoteAttention(index)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Any,
                timer: LayerTimer) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q = rope(self.q(h).view(b, n, self.s.heads, self.s.head_dim), positions)
        k = rope(self.k(h).view(b, n, self.s.kv_heads, self.s.head_dim), positions)
        v = self.v(h).view(b, n, self.s.kv_heads, self.s.head_dim)
        token = timer.start()
        if isinstance(cache, at.RemoteKVCache):
            o = self.remote(q, k, v, cache)
        else:
            i = self.index
            cache.k[i] = k if cache.k[i] is None else torch.cat([cache.k[i], k], 1)
            cache.v[i] = v if cache.v[i] is None else torch.cat([cache.v[i], v], 1)
            o = local_attention(q, cache.k[i], cache.v[i])
        timer.stop(token)
        x = x + self.o(o.reshape(b, n, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class OwnDecoder(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s, i) for i in range(s.layers))
        self.norm = RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, ids: torch.Tensor, cache: Any, timer: LayerTimer) -> torch.Tensor:
        past = cache.seq_length()
        positions = torch.arange(past, past + ids.shape[1], device=ids.device)
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, positions, cache, timer)
        return self.head(self.norm(x)).float()


def own_decoder(s: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> OwnDecoder:
    if device.type == "cuda":  # made on the device (torch >= 2.0): no host copy of the weights
        with torch.device(device):
            model = OwnDecoder(s)
    else:
        model = OwnDecoder(s)
    init_weights(model, seed)
    return model.to(dtype)


class OwnRunner:
    """The own decoder on one backend ("local" or "remote")."""

    name = "own decoder"

    def __init__(self, model: OwnDecoder, backend: str, client: Any, transport: str):
        self.model, self.backend, self.client, self.transport = model, backend, client, transport
        self.timer = LayerTimer(next(model.parameters()).device)

    def new_cache(self, batch: int) -> Any:
        s = self.model.s
        if self.backend == "local":
            return LocalCache(s.layers)
        return at.RemoteKVCache(self.client, s.layers, s.kv_heads, s.head_dim,
                                transport=self.transport, record_latency=True,
                                copy_outputs=False)

    def forward(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.model(ids, cache, self.timer)

    def fork(self, cache: Any) -> Any:
        if isinstance(cache, LocalCache):
            c = LocalCache(len(cache.k))
            c.k, c.v = list(cache.k), list(cache.v)  # appends make new tensors: sharing is safe
            return c
        return cache.fork()

    def truncate(self, cache: Any, n: int) -> None:
        if isinstance(cache, LocalCache):
            cache.k = [k[:, : k.shape[1] - n] for k in cache.k]
            cache.v = [v[:, : v.shape[1] - n] for v in cache.v]
        else:
            cache.truncate(n)

    def close(self, cache: Any) -> None:
        if not isinstance(cache, LocalCache):
            cache.close()

    def remote_latencies(self, cache: Any) -> List[float]:
        return [] if isinstance(cache, LocalCache) else [x for l in cache.latencies for x in l]

    def reset_remote_latencies(self, cache: Any) -> None:
        if not isinstance(cache, LocalCache):
            cache.latencies = [[] for _ in cache.latencies]


# ---- transformers -------------------------------------------------------------------------------


def set_attn_implementation(model: Any, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


class HFRunner:
    """transformers' LlamaForCausalLM on one backend: attn_implementation "sdpa" with its own
    DynamicCache (local), or "attnd" with an AttndCache (remote)."""

    name = "transformers LlamaForCausalLM"

    def __init__(self, model: Any, backend: str, client: Any, transport: str):
        self.model, self.backend, self.client, self.transport = model, backend, client, transport
        self.timer = LayerTimer(next(model.parameters()).device)

    def _implementation(self) -> str:
        return "attnd" if self.backend == "remote" else _timed_sdpa(self.timer)

    def new_cache(self, batch: int) -> Any:
        from transformers import DynamicCache

        set_attn_implementation(self.model, self._implementation())
        if self.backend == "remote":
            return at.AttndCache(self.client, self.model.config, transport=self.transport,
                                 record_latency=True, copy_outputs=False)
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    def forward(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits.float()

    def fork(self, cache: Any) -> Any:
        return cache.fork() if self.backend == "remote" else copy.deepcopy(cache)

    def truncate(self, cache: Any, n: int) -> None:
        if n > 0:  # a negative length drops that many tokens (transformers 5.18 takes no other)
            cache.crop(-n)

    def close(self, cache: Any) -> None:
        if self.backend == "remote":
            cache.close()

    def remote_latencies(self, cache: Any) -> List[float]:
        if self.backend != "remote":
            return []
        return [x for l in cache.remote.latencies for x in l]

    def reset_remote_latencies(self, cache: Any) -> None:
        if self.backend == "remote":
            cache.remote.latencies = [[] for _ in cache.remote.latencies]


_TIMED: Dict[int, str] = {}


def _timed_sdpa(timer: LayerTimer) -> str:
    """An attention implementation "sdpa_timed_N": transformers' SDPA, timed by `timer`."""
    key = id(timer)
    if key not in _TIMED:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            token = timer.start()
            out = sdpa_attention_forward(*args, **kwargs)
            timer.stop(token)
            return out

        name = f"sdpa_timed_{len(_TIMED)}"
        AttentionInterface.register(name, forward)
        try:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        except ImportError:
            pass
        _TIMED[key] = name
    return _TIMED[key]


def build_hf(s: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads,
                         num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                         max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    init_weights(model, seed)
    return model.to(dtype).eval()


def init_weights(model: nn.Module, seed: int) -> None:
    """Random weights of our own drawing, the same for every build with the same seed: N(0, 0.02)
    for matrices and embeddings, ones for norms."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)


# ---- one run ------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one backend produced."""

    tokens: List[List[int]] = field(default_factory=list)      # [batch][new_tokens]
    logits: List[torch.Tensor] = field(default_factory=list)   # per decode step, [batch, vocab]
    spec_tokens: List[List[int]] = field(default_factory=list)
    spec_rounds: int = 0
    spec_accepted: int = 0
    fork_tokens: List[List[int]] = field(default_factory=list)
    fork_logits: List[torch.Tensor] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    attention_s: List[float] = field(default_factory=list)
    remote_s: List[float] = field(default_factory=list)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def generate(runner: Any, prompts: torch.Tensor, args: argparse.Namespace,
             truth: Optional[List[List[int]]]) -> Run:
    """Steps 1-4 of the module's description on one backend; `truth` (the local run's plain
    greedy tokens) gives the draft proposals of step 3 (None: this run's own)."""
    device = prompts.device
    batch, plen = prompts.shape
    r = Run()
    cache = runner.new_cache(batch)
    start = time.perf_counter()
    for at_ in range(0, plen, args.chunk):
        logits = runner.forward(prompts[:, at_:at_ + args.chunk], cache)
    sync(device)
    r.prefill_s = time.perf_counter() - start
    first_logits = logits[:, -1]
    fork_cache = runner.fork(cache)
    runner.reset_remote_latencies(cache)
    runner.timer.reset()
    runner.timer.on = True
    nxt = argmax(first_logits)
    generated = [nxt]
    spec_cache = None
    start = time.perf_counter()
    for i in range(args.new_tokens - 1):
        if i == args.spec_from:
            sync(device)
            paused = time.perf_counter()
            runner.timer.on = False
            spec_cache = runner.fork(cache)  # step 3 starts from here (not timed)
            runner.timer.on = True
            start += time.perf_counter() - paused
        logits = runner.forward(nxt[:, None], cache)[:, -1]
        r.logits.append(logits)
        nxt = argmax(logits)
        generated.append(nxt)
    sync(device)
    r.decode_s = time.perf_counter() - start
    runner.timer.on = False
    r.attention_s = runner.timer.seconds()
    r.remote_s = runner.remote_latencies(cache)
    r.tokens = torch.stack(generated, 1).tolist()
    runner.close(cache)

    # 3: speculative decoding from the state after spec_from + 1 tokens.
    own = truth if truth is not None else r.tokens
    rng = np.random.default_rng(args.seed + 7)
    pos = args.spec_from + 1  # tokens generated so far (fed: pos - 1; `cur` is token pos - 1)
    cur = torch.tensor([row[pos - 1] for row in r.tokens], device=device)
    spec = [[row[i] for i in range(pos)] for row in r.tokens]
    while pos < args.new_tokens and spec_cache is not None:
        k = min(args.draft, args.new_tokens - pos)
        drafts = torch.tensor([row[pos:pos + k] for row in own], device=device)
        wrong = int(rng.integers(0, k + 1))  # k: no corrupted proposal this round
        if wrong < k:
            drafts[:, wrong] = (drafts[:, wrong] + 1) % args.vocab
        logits = runner.forward(torch.cat([cur[:, None], drafts], 1), spec_cache)
        picks = argmax(logits)  # picks[:, j]: the model's token after position j of the step
        ok = (picks[:, :k] == drafts).int().cumprod(1).sum(1)  # accepted drafts per row
        accepted = int(ok.min())  # the batch keeps the tokens every row accepts
        r.spec_rounds += 1
        r.spec_accepted += accepted
        runner.truncate(spec_cache, k - accepted)
        for b in range(batch):
            spec[b].extend(drafts[b, :accepted].tolist() + [int(picks[b, accepted])])
        cur = picks[:, accepted]
        pos += accepted + 1
    r.spec_tokens = [row[:args.new_tokens] for row in spec]
    if spec_cache is not None:
        runner.close(spec_cache)

    # 4: a second continuation from the fork made after the prefill.
    second = first_logits.topk(2, -1).indices[:, 1]
    out = [second]
    for _ in range(args.fork_tokens - 1):
        logits = runner.forward(out[-1][:, None], fork_cache)[:, -1]
        r.fork_logits.append(logits)
        out.append(argmax(logits))
    r.fork_tokens = torch.stack(out, 1).tolist()
    runner.close(fork_cache)
    return r


def warm_up(runner: Any, prompts: torch.Tensor, chunk: int) -> None:
    """A short prefill and a few decode steps, not measured (allocators, kernels, connections)."""
    cache = runner.new_cache(prompts.shape[0])
    logits = runner.forward(prompts[:, :chunk], cache)
    for _ in range(3):
        logits = runner.forward(argmax(logits[:, -1])[:, None], cache)
    runner.close(cache)
    sync(prompts.device)


def forced_logits(runner: Any, seq: torch.Tensor, plen: int, chunk: int) -> torch.Tensor:
    """The logits at every position of seq [1, n] (predicting tokens 1..n-1) when fed seq itself:
    the prompt in chunks, then one token a step. [n - 1, vocab]"""
    cache = runner.new_cache(1)
    parts = []
    at_ = 0
    while at_ < seq.shape[1] - 1:
        n = min(chunk, plen - at_) if at_ < plen else 1
        parts.append(runner.forward(seq[:, at_:at_ + n], cache)[0])
        at_ += n
    runner.close(cache)
    return torch.cat(parts)[: seq.shape[1] - 1]


def teacher_forced(logits: Dict[str, torch.Tensor], plen: int, decoded: int) -> Dict[str, Any]:
    """Top-1 agreement of the models fed the same tokens: fp32 (local, float32), local (SDPA in
    the model's dtype) and remote (attention in attnd), at every position and at the decoded
    ones; and the largest logit differences."""
    decode = slice(plen - 1, None)

    def agree(a: str, b: str, part: slice) -> float:
        return float((logits[a][part].argmax(-1) == logits[b][part].argmax(-1)).float().mean())

    out: Dict[str, Any] = {"positions": int(logits["remote"].shape[0]), "decode_positions": decoded}
    for part_name, part in (("all", slice(None)), ("decode", decode)):
        out[part_name] = {
            "remote_vs_local": agree("remote", "local", part),
            "local_vs_fp32": agree("local", "fp32", part),
            "remote_vs_fp32": agree("remote", "fp32", part),
        }
    out["max_logit_diff_remote_vs_local"] = float((logits["remote"] - logits["local"]).abs().max())
    out["max_logit_diff_local_vs_fp32"] = float((logits["local"] - logits["fp32"]).abs().max())
    out["target_met"] = out["decode"]["remote_vs_local"] >= out["decode"]["local_vs_fp32"]
    return out


# ---- main ---------------------------------------------------------------------------------------


def compare(local: Run, remote: Run) -> Dict[str, Any]:
    def max_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
        return max((float((x - y).abs().max()) for x, y in zip(a, b)), default=0.0)

    def max_ref(a: List[torch.Tensor]) -> float:
        return max((float(x.abs().max()) for x in a), default=1.0)

    same = sum(x == y for rl, rr in zip(local.tokens, remote.tokens) for x, y in zip(rl, rr))
    total = sum(len(r) for r in local.tokens)
    first_diff = next((i for i in range(len(local.tokens[0]))
                       if any(rl[i] != rr[i] for rl, rr in zip(local.tokens, remote.tokens))), None)
    return {
        "tokens_identical": local.tokens == remote.tokens,
        "token_agreement": same / max(total, 1),
        "first_difference_at": first_diff,
        "max_logit_diff": max_diff(local.logits, remote.logits),
        "max_abs_logit": max_ref(local.logits),
        "fork_tokens_identical": local.fork_tokens == remote.fork_tokens,
        "fork_max_logit_diff": max_diff(local.fork_logits, remote.fork_logits),
        "speculative_equals_greedy_local": local.spec_tokens == local.tokens,
        "speculative_equals_greedy_remote": remote.spec_tokens == remote.tokens,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--model", choices=("auto", "hf", "own"), default="auto")
    p.add_argument("--transport", default=None, help="comma-separated: grpc, shm (a host region: "
                   "CPU, attnd on this host), cuda-ipc; or both (grpc,cuda-ipc) (default: grpc; "
                   "8b: both)")
    p.add_argument("--batch", default=None, help="comma-separated batch sizes (small: 1,2; 8b: 1,32)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (small: 40; 8b: 2048)")
    p.add_argument("--new-tokens", type=int, default=None, help="(small: 24; 8b: 256)")
    p.add_argument("--chunk", type=int, default=None, help="prefill tokens per step (16; 512)")
    p.add_argument("--draft", type=int, default=4, help="draft tokens per speculative round")
    p.add_argument("--spec-from", type=int, default=None, help="speculative decoding starts "
                   "after this many decoded tokens (default: new_tokens / 2)")
    p.add_argument("--fork-tokens", type=int, default=None, help="second continuation's length")
    p.add_argument("--teacher-forced", action="store_true", default=None)
    p.add_argument("--connections", type=int, default=4, help="HTTP/2 connections of the client: "
                   "a large prefill BatchStep over gRPC is cut into that many calls at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    small = args.size == "small"
    s = SIZES[args.size]
    args.vocab = s.vocab
    transports = (args.transport or ("grpc" if small else "both"))
    transports = ["grpc", "cuda-ipc"] if transports == "both" else transports.split(",")
    batches = [int(b) for b in (args.batch or ("1,2" if small else "1,32")).split(",")]
    args.prompt = args.prompt or (40 if small else 2048)
    args.new_tokens = args.new_tokens or (24 if small else 256)
    args.chunk = args.chunk or (16 if small else 512)
    args.spec_from = args.spec_from if args.spec_from is not None else args.new_tokens // 2
    args.fork_tokens = args.fork_tokens or (8 if small else 32)
    if args.teacher_forced is None:
        args.teacher_forced = not small
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    use_hf = args.model == "hf" or (args.model == "auto" and at.transformers_available())

    client = attnd.Client(args.target, timeout=600, connections=args.connections)
    info = client.info()
    # Exact agreement is expected of attnd's CPU backend (float32 arithmetic throughout) in float32
    # mode; its CUDA kernels round the softmax weights to 16 bits, and bfloat16 models round
    # everything: those runs report their agreement (and the teacher-forced comparison) instead.
    exact = small and info.backend == "cpu"
    if use_hf:
        at.register_transformers(client)
        model = build_hf(s, device, dtype, args.seed)
        make = lambda backend, transport: HFRunner(model, backend, client, transport)  # noqa: E731
    else:
        model = own_decoder(s, device, torch.float32, args.seed).to(dtype).eval()
        make = lambda backend, transport: OwnRunner(model, backend, client, transport)  # noqa: E731
    print(f"model: {make('local', 'grpc').name}, {s.layers} layers, {s.heads}/{s.kv_heads} heads, "
          f"d={s.head_dim}, hidden {s.hidden}, vocab {s.vocab}, {str(dtype)[6:]} on {device}; "
          f"attnd {info.version} ({info.backend}, {info.device_name}) at {args.target}")
    print(f"prompt {args.prompt} tokens (chunks of {args.chunk}), {args.new_tokens} new tokens, "
          f"speculative decoding from token {args.spec_from + 1} ({args.draft} drafts a round), "
          f"a fork of {args.fork_tokens} tokens")
    results: Dict[str, Any] = {"args": {k: v for k, v in vars(args).items()},
                               "model": make("local", "grpc").name, "attnd": {
                                   "version": info.version, "backend": info.backend,
                                   "device": info.device_name}, "runs": []}
    failures = []
    gen = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        for batch in batches:
            prompts = torch.randint(0, s.vocab, (batch, args.prompt), generator=gen).to(device)
            warm_up(make("local", "grpc"), prompts, args.chunk)
            local = generate(make("local", "grpc"), prompts, args, None)
            for transport in transports:
                warm_up(make("remote", transport), prompts, args.chunk)
                remote = generate(make("remote", transport), prompts, args, local.tokens)
                c = compare(local, remote)
                step_local = local.decode_s / (args.new_tokens - 1)
                step_remote = remote.decode_s / (args.new_tokens - 1)
                row = {
                    "batch": batch, "transport": transport, **c,
                    "tokens_per_s_local": batch * (args.new_tokens - 1) / local.decode_s,
                    "tokens_per_s_remote": batch * (args.new_tokens - 1) / remote.decode_s,
                    "step_ms_local": step_local * 1e3, "step_ms_remote": step_remote * 1e3,
                    "added_us_per_layer": (step_remote - step_local) / s.layers * 1e6,
                    "prefill_s_local": local.prefill_s, "prefill_s_remote": remote.prefill_s,
                    "local_attention_layer": percentiles(local.attention_s),
                    "remote_attention_layer": percentiles(remote.remote_s),
                    "speculative_rounds": remote.spec_rounds,
                    "speculative_accepted": remote.spec_accepted,
                }
                results["runs"].append(row)
                la, ra = row["local_attention_layer"], row["remote_attention_layer"]
                print(f"\nbatch {batch}, {transport}:")
                print(f"  tokens: {'identical' if c['tokens_identical'] else 'DIFFERENT'} "
                      f"({c['token_agreement']:.1%} agree; first difference at "
                      f"{c['first_difference_at']}), largest logit difference "
                      f"{c['max_logit_diff']:.3g} (largest |logit| {c['max_abs_logit']:.3g})")
                print(f"  fork: {'identical' if c['fork_tokens_identical'] else 'DIFFERENT'} "
                      f"(largest logit difference {c['fork_max_logit_diff']:.3g}); speculative "
                      f"decoding ({remote.spec_rounds} rounds, {remote.spec_accepted} drafts "
                      f"accepted, rejected ones truncated) equals greedy: local "
                      f"{c['speculative_equals_greedy_local']}, remote "
                      f"{c['speculative_equals_greedy_remote']}")
                print(f"  prefill: local {row['prefill_s_local']:.2f} s, remote "
                      f"{row['prefill_s_remote']:.2f} s")
                print(f"  decode: local {row['tokens_per_s_local']:.1f} tokens/s "
                      f"({row['step_ms_local']:.2f} ms a step), remote "
                      f"{row['tokens_per_s_remote']:.1f} tokens/s ({row['step_ms_remote']:.2f} ms); "
                      f"attnd adds {row['added_us_per_layer']:.0f} us per layer")
                print(f"  attention per layer: local p50 {la['p50_us']:.0f} us, p99 "
                      f"{la['p99_us']:.0f} us; remote p50 {ra['p50_us']:.0f} us, p99 "
                      f"{ra['p99_us']:.0f} us ({ra['n']} calls)")
                if exact and not (c["speculative_equals_greedy_local"] and
                                  c["speculative_equals_greedy_remote"]):
                    failures.append(f"batch {batch} {transport}: speculative decoding != greedy")
                if exact and not (c["tokens_identical"] and c["fork_tokens_identical"]):
                    failures.append(f"batch {batch} {transport}: tokens differ")
        if args.teacher_forced and 1 in batches:
            prompt = torch.randint(0, s.vocab, (1, args.prompt), generator=gen).to(device)
            tokens = generate(make("local", "grpc"), prompt, args, None).tokens[0]
            seq = torch.cat([prompt[0], torch.tensor(tokens, device=device)])[None, :]
            logits = {"local": forced_logits(make("local", "grpc"), seq, args.prompt, args.chunk)}
            fp32 = build_hf(s, device, torch.float32, args.seed) if use_hf else \
                own_decoder(s, device, torch.float32, args.seed).eval()
            fp32_runner = HFRunner(fp32, "local", client, "grpc") if use_hf else \
                OwnRunner(fp32, "local", client, "grpc")
            logits["fp32"] = forced_logits(fp32_runner, seq, args.prompt, args.chunk)
            del fp32, fp32_runner
            for transport in transports:
                logits["remote"] = forced_logits(make("remote", transport), seq, args.prompt,
                                                 args.chunk)
                tf = teacher_forced(logits, args.prompt, len(tokens))
                tf["transport"] = transport
                results.setdefault("teacher_forced", []).append(tf)
                print(f"\nteacher-forced, {transport} ({tf['positions']} positions, "
                      f"{tf['decode_positions']} decoded): top-1 agreement at decode positions: "
                      f"attnd vs local {tf['decode']['remote_vs_local']:.4f}, local "
                      f"{str(dtype)[6:]} vs fp32 {tf['decode']['local_vs_fp32']:.4f}, attnd vs "
                      f"fp32 {tf['decode']['remote_vs_fp32']:.4f}; all positions: "
                      f"{tf['all']['remote_vs_local']:.4f} / {tf['all']['local_vs_fp32']:.4f} / "
                      f"{tf['all']['remote_vs_fp32']:.4f}; largest logit difference attnd vs "
                      f"local {tf['max_logit_diff_remote_vs_local']:.3g} (local vs fp32 "
                      f"{tf['max_logit_diff_local_vs_fp32']:.3g}); target "
                      f"{'met' if tf['target_met'] else 'NOT met'}")
    client.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print("\nPASS" if exact else "\ndone")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
