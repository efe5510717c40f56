"""What the synchronous and the asyncio client share: options, channel settings, the coding of
requests and the reading of answers. Neither does I/O here."""

from __future__ import annotations

import copy
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _proto, _tensors, _wire
from .errors import AttndError, InvalidArgument, error_for, status_code
from .regions import RegionTable
from ._wire import ServerTiming


def fast_from_file(path: Union[str, os.PathLike]) -> Any:
    """attnd._fast loaded from a file outside the package (a bundle that carries it beside the
    native library), or None where it does not load."""
    import importlib.machinery
    import importlib.util

    name = __package__ + "._fast"
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        fast = importlib.util.module_from_spec(spec)
        loader.exec_module(fast)
        return fast
    except (ImportError, OSError):
        return None


def _load_fast() -> Any:
    """attnd._fast where it loads and codes BatchSteps (attnd/_fast.c), else None: the items
    are then coded and the answers read here, in Python. Looked for in the package, then beside
    $ATTND_NATIVE_LIB, so that a bundle's copy serves the grpcio transport too."""
    try:
        from . import _fast  # type: ignore[attr-defined]
    except ImportError:
        lib = os.environ.get("ATTND_NATIVE_LIB")
        beside = os.path.join(os.path.dirname(lib), "_fast.abi3.so") if lib else ""
        _fast = fast_from_file(beside) if beside and os.path.isfile(beside) else None
    return _fast if _fast is not None and fast_usable(_fast) else None


# The layout of attnd._fast's BatchStep plan that this module reads (a stale binary is not used).
FAST_PLAN = 2


def fast_usable(fast: Any) -> bool:
    """Whether attnd._fast codes and reads BatchSteps as this module expects."""
    return hasattr(fast, "code_batch_step") and getattr(fast, "PLAN", 1) == FAST_PLAN


# attnd._fast, or None. attnd._native sets it too when it finds the module beside its library.
FAST: Any = _load_fast()

PathOrPem = Union[str, bytes, os.PathLike, None]

# gRPC methods safe to send again after UNAVAILABLE (no state changes on the server).
IDEMPOTENT = frozenset({"Attend", "Echo", "GetServerInfo", "Check", "ListRegions"})
# How the blocking Client sends Attend, Echo, Step and BatchStep: "native" through the C++ client
# library (attnd._native), "grpcio", or "auto" (native where the library loads).
TRANSPORTS = ("auto", "native", "grpcio")


class AttendResult(NamedTuple):
    """The answer to one Attend: o [total_q, heads, d] in q's dtype (and library and device);
    lse float32 [heads, total_q] when asked for; the server's timing; the request's id."""

    o: Any
    lse: Any
    timing: ServerTiming
    request_id: int = 0


class StepResult(NamedTuple):
    """The answer to one Step: o [new_tokens, heads, d]; lse float32 [heads, new_tokens] when
    asked for; tokens in the layer's cache after the step; the server's timing."""

    o: Any
    lse: Any
    cached_tokens: int
    timing: ServerTiming


class TruncateResult(NamedTuple):
    """Tokens left in each layer's cache, and KV pages freed."""

    cached_tokens: List[int]
    freed_pages: int


@dataclass
class SessionInfo:
    """A session as CreateSession or ForkSession returned it (a fork's page_tokens, ttl_seconds and
    max_tokens are its parent's)."""

    session_id: str
    replica_id: str
    page_tokens: int = 0
    ttl_seconds: int = 0
    max_tokens: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: int = _tensors.BFLOAT16
    # The cache's element type (FLOAT8_E4M3 for an FP8 cache; dtype otherwise) and, for an FP8
    # cache, its per-KV-head scales.
    cache_dtype: int = 0
    k_scales: Tuple[float, ...] = ()
    v_scales: Tuple[float, ...] = ()


