"""PyTorch integration: attention whose KV cache lives in attnd.

- ``RemoteKVCache``: one attnd session per sequence of a batch; ``step(layer, q, k, v)`` appends
  each sequence's new keys and values to its layer's cache and returns attention over it (a Step
  for one sequence, one BatchStep for many). ``fork``, ``truncate``/``crop``, ``reorder`` (beam
  search: forks), ``close``. Transports: ``"grpc"`` (tensors in the messages), ``"cuda-ipc"`` (a
  GPU region shared with a co-located attnd: q, k, v and o never leave the device) or ``"shm"``
  (a host region shared with a co-located attnd, for CPU tensors). Over a region, the BatchStep
  of a step shape is coded once (``Client.prepare_batch_step``) and each layer's step only
  copies q, k, v into the region and sends it.
- ``RemoteAttention``: an ``nn.Module`` a model calls with its own q, k, v for prefill and decode.
- ``register_transformers()``: registers ``"attnd"`` as a Hugging Face transformers attention
  implementation, and ``AttndCache`` is a transformers ``Cache`` whose keys and values live in
  attnd, so that an unmodified ``model.generate(..., past_key_values=AttndCache(client, config))``
  runs with remote attention::

      attnd.torch.register_transformers(client)
      model = LlamaForCausalLM(config)            # or from_pretrained(...)
      model.set_attn_implementation("attnd")      # or attn_implementation="attnd"
      out = model.generate(ids, past_key_values=attnd.torch.AttndCache(client, model.config))

Sessions hold float16 or bfloat16 (attnd's cache types): a float32 model's q, k and v are sent as
``kv_dtype`` (float16 by default) and o comes back converted to float32.
Not supported: padded batches (sequences of different lengths in one batch), dropout, softcap.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ._core import StepItem
from .errors import AttndError, InvalidArgument
from .regions import CudaRegion, HostRegion

_SESSION_DTYPES = (torch.float16, torch.bfloat16)
_TRANSPORTS = ("grpc", "shm", "cuda-ipc")


class RemoteKVCache:
    """The KV cache of a batch of sequences, one attnd session each, for all layers.

    Args:
        client: an attnd.Client (any transport) or attnd.SessionClient (grpc only).
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        kv_dtype: the sessions' dtype (torch.float16 or torch.bfloat16); None: the dtype of the
            first q (float16 for a float32 model).
        transport: "grpc"; "cuda-ipc" (needs attnd's CUDA backend on this host, started with
            --allow_shared_memory, and CUDA tensors); or "shm" (a host region: attnd on this host
            with --allow_shared_memory, and CPU tensors).
        max_tokens: per-session token limit (0: the server's).
        copy_outputs: over a region, return o as a fresh tensor (True) or as a view of the shared
            region that the next step overwrites (False: one copy less per layer).
        record_latency: keep each step's wall time in ``latencies[layer]`` (seconds).
        prepare_batches: over a region, code each step shape's BatchStep once and send it again
            at every layer (True), or code it at every step (False: for comparison).
    """

    def __init__(self, client: Any, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 kv_dtype: Optional[torch.dtype] = None, transport: str = "grpc",
                 max_tokens: int = 0, copy_outputs: bool = True, record_latency: bool = False,
                 prepare_batches: bool = True, _sessions: Optional[List[Any]] = None,
                 _lengths: Optional[List[int]] = None):
        if transport not in _TRANSPORTS:
            raise InvalidArgument(f"transport must be 'grpc', 'shm' or 'cuda-ipc', got {transport!r}")
        if kv_dtype is not None and kv_dtype not in _SESSION_DTYPES:
            raise InvalidArgument(f"kv_dtype must be torch.float16 or torch.bfloat16, got {kv_dtype}")
        self.client = client
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.kv_dtype = kv_dtype
        self.transport = transport
        self.max_tokens = max_tokens
        self.copy_outputs = copy_outputs
        self.sessions: List[Any] = list(_sessions or [])
        self.lengths: List[int] = list(_lengths or [0] * self.num_layers)
        self.record_latency = record_latency
        self.prepare_batches = prepare_batches
        self.latencies: List[List[float]] = [[] for _ in range(self.num_layers)]
        self._arena: Any = None  # the CudaRegion or HostRegion of "cuda-ipc" or "shm"
        self._slots: Dict[tuple, _Slots] = {}

    # ---- sessions -------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.sessions)

    def seq_length(self, layer: int = 0) -> int:
        """Tokens each sequence holds in `layer`'s cache."""
        return self.lengths[layer]

    def _ensure(self, batch: int, dtype: torch.dtype) -> None:
        if self.kv_dtype is None:
            self.kv_dtype = dtype if dtype in _SESSION_DTYPES else torch.float16
        if self.sessions:
            if batch != len(self.sessions):
                raise InvalidArgument(f"this cache holds {len(self.sessions)} sequences; the step "
                                      f"has {batch} (reorder() changes the batch)")
            return
        name = "bfloat16" if self.kv_dtype == torch.bfloat16 else "float16"
        self.sessions = [self.client.create_session(self.num_layers, self.num_kv_heads,
                                                    self.head_dim, name, self.max_tokens)
                         for _ in range(batch)]

    def fork(self) -> "RemoteKVCache":
        """A new cache sharing this one's contents (each session forked: copy-on-write)."""
        return RemoteKVCache(self.client, self.num_layers, self.num_kv_heads, self.head_dim,
                             kv_dtype=self.kv_dtype, transport=self.transport,
                             max_tokens=self.max_tokens, copy_outputs=self.copy_outputs,
                             record_latency=self.record_latency,
                             prepare_batches=self.prepare_batches,
                             _sessions=[s.fork() for s in self.sessions], _lengths=self.lengths)

    def truncate(self, tokens: int) -> None:
        """Drops the last `tokens` tokens of every layer of every sequence."""
        tokens = int(tokens)
        if tokens < 0 or any(tokens > n for n in self.lengths):
            raise InvalidArgument(f"cannot drop {tokens} tokens from caches of {self.lengths}")
        if tokens == 0:
            return
        for s in self.sessions:
            s.truncate(tokens)
        self.lengths = [n - tokens for n in self.lengths]

    def crop(self, length: int) -> None:
        """Keeps the first `length` tokens; 0 or negative: drops -length (transformers' newer
        meaning, which its assisted generation uses, with a 0-d tensor, to drop rejected drafts)."""
        length = int(length)
        current = max(self.lengths) if self.lengths else 0
        keep = current + length if length <= 0 else length
        if keep < current:
            self.truncate(current - keep)

    def reorder(self, indices: Sequence[int]) -> None:
        """Row i becomes (a fork of) row indices[i] (beam search, repeated sequences)."""
        old = self.sessions
        used = set()
        fresh = []
        for i in indices:
            i = int(i)
            if i not in used:
                used.add(i)
                fresh.append(old[i])  # the first use keeps the session itself
            else:
                fresh.append(old[i].fork())
        for j, s in enumerate(old):
            if j not in used:
                s.close()
        self.sessions = fresh
        self._slots.clear()  # their requests name the old sessions

    def close(self) -> None:
        """Closes every session (and unregisters the GPU region)."""
        for s in self.sessions:
            try:
                s.close()
            except AttndError:
                pass
        self.sessions = []
        self.lengths = [0] * self.num_layers
        self._drop_arena()

    def __enter__(self) -> "RemoteKVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- steps ----------------------------------------------------------------------------------

    def step(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
             scale: float = 0.0, window: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Appends k, v to `layer`'s cache of each sequence and returns attention of q over it.

        q [batch, new_tokens, heads, head_dim]; k, v [batch, new_tokens, kv_heads, head_dim]
        (any strides); returns o [batch, new_tokens, heads, head_dim] in q's dtype and device.
        """
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise InvalidArgument("q, k and v must be [batch, tokens, heads, head_dim], got "
                                  f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        batch, n = q.shape[0], q.shape[1]
        self._ensure(batch, q.dtype)
        start = time.perf_counter()
        if self.transport == "grpc":
            o = self._step_grpc(layer, q, k, v, scale, window)
        else:
            o = self._step_region(layer, q, k, v, scale, window)
        if self.record_latency:
            self.latencies[layer].append(time.perf_counter() - start)
        self.lengths[layer] += n
        return o

    def _step_grpc(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float, window: Optional[Tuple[int, int]]) -> torch.Tensor:
        if len(self.sessions) == 1:
            # One copy of each tensor to the host in the session's dtype (rows are views of it).
            host = [x.detach().to(dtype=self.kv_dtype).contiguous().to("cpu") for x in (q, k, v)]
            r = self.sessions[0].step(layer, host[0][0], host[1][0], host[2][0], scale=scale,
                                      window=window)
            return r.o.unsqueeze(0).to(device=q.device, dtype=q.dtype)
        hq, hk, hv = _host_arrays((q, k, v), self.kv_dtype)
        # The answer's rows are copied straight into one tensor (attnd._fast: no tensor per row
        # to make and stack); pinned for a CUDA model, so that its copy back does not block.
        o = torch.empty(tuple(q.shape), dtype=self.kv_dtype, pin_memory=q.is_cuda)
        ho = _as_array(o)
        self.client.batch_step([StepItem(s, layer, hq[b], hk[b], hv[b], scale=scale,
                                         window=window, out=ho[b])
                                for b, s in enumerate(self.sessions)])
        return o.to(device=q.device, dtype=q.dtype, non_blocking=True)

    def _arena_for(self, nbytes: int, device: torch.device) -> Any:
        """The region the steps' tensors go through (grown, and registered again, when a step
        needs more room; the slots over the old one are dropped with it)."""
        if self._arena is not None and self._arena.nbytes >= nbytes:
            return self._arena
        self._drop_arena()
        size = max(nbytes, 1 << 20)
        size = 1 << (size - 1).bit_length()  # room to grow into
        self._arena = CudaRegion(size, device.index or 0) if self.transport == "cuda-ipc" else \
            HostRegion(size)
        self.client.register_region(self._arena)
        return self._arena

    def _drop_arena(self) -> None:
        self._slots.clear()
        if self._arena is None:
            return
        try:
            self.client.unregister_region(self._arena)
        except AttndError:
            pass
        self._arena.close()
        self._arena = None

    def _slots_for(self, q: torch.Tensor, k: torch.Tensor, scale: float,
                   window: Optional[Tuple[int, int]]) -> _Slots:
        """The region views of a step of this shape and the step's request, made once per shape
        (a decode loop reuses them at every layer of every token)."""
        b, n, h, d = q.shape
        hkv = k.shape[2]
        key = (b, n, h, hkv, d, float(scale or 0.0), None if window is None else tuple(window))
        slots = self._slots.get(key)
        if slots is not None:
            return slots
        dt = self.kv_dtype
        elt = torch.tensor([], dtype=dt).element_size()
        shapes = [(b, n, h, d), (b, n, hkv, d), (b, n, hkv, d), (b, n, h, d)]
        aligned = [(b * n * x[2] * d * elt + 255) // 256 * 256 for x in shapes]
        arena = self._arena_for(sum(aligned), q.device)
        if len(self._slots) >= _MAX_SLOTS:
            self._slots.clear()
        # Every shape's views start at the region's start: one step is in flight at a time, and
        # an o handed out without a copy is overwritten by the next step (copy_outputs).
        offsets = [sum(aligned[:i]) for i in range(4)]
        qa, ka, va, oa = (arena.tensor(shape, dt, offset=at) for shape, at in zip(shapes, offsets))
        if b == 1:
            slots = _Slots(qa, ka, va, oa, None, (qa[0], ka[0], va[0], oa[0]))
        elif not self.prepare_batches:
            slots = _Slots(qa, ka, va, oa, None, None)
        else:
            prepared = self.client.prepare_batch_step(
                [StepItem(s, 0, qa[i], ka[i], va[i], scale=scale, window=window, out=oa[i])
                 for i, s in enumerate(self.sessions)])
            slots = _Slots(qa, ka, va, oa, prepared, None)
        self._slots[key] = slots
        return slots

    def _step_region(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float, window: Optional[Tuple[int, int]]) -> torch.Tensor:
        if self.transport == "cuda-ipc" and not q.is_cuda:
            raise InvalidArgument("transport cuda-ipc needs CUDA tensors")
        if self.transport == "shm" and q.is_cuda:
            raise InvalidArgument("transport shm needs CPU tensors (cuda-ipc is for CUDA ones)")
        slots = self._slots_for(q, k, scale, window)
        slots.q.copy_(q)
        slots.k.copy_(k)
        slots.v.copy_(v)
        if slots.prepared is not None:
            slots.prepared.step(layer)
        elif slots.rows is not None:
            qa, ka, va, oa = slots.rows
            self.sessions[0].step(layer, qa, ka, va, scale=scale, window=window, out=oa)
        else:  # coded at every step
            qa, ka, va, oa = slots.q, slots.k, slots.v, slots.o
            self.client.batch_step([StepItem(s, layer, qa[i], ka[i], va[i], scale=scale,
                                             window=window, out=oa[i])
                                    for i, s in enumerate(self.sessions)])
        oa = slots.o
        if oa.dtype != q.dtype:
            return oa.to(q.dtype)
        return oa.clone() if self.copy_outputs else oa


def _as_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor of a session dtype (bfloat16 as its uint16 bits,
    as attnd reads numpy arrays): numpy rows cost the items and their coding a fraction of
    torch rows' (attribute calls into torch per row and per tensor)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _host_arrays(xs: Sequence[torch.Tensor], dtype: torch.dtype) -> List[np.ndarray]:
    """xs ([batch, ...] each) on the host in dtype, as numpy arrays: CPU tensors as they are
    where they already are so (else one conversion each); CUDA ones joined on the device and
    copied to pinned host memory at once (one synchronizing copy instead of one per tensor)."""
    if not xs[0].is_cuda:
        return [_as_array(x.detach().to(dtype=dtype).contiguous().to("cpu")) for x in xs]
    return _joined_to_host(xs, dtype, pin=True)


def _joined_to_host(xs: Sequence[torch.Tensor], dtype: torch.dtype, pin: bool) -> List[np.ndarray]:
    """_host_arrays of CUDA tensors: joined row by row ([batch, all of a row's elements]), one
    copy to the host, each x's part as a view [batch, ...] whose rows are contiguous."""
    b = xs[0].shape[0]
    joined = torch.cat([x.detach().reshape(b, -1).to(dtype) for x in xs], dim=1)
    host = torch.empty(tuple(joined.shape), dtype=dtype, pin_memory=pin)
    host.copy_(joined)
    flat = _as_array(host)
    out, at = [], 0
    for x in xs:
        n = x[0].numel() if b else 0
        out.append(flat[:, at:at + n].reshape(tuple(x.shape)))  # rows stay contiguous views
        at += n
    return out


class _Slots(NamedTuple):
    """A step shape's views of the region (q, k, v, o: [batch, tokens, heads, head_dim]) and
    its prepared BatchStep (batch > 1) or its rows (one sequence: a Step)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    prepared: Any
    rows: Any


_MAX_SLOTS = 8  # step shapes kept (decode, and the prefill chunks' shapes)


class RemoteAttention(nn.Module):
    """Causal self-attention of one layer, computed by attnd over the layer's remote KV cache.

    ``forward(q, k, v, cache)`` with q [batch, tokens, heads, head_dim] and k, v [batch, tokens,
    kv_heads, head_dim] (``layout="bhsd"``: heads before tokens, as transformers keeps them)
    appends k and v to the cache and returns o in q's layout, dtype and device. Prefill (many
    tokens, in as many chunks as the caller likes) and decode (one token) are the same call.
    """

    def __init__(self, layer_idx: int, *, scale: float = 0.0,
                 window: Optional[Tuple[int, int]] = None, layout: str = "bshd"):
        super().__init__()
        if layout not in ("bshd", "bhsd"):
            raise InvalidArgument(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
        self.layer_idx = layer_idx
        self.scale = scale
        self.window = window
        self.layout = layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: RemoteKVCache) -> torch.Tensor:
        if self.layout == "bhsd":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        o = cache.step(self.layer_idx, q, k, v, scale=self.scale, window=self.window)
        return o.transpose(1, 2) if self.layout == "bhsd" else o


# ---- transformers ------------------------------------------------------------------------------

IMPLEMENTATION = "attnd"
_default_client: Any = None


def _stateless(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: Optional[float], window: Optional[Tuple[int, int]]) -> torch.Tensor:
    """Attention over whole sequences with no cache (a forward without past_key_values): one
    Attend over the batch packed as varlen sequences. query [B, H, S, D] -> [B, S, H, D]."""
    if _default_client is None:
        raise AttndError("attn_implementation='attnd' without an AttndCache needs a client: call "
                         "attnd.torch.register_transformers(client)")
    b, h, s, d = query.shape
    sk = key.shape[2]
    dt = query.dtype if query.dtype in _SESSION_DTYPES + (torch.float32,) else torch.float32
    q = query.transpose(1, 2).reshape(b * s, h, d).to(device="cpu", dtype=dt).contiguous()
    k = key.transpose(1, 2).reshape(b * sk, key.shape[1], d).to(device="cpu", dtype=dt).contiguous()
    v = value.transpose(1, 2).reshape(b * sk, key.shape[1], d).to(device="cpu", dtype=dt).contiguous()
    cu_q = [i * s for i in range(b + 1)]
    cu_k = [i * sk for i in range(b + 1)]
    causal = getattr(module, "is_causal", True)
    r = _default_client.attend(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal,
                               scale=scaling or 0.0, window=window)
    return r.o.view(b, s, h, d).to(device=query.device, dtype=query.dtype)


def attnd_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                            scaling: Optional[float] = None, dropout: float = 0.0,
                            sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                            **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """The "attnd" attention implementation of transformers (see register_transformers).

    query [B, H, S, D]; key, value: what the cache's update returned ([B, Hkv, S, D]). Returns
    ([B, S, H, D], None)."""
    if dropout:
        raise InvalidArgument("attnd attention does not apply dropout (use the model in eval mode)")
    if softcap:
        raise InvalidArgument("attnd attention does not support softcap")
    window = (int(sliding_window) - 1, 0) if sliding_window else None
    cache = getattr(key, "_attnd_cache", None)
    if cache is None:
        return _stateless(module, query, key, value, scaling, window), None
    o = cache.remote.step(module.layer_idx, query.transpose(1, 2), key.transpose(1, 2),
                          value.transpose(1, 2), scale=scaling or 0.0, window=window)
    return o, None


def _attnd_mask(*args: Any, **kwargs: Any) -> None:
    """The attention mask of "attnd": none (attnd masks causally itself), after a check that the
    batch is not padded (each sequence is a session of its own and has no padding tokens)."""
    mask = kwargs.get("attention_mask", kwargs.get("padding_mask"))
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and not bool(mask.all()):
        raise InvalidArgument("attnd attention does not take padded batches: give the sequences "
                              "of a batch equal lengths (or one sequence per batch)")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool and bool((mask == 0).any()):
        raise InvalidArgument("attnd attention does not take padded batches: give the sequences "
                              "of a batch equal lengths (or one sequence per batch)")
    return None


def register_transformers(client: Any = None, name: str = IMPLEMENTATION) -> None:
    """Registers `name` as a transformers attention implementation (and its mask function).

    client: used for forwards without an AttndCache (stateless Attend of whole sequences)."""
    global _default_client
    from transformers import AttentionInterface

    if client is not None:
        _default_client = client
    AttentionInterface.register(name, attnd_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers: no mask interface
        return
    AttentionMaskInterface.register(name, _attnd_mask)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def _make_cache_classes() -> Tuple[type, type]:
    from transformers.cache_utils import Cache

    try:
        from transformers.cache_utils import CacheLayerMixin
    except ImportError:  # transformers before the per-layer caches
        CacheLayerMixin = object

    class AttndLayer(CacheLayerMixin):  # type: ignore[misc, valid-type]
        """One layer's view of an AttndCache (its data is in attnd)."""

        is_compileable = False
        is_sliding = False

        def __init__(self, parent: Any, index: int):
            if CacheLayerMixin is not object:
                super().__init__()
            self.parent = parent
            self.index = index
            self.is_initialized = False

        def lazy_initialization(self, key_states: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
            return self.parent.update(key_states, value_states, self.index)

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return self.parent.remote.seq_length(self.index)

        def get_mask_sizes(self, query: Any, *args: Any, **kwargs: Any) -> Tuple[int, int]:
            return self.parent.get_mask_sizes(query, self.index)

        def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:
            return -1

        def get_max_length(self, *args: Any, **kwargs: Any) -> int:
            return -1  # grows as steps append (attnd's limit is --max_session_tokens)

        def reset(self) -> None:
            pass

    class AttndCache(Cache):
        """A transformers Cache whose keys and values live in attnd sessions (one per sequence).

        AttndCache(client, config, transport="grpc"|"cuda-ipc", kv_dtype=None, ...): the model's
        shape comes from its config (num_hidden_layers, num_key_value_heads, head_dim). Use with
        attn_implementation="attnd" (register_transformers). ``crop`` truncates the sessions
        (assisted generation rejecting draft tokens), ``reorder_cache`` and the batch operations
        fork them (beam search, num_return_sequences). ``close()`` frees them in attnd (they
        also expire after attnd's session TTL).
        """

        is_compileable = False

        def __init__(self, client: Any, config: Any = None, *, num_layers: Optional[int] = None,
                     num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                     remote: Optional[RemoteKVCache] = None, **options: Any):
            if remote is not None:  # fork(): the forked sessions
                client, num_layers = remote.client, remote.num_layers
                num_kv_heads, head_dim = remote.num_kv_heads, remote.head_dim
            elif config is not None:
                c = _text_config(config)
                num_layers = num_layers or c.num_hidden_layers
                num_kv_heads = num_kv_heads or getattr(c, "num_key_value_heads", None) or \
                    c.num_attention_heads
                head_dim = head_dim or getattr(c, "head_dim", None) or \
                    c.hidden_size // c.num_attention_heads
            if not (num_layers and num_kv_heads and head_dim):
                raise InvalidArgument("AttndCache needs the model's config (or num_layers, "
                                      "num_kv_heads and head_dim)")
            self.remote = remote or RemoteKVCache(client, num_layers, num_kv_heads, head_dim,
                                                  **options)
            layers = [AttndLayer(self, i) for i in range(num_layers)]
            try:
                super().__init__(layers=layers)
            except TypeError:  # a Cache without per-layer objects
                super().__init__()
                self.layers = layers

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   cache_kwargs: Any = None, *args: Any, **kwargs: Any
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
            """Returns the new keys and values as they are, tagged with this cache: the attnd
            attention function sends them with the layer's queries in one step."""
            key_states._attnd_cache = self  # type: ignore[attr-defined]
            if layer_idx < len(self.layers):
                self.layers[layer_idx].is_initialized = True
            return key_states, value_states

        def get_seq_length(self, layer_idx: Optional[int] = 0, *args: Any, **kwargs: Any) -> int:
            return self.remote.seq_length(layer_idx or 0)

        def get_mask_sizes(self, query: Any, layer_idx: int = 0, *args: Any,
                           **kwargs: Any) -> Tuple[int, int]:
            n = query if isinstance(query, int) else int(query.shape[0])
            return self.get_seq_length(layer_idx) + n, 0

        def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:
            return -1

        def get_max_length(self, *args: Any, **kwargs: Any) -> int:
            return -1  # grows as steps append (attnd's limit is --max_session_tokens)

        def get_max_length(self) -> Optional[int]:
            return None

        @property
        def is_initialized(self) -> bool:  # type: ignore[override]
            return bool(self.remote.sessions)

        @property
        def is_sliding(self) -> List[bool]:  # type: ignore[override]
            return [False] * self.remote.num_layers

        @property
        def max_batch_size(self) -> int:  # type: ignore[override]
            return self.remote.batch_size

        @property
        def max_cache_len(self) -> int:  # type: ignore[override]
            return -1

        def __len__(self) -> int:
            return self.remote.num_layers

        def __getitem__(self, layer_idx: int) -> Any:
            raise KeyError("an AttndCache keeps its keys and values in attnd, not here")

        def __iter__(self) -> Any:
            raise TypeError("an AttndCache keeps its keys and values in attnd, not here")

        def crop(self, max_length: int) -> None:
            self.remote.crop(max_length)

        def fork(self) -> "AttndCache":
            """A new AttndCache sharing this one's contents (copy-on-write in attnd)."""
            return AttndCache(None, remote=self.remote.fork())

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            self.remote.reorder(beam_idx.tolist())

        def batch_repeat_interleave(self, repeats: int) -> None:
            self.remote.reorder([i for i in range(self.remote.batch_size) for _ in range(repeats)])

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self.remote.reorder(indices.tolist())

        def reset(self) -> None:
            self.remote.close()

        def close(self) -> None:
            self.remote.close()

    return AttndLayer, AttndCache


_cache_classes: Optional[Tuple[type, type]] = None


def __getattr__(name: str) -> Any:  # AttndCache exists once transformers is importable
    global _cache_classes
    if name in ("AttndCache", "AttndLayer"):
        if _cache_classes is None:
            _cache_classes = _make_cache_classes()
        return _cache_classes[0] if name == "AttndLayer" else _cache_classes[1]
    raise AttributeError(name)


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401  (only to know whether it is there)
    except ImportError:
        return False
    return True


__all__ = ["AttndCache", "IMPLEMENTATION", "RemoteAttention", "RemoteKVCache",
           "attnd_attention_forward", "register_transformers", "transformers_available"]