@dataclass
class StepItem:
    """One step of a batch_step: a session (or its id), a layer, q and the new keys and values,
    and the step's options."""

    session: Any
    layer: int
    q: Any
    k_new: Any
    v_new: Any
    scale: float = 0.0
    return_lse: bool = False
    window: Optional[Tuple[int, int]] = None
    out: Any = None
    lse_out: Any = None
    k_new_scales: Optional[Sequence[float]] = None
    v_new_scales: Optional[Sequence[float]] = None


@dataclass
class AttendItem:
    """One request of attend_stream; options left None take the stream's defaults."""

    q: Any
    k: Any
    v: Any
    cu_seqlens_q: Optional[Sequence[int]] = None
    cu_seqlens_k: Optional[Sequence[int]] = None
    causal: Optional[bool] = None
    window: Optional[Tuple[int, int]] = None
    scale: Optional[float] = None
    return_lse: Optional[bool] = None
    high_priority: Optional[bool] = None
    q_descale: Any = None
    k_descale: Any = None
    v_descale: Any = None
    o_dtype: Any = None


def _read_pem(value: PathOrPem, what: str) -> Optional[bytes]:
    """PEM bytes as given, or read from a path (str or PathLike)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    text = os.fspath(value)
    if text.lstrip().startswith("-----BEGIN"):
        return text.encode()
    try:
        with open(text, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"{what}: cannot read {text}: {e}") from e


@dataclass
class ClientOptions:
    """Connection settings; see Client for each one's meaning."""

    target: str = "127.0.0.1:50051"
    tls: bool = False
    tls_ca: PathOrPem = None
    tls_cert: PathOrPem = None
    tls_key: PathOrPem = None
    tls_server_name: Optional[str] = None
    token: Optional[str] = None
    timeout: Optional[float] = None
    retries: int = 3
    retry_backoff: float = 0.05
    connections: int = 1
    max_message_bytes: int = 256 << 20
    wait_for_ready: bool = False
    lb_policy: Optional[str] = None
    channel_options: Sequence[Tuple[str, Any]] = field(default_factory=tuple)
    transport: Optional[str] = None

    def credentials(self) -> Optional[grpc.ChannelCredentials]:
        """TLS credentials when any TLS setting is given, else None (plaintext)."""
        if self.tls_cert is None and self.tls_key is not None or \
                self.tls_cert is not None and self.tls_key is None:
            raise InvalidArgument("tls_cert and tls_key must be given together")
        if not self.uses_tls():
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.tls_ca, "tls_ca"),
            private_key=_read_pem(self.tls_key, "tls_key"),
            certificate_chain=_read_pem(self.tls_cert, "tls_cert"))

    def uses_tls(self) -> bool:
        """TLS is on: asked for, or implied by a CA or a client certificate."""
        return self.tls or self.tls_ca is not None or self.tls_cert is not None

    def channel_args(self, connection: int) -> List[Tuple[str, Any]]:
        args: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if self.tls_server_name:
            args.append(("grpc.ssl_target_name_override", self.tls_server_name))
        if self.lb_policy:
            if not all(c.islower() or c.isdigit() or c == "_" for c in self.lb_policy):
                raise InvalidArgument(f"lb_policy {self.lb_policy!r}: expected a gRPC policy name "
                                      "such as round_robin")
            args.append(("grpc.service_config",
                         json.dumps({"loadBalancingConfig": [{self.lb_policy: {}}]})))
        if self.connections > 1:
            # Channels whose arguments differ do not share a connection.
            args.append(("attnd.client.connection", connection))
        args.extend(self.channel_options)
        return args

    def transport_asked(self) -> str:
        """transport, else $ATTND_TRANSPORT, else "auto"."""
        return self.transport or os.environ.get("ATTND_TRANSPORT") or "auto"

    def metadata(self) -> Optional[Tuple[Tuple[str, str], ...]]:
        if self.token:
            return (("authorization", "Bearer " + self.token),)
        return None

    def check(self) -> None:
        if not self.target:
            raise InvalidArgument("target is empty")
        if self.connections < 1:
            raise InvalidArgument(f"connections must be >= 1, got {self.connections}")
        if self.retries < 0:
            raise InvalidArgument(f"retries must be >= 0, got {self.retries}")
        if self.transport_asked() not in TRANSPORTS:
            raise InvalidArgument(f"transport {self.transport_asked()!r}: expected one of "
                                  f"{', '.join(TRANSPORTS)}")
        self.credentials()  # checks the TLS pairs


def backoff(options: ClientOptions, attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, ...): exponential with jitter."""
    base = options.retry_backoff * (2 ** (attempt - 1))
    return min(base, 2.0) * (0.5 + random.random())


# ---- requests -----------------------------------------------------------------------------------


def _window(window: Optional[Tuple[int, int]]) -> Optional[Tuple[int, int]]:
    if window is None:
        return None
    if len(window) != 2:
        raise InvalidArgument(f"window must be (left, right), got {window!r}")
    return int(window[0]), int(window[1])


class Prepared:
    """A request ready to send: its bytes (or its _wire.Message in parts) and what reading its
    answer needs."""

    __slots__ = ("message", "maker", "out", "lse_out", "o_in_region", "lse_in_region", "cuda_sync")

    def __init__(self, message: bytes, maker: _tensors.OutputMaker, out: Any, lse_out: Any,
                 o_in_region: bool, lse_in_region: bool, cuda_sync: Optional[int]):
        self.message = message
        self.maker = maker
        self.out = out
        self.lse_out = lse_out
        self.o_in_region = o_in_region
        self.lse_in_region = lse_in_region
        self.cuda_sync = cuda_sync


def _place(regions: RegionTable, p: _tensors.Payload) -> Optional[Tuple[str, int]]:
    if not regions.entries or p.nbytes == 0:
        return None
    return regions.find(_tensors.array_ptr(p), p.nbytes, p.cuda)


def _output_slice(regions: RegionTable, x: Any, name: str) -> Optional[Tuple[str, int, int]]:
    """Where out (or lse_out) lies in a registered region, or None when it lies in none."""
    if x is None:
        return None
    contiguous = x.is_contiguous() if _tensors.is_torch(x) else getattr(
        getattr(x, "flags", None), "c_contiguous", True)
    if not contiguous:
        raise InvalidArgument(f"{name} must be contiguous (it is written in place)")
    p = _tensors.payload(x, name)
    found = _place(regions, p)
    return None if found is None else (found[0], found[1], p.nbytes)


_NOWHERE = (None, None, None)


def _inputs(regions: RegionTable, q: Any, k: Any, v: Any, names: Tuple[str, str, str]):
    """Payloads of q, k, v, where each lies in a registered region (or None), and the CUDA
    device of those in GPU regions (None when none is)."""
    ps = (_tensors.payload(q, names[0]), _tensors.payload(k, names[1]), _tensors.payload(v, names[2]))
    if not regions.entries:
        return ps, _NOWHERE, None
    placed = tuple(_place(regions, p) for p in ps)
    device = next((p.cuda for p, at in zip(ps, placed) if at is not None and p.cuda >= 0), None)
    return ps, placed, device


def _outputs(regions: RegionTable, out: Any, lse_out: Any) -> Tuple[Optional[_wire.Outputs], bool, bool]:
    o_slice = _output_slice(regions, out, "out")
    lse_slice = _output_slice(regions, lse_out, "lse_out")
    if o_slice is None and lse_slice is None:
        return None, False, False
    return _wire.Outputs(o_slice, lse_slice), o_slice is not None, lse_slice is not None


def prepare_attend(regions: RegionTable, q: Any, k: Any, v: Any, *,
                   cu_seqlens_q: Optional[Sequence[int]], cu_seqlens_k: Optional[Sequence[int]],
                   causal: bool, window: Optional[Tuple[int, int]], scale: float,
                   return_lse: bool, high_priority: bool, out: Any, lse_out: Any,
                   request_id: int = 0, fp8: Optional[bytes] = None,
                   joined: bool = True) -> Prepared:
    maker = _tensors.OutputMaker(q)
    ps, placed, device = _inputs(regions, q, k, v, ("q", "k", "v"))
    outputs, o_in, lse_in = _outputs(regions, out, lse_out)
    m = _wire.attend_request(ps[0], ps[1], ps[2], placed, _seqlens(cu_seqlens_q),
                             _seqlens(cu_seqlens_k), causal, float(scale or 0.0), _window(window),
                             return_lse, high_priority, request_id, outputs, fp8)
    return Prepared(_message(m, joined), maker, out, lse_out, o_in, lse_in, device)


# Below this a message is joined even for a transport that sends parts as they lie: the copy is
# cheaper than handing over each part's address (bench/python_step_overhead.py --without-fast).
PARTS_MIN_BYTES = 256 << 10


def _message(m: _wire.Message, joined: bool) -> Any:
    """m's bytes, or (joined=False: for a transport that sends parts as they lie) m itself when it
    is large and no part is on a GPU."""
    if joined or m.cuda or m.size < PARTS_MIN_BYTES:
        return _tensors.assemble(m.parts, m.size, m.cuda)
    return m


def _seqlens(values: Optional[Sequence[int]]) -> Optional[Sequence[int]]:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [int(x) for x in values]


def session_id_of(session: Any) -> str:
    return session if isinstance(session, str) else session.id


def _new_scales(values: Any) -> Optional[List[float]]:
    return None if values is None else [float(x) for x in np.asarray(values, dtype=np.float32).ravel()]


def step_message(regions: RegionTable, session: Any, layer: int, q: Any, k_new: Any, v_new: Any,
                 scale: float, return_lse: bool, window: Optional[Tuple[int, int]], out: Any,
                 lse_out: Any, k_new_scales: Any = None,
                 v_new_scales: Any = None) -> Tuple[_wire.Message, _tensors.OutputMaker, bool, bool, Optional[int]]:
    maker = _tensors.OutputMaker(q)
    ps, placed, device = _inputs(regions, q, k_new, v_new, ("q", "k_new", "v_new"))
    outputs, o_in, lse_in = _outputs(regions, out, lse_out)
    m = _wire.step_request(session_id_of(session), int(layer), ps[0], ps[1], ps[2], placed,
                           float(scale or 0.0), return_lse, _window(window), outputs,
                           k_new_scales=_new_scales(k_new_scales),
                           v_new_scales=_new_scales(v_new_scales))
    return m, maker, o_in, lse_in, device


def prepare_step(regions: RegionTable, session: Any, layer: int, q: Any, k_new: Any, v_new: Any,
                 scale: float, return_lse: bool, window: Optional[Tuple[int, int]], out: Any,
                 lse_out: Any, k_new_scales: Any = None, v_new_scales: Any = None,
                 joined: bool = True) -> Prepared:
    m, maker, o_in, lse_in, sync = step_message(regions, session, layer, q, k_new, v_new, scale,
                                                return_lse, window, out, lse_out, k_new_scales,
                                                v_new_scales)
    return Prepared(_message(m, joined), maker, out, lse_out, o_in, lse_in, sync)


def as_step_item(item: Any) -> StepItem:
    if isinstance(item, StepItem):
        return item
    if isinstance(item, dict):
        return StepItem(**item)
    return StepItem(*item)


def copies_of(error: Exception, n: int) -> List[Exception]:
    """error for each of n items of a call that failed as a whole (each its own copy)."""
    return [error] + [copy.copy(error) for _ in range(n - 1)]


def prepare_batch_step(regions: RegionTable, items: Sequence[Any]) -> Tuple[bytes, List[Prepared]]:
    """items as one BatchStep message, and how to read each item's answer."""
    (message, prepared), = prepare_batch_steps(regions, items, None)
    return message, prepared


def cut_by_size(items: Sequence[Any], size_of: Any, max_bytes: Optional[int],
                max_items: Optional[int] = None) -> List[List[Any]]:
    """items in order, cut where a part would pass max_bytes (summed size_of(item)) or max_items
    (None: no such bound); an item larger than max_bytes is a part of its own. A BatchStep's
    answer is never larger than its request (o has q's shape, lse 4 bytes per query head and
    token), so cutting requests this way bounds the answers as well."""
    parts: List[List[Any]] = []
    size = 0
    for item in items:
        n = size_of(item)
        if (not parts or (max_items is not None and len(parts[-1]) >= max_items) or
                (max_bytes is not None and size + n > max_bytes)):
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += n
    return parts


class CodedBatch:
    """The Prepared of a BatchStep's items that attnd._fast coded, as a sequence: made when first
    looked at (read_batch_step reads their answers from the plan, unless it must read it here).
    plan: per item (q, out, lse_out, o in a region, lse in a region, CUDA device or None, where
    attnd._fast may copy an output the answer holds); devices: the CUDA devices whose current
    stream is synchronized before the call."""

    __slots__ = ("plan", "devices", "_prepared")

    def __init__(self, plan: List[Tuple[Any, ...]], devices: Tuple[int, ...]):
        self.plan = plan
        self.devices = devices
        self._prepared: Optional[List[Prepared]] = None

    def prepared(self) -> List[Prepared]:
        if self._prepared is None:
            self._prepared = [Prepared(b"", _tensors.OutputMaker(q), out, lse_out, o_in, lse_in, dev)
                              for q, out, lse_out, o_in, lse_in, dev, _ in self.plan]
        return self._prepared

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Any:
        return iter(self.prepared())

    def __getitem__(self, i: Any) -> Any:
        return self.prepared()[i]


# (torch module or None, what attnd._fast.code_batch_step is told of the types it meets)
_fast_types: List[Any] = [False, None]


def _coded_fast(regions: RegionTable, items: Sequence[Any],
                max_bytes: Optional[int]) -> Optional[Tuple[bytes, CodedBatch]]:
    """items as one BatchStep message coded by attnd._fast, or None where it leaves them to the
    Python coding (see attnd/_fast.c)."""
    torch = _tensors._torch
    if _fast_types[0] is not torch:
        _fast_types[1] = (StepItem, np.ndarray, torch.Tensor if torch is not None else None,
                          _tensors._TORCH_CODES, as_step_item)
        _fast_types[0] = torch
    r = FAST.code_batch_step(items if type(items) is list else list(items), regions.specs(),
                             _fast_types[1], -1 if max_bytes is None else max_bytes)
    if r is None:
        return None
    return r[0], CodedBatch(r[1], r[2])


# A batch whose tensors pass this is cut into parts for several connections, none smaller.
MIN_SPREAD_PART_BYTES = 8 << 20


def prepare_batch_steps(regions: RegionTable, items: Sequence[Any], max_bytes: Optional[int],
                        spread: int = 1) -> List[Tuple[bytes, Any]]:
    """items as BatchStep messages in order, each of at most max_bytes of steps where it can be
    (cut_by_size; None: one message), with how to read each one's answer (a sequence of
    Prepared). spread > 1: a batch of more than MIN_SPREAD_PART_BYTES is cut into about that
    many parts of even size (not below MIN_SPREAD_PART_BYTES), to go over as many connections."""
    fast_max = max_bytes
    if spread > 1:
        fast_max = MIN_SPREAD_PART_BYTES if max_bytes is None else min(max_bytes,
                                                                       MIN_SPREAD_PART_BYTES)
    if FAST is not None and len(items) > 0:
        coded = _coded_fast(regions, items, fast_max)
        if coded is not None:
            return [coded]
    coded = []
    for raw in items:
        it = as_step_item(raw)
        m, maker, o_in, lse_in, sync = step_message(regions, it.session, it.layer, it.q, it.k_new,
                                                    it.v_new, it.scale, it.return_lse, it.window,
                                                    it.out, it.lse_out, it.k_new_scales,
                                                    it.v_new_scales)
        coded.append((m, Prepared(b"", maker, it.out, it.lse_out, o_in, lse_in, sync)))
    if spread > 1:
        even = max(-(-sum(c[0].size for c in coded) // spread), MIN_SPREAD_PART_BYTES)
        max_bytes = even if max_bytes is None else min(max_bytes, even)
    out = []
    for part in cut_by_size(coded, lambda c: c[0].size, max_bytes) or [[]]:
        m = _wire.batch_step_request([c[0] for c in part])
        out.append((_tensors.assemble(m.parts, m.size, m.cuda), [c[1] for c in part]))
    return out


def parts_go_at_once(items: Sequence[Any], parts: Sequence[Tuple[bytes, Any]],
                     spread: int) -> bool:
    """Whether a batch_step's parts (items cut in order into parts) are sent at once: there are
    several, spread over several connections, and no session has steps in two of them (steps of
    one session keep their order only within a call)."""
    if len(parts) < 2 or spread < 2:
        return False
    owner: Dict[str, int] = {}
    i = 0
    for index, (_, prepared) in enumerate(parts):
        for raw in items[i:i + len(prepared)]:
            if owner.setdefault(session_id_of(as_step_item(raw).session), index) != index:
                return False
        i += len(prepared)
    return True


def synchronize_inputs(prepared: Sequence[Prepared]) -> None:
    """cuda_synchronize for each device whose GPU regions hold some of these steps' inputs."""
    if type(prepared) is CodedBatch:
        for device in prepared.devices:
            cuda_synchronize(device)
        return
    for device in {p.cuda_sync for p in prepared if p.cuda_sync is not None}:
        cuda_synchronize(device)


def part_failed(error: Exception, parts: int, prepared: Sequence[Prepared]) -> List[Exception]:
    """A BatchStep call of a batch cut in `parts` calls failed as a whole: its items' outcomes
    (error for each). A batch sent in one call raises error instead, as a single call does."""
    if parts == 1:
        raise error
    return copies_of(error, len(prepared))


def prepare_echo(payload: Any, response_bytes: int) -> bytes:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        buf = payload
    elif _tensors.is_torch(payload):
        torch = _tensors._load_torch()
        buf = payload.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().data
    else:  # any numpy array: its bytes
        buf = np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data
    n = memoryview(buf).nbytes
    m = _wire.echo_request(buf, n, int(response_bytes))
    return _tensors.assemble(m.parts, m.size, m.cuda)


# ---- answers ------------------------------------------------------------------------------------


def _output(buf: bytes, view: Optional[_wire.TensorView], maker: _tensors.OutputMaker,
            dest: Any, in_region: bool, what: str) -> Any:
    if view is None:
        return None
    if in_region:
        if view.region is None:
            raise AttndError(f"the server sent {what} in the message where a region was asked for")
        return dest
    if view.region is not None:
        raise AttndError(f"the server wrote {what} into region '{view.region}', which this call "
                         "did not ask for")
    t = maker.tensor(view.dtype, view.shape, buf, view.start)
    if dest is None:
        return t
    _copy_into(dest, t, what)
    return dest


def _copy_into(dest: Any, src: Any, what: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise InvalidArgument(f"{what}_out has shape {tuple(dest.shape)}, the answer "
                              f"{tuple(src.shape)}")
    if _tensors.is_torch(dest):
        dest.copy_(src if _tensors.is_torch(src) else _tensors._load_torch().from_numpy(src))
    else:
        dest[...] = src


def read_attend(buf: bytes, p: Prepared) -> AttendResult:
    try:
        r = _wire.read_response(buf, None, step=False)
        if r.o is None:
            raise _wire.Malformed("it has no o")
        return AttendResult(_output(buf, r.o, p.maker, p.out, p.o_in_region, "o"),
                            _output(buf, r.lse, p.maker, p.lse_out, p.lse_in_region, "lse"),
                            r.timing, r.request_id)
    except _wire.Malformed as e:
        raise AttndError(f"the server's AttendResponse is malformed: {e}",
                         grpc.StatusCode.INTERNAL) from e


def _step_result(buf: bytes, r: _wire.Response, p: Prepared) -> StepResult:
    if r.o is None:
        raise _wire.Malformed("it has no o")
    return StepResult(_output(buf, r.o, p.maker, p.out, p.o_in_region, "o"),
                      _output(buf, r.lse, p.maker, p.lse_out, p.lse_in_region, "lse"),
                      r.cached_tokens, r.timing)


def read_step(buf: bytes, p: Prepared) -> StepResult:
    try:
        return _step_result(buf, _wire.read_response(buf, None, step=True), p)
    except _wire.Malformed as e:
        raise AttndError(f"the server's StepResponse is malformed: {e}",
                         grpc.StatusCode.INTERNAL) from e


def read_batch_step(buf: bytes, prepared: Sequence[Prepared]) -> List[Any]:
    """One StepResult or AttndError per item, in order."""
    if type(prepared) is CodedBatch:
        if FAST is not None and type(buf) is bytes:
            done = FAST.read_batch_step(buf, prepared.plan, StepResult, ServerTiming,
                                        _wire._EMPTY_TIMING, _answer_output, np.ndarray)
            if done is not None:  # read in one pass (else some output needs the reading below)
                results, failed = done
                if failed:
                    for i, r in enumerate(results):
                        if type(r) is tuple:
                            results[i] = error_for(status_code(r[0]), r[1])
                return results
        prepared = prepared.prepared()
    try:
        results = _wire.read_batch_step_response(buf)
        if len(results) != len(prepared):
            raise _wire.Malformed(f"{len(results)} results for {len(prepared)} items")
        out: List[Any] = []
        for (code, message, response), p in zip(results, prepared):
            if code != 0:
                out.append(error_for(status_code(code), message))
            elif response is None:
                raise _wire.Malformed("an item with status 0 has no response")
            else:
                out.append(_step_result(buf, response, p))
        return out
    except _wire.Malformed as e:
        raise AttndError(f"the server's BatchStepResponse is malformed: {e}",
                         grpc.StatusCode.INTERNAL) from e


def _answer_output(q: Any, code: int, shape: Tuple[int, ...], buf: bytes, start: int) -> Any:
    """An output the answer holds, for an item without out (attnd._fast.read_batch_step): made
    over buf as _output makes it."""
    return _tensors.OutputMaker(q).tensor(code, shape, buf, start)


def read_echo(buf: bytes) -> memoryview:
    start, end = _wire.read_echo_response(buf)
    return memoryview(buf)[start:end]


def session_info(response: Any, spec: Dict[str, Any]) -> SessionInfo:
    spec = dict(spec)
    spec["cache_dtype"] = getattr(response, "cache_dtype", 0) or spec.get("cache_dtype") or \
        spec["dtype"]
    return SessionInfo(session_id=response.session_id, replica_id=response.replica_id,
                       page_tokens=getattr(response, "page_tokens", 0),
                       ttl_seconds=getattr(response, "ttl_seconds", 0),
                       max_tokens=getattr(response, "max_tokens", 0), **spec)


def _scales(values: Any, name: str) -> Tuple[float, ...]:
    """Per-KV-head scales as floats: a sequence, or a numpy array / CPU torch tensor."""
    if values is None:
        return ()
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        return tuple(float(x) for x in values)
    except TypeError:
        raise InvalidArgument(f"{name} must be a sequence of floats, one per KV head") from None


def create_session_request(num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any,
                           max_tokens: int, cache_dtype: Any = None, k_scales: Any = None,
                           v_scales: Any = None) -> Tuple[Any, Dict[str, Any]]:
    """The CreateSessionRequest; cache_dtype "fp8_e4m3" (with k_scales and v_scales, one float per
    KV head each) asks for an FP8 cache that the server quantizes each step's k_new/v_new into."""
    code = _tensors.dtype_code(dtype)
    cache = _tensors.dtype_code(cache_dtype) if cache_dtype is not None else 0
    ks, vs = _scales(k_scales, "k_scales"), _scales(v_scales, "v_scales")
    request = _proto.CreateSessionRequest(num_layers=int(num_layers), num_kv_heads=int(num_kv_heads),
                                          head_dim=int(head_dim), dtype=code,
                                          max_tokens=int(max_tokens), cache_dtype=cache,
                                          k_scales=ks, v_scales=vs)
    spec = dict(num_layers=int(num_layers), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
                dtype=code, cache_dtype=cache or code, k_scales=ks, v_scales=vs)
    return request, spec


def stream_request(item: Any, index: int, regions: RegionTable, defaults: Dict[str, Any]) -> Prepared:
    """AttendStream item `index` (its request_id is index + 1)."""
    if isinstance(item, dict):
        item = AttendItem(**item)
    elif not isinstance(item, AttendItem):
        item = AttendItem(*item)
    opts = dict(defaults)
    for name in ("cu_seqlens_q", "cu_seqlens_k", "causal", "window", "scale", "return_lse",
                 "high_priority", *_FP8_OPTIONS):
        value = getattr(item, name)
        if value is not None:
            opts[name] = value
    fp8 = fp8_field(*(opts.pop(name) for name in _FP8_OPTIONS))
    return prepare_attend(regions, item.q, item.k, item.v, out=None, lse_out=None,
                          request_id=index + 1, fp8=fp8, **opts)


def read_stream_item(buf: bytes, prepared: Dict[int, Prepared]) -> Tuple[int, Any]:
    """(index, AttendResult or AttndError) of one AttendStream response."""
    try:
        r = _wire.read_response(buf, None, step=False)
    except _wire.Malformed as e:
        raise AttndError(f"the server's AttendResponse is malformed: {e}",
                         grpc.StatusCode.INTERNAL) from e
    index = r.request_id - 1
    p = prepared.pop(index, None)
    if p is None:
        raise AttndError(f"the server answered request_id {r.request_id}, which is not in flight",
                         grpc.StatusCode.INTERNAL)
    if r.status_code != 0:
        return index, error_for(status_code(r.status_code), r.status_message)
    if r.o is None:
        raise AttndError("the server's AttendResponse has no o", grpc.StatusCode.INTERNAL)
    return index, AttendResult(_output(buf, r.o, p.maker, None, False, "o"),
                               _output(buf, r.lse, p.maker, None, False, "lse"),
                               r.timing, r.request_id)


def fp8_field(q_descale: Any, k_descale: Any, v_descale: Any, o_dtype: Any) -> Optional[bytes]:
    """The serialized Fp8Attend of an Attend call, or None when it sets none of its fields."""
    if q_descale is None and k_descale is None and v_descale is None and o_dtype is None:
        return None
    m = _proto.Fp8Attend()
    for field, values in (("q_descale", q_descale), ("k_descale", k_descale),
                          ("v_descale", v_descale)):
        if values is not None:
            getattr(m, field).extend(float(x) for x in np.asarray(values, dtype=np.float32).ravel())
    if o_dtype is not None:
        m.o_dtype = _tensors.dtype_code(o_dtype)
    return m.SerializeToString()


# The FP8 options of an Attend (Client.attend's keywords of the same names).
_FP8_OPTIONS = ("q_descale", "k_descale", "v_descale", "o_dtype")


def attend_defaults(cu_seqlens_q: Any = None, cu_seqlens_k: Any = None, causal: bool = False,
                    window: Optional[Tuple[int, int]] = None, scale: float = 0.0,
                    return_lse: bool = False, high_priority: bool = False, q_descale: Any = None,
                    k_descale: Any = None, v_descale: Any = None,
                    o_dtype: Any = None) -> Dict[str, Any]:
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, causal=causal, window=window,
                scale=scale, return_lse=return_lse, high_priority=high_priority,
                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, o_dtype=o_dtype)


def cuda_synchronize(device: Optional[int]) -> None:
    """Makes the device work that wrote a call's inputs in GPU regions complete (attnd reads them
    from another process, outside any stream order of this one)."""
    if device is None:
        return
    torch = _tensors._load_torch()
    torch.cuda.current_stream(device).synchronize()


def iter_items(items: Iterable[Any]) -> Iterable[Tuple[int, Any]]:
    return enumerate(items)
