"""The synchronous client of attnd: ``Client`` and its ``Session``.

    import attnd, numpy as np
    client = attnd.Client("127.0.0.1:50051")
    q = np.random.randn(512, 16, 128).astype(np.float16)
    k = v = np.random.randn(512, 4, 128).astype(np.float16)
    o = client.attend(q, k, v, causal=True).o          # float16 [512, 16, 128]

Thread-safe: one Client may serve many threads (give it ``connections=N`` to spread them over N
HTTP/2 connections).
"""

from __future__ import annotations

import concurrent.futures
import inspect
import itertools
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from . import _core, _native, _proto, _wire
from ._core import (AttendResult, ClientOptions, PathOrPem, SessionInfo, StepResult,
                    TruncateResult)
from .errors import AttndError, BatchStepError, InvalidArgument, NotFound, from_rpc_error
from .prepared import BatchStepTemplate, PreparedBatchStep
from .regions import CudaRegion, HostRegion, Registered, RegionSocket, RegionTable, next_region_name

_INFO_TIMEOUT = 10.0


class _ChannelSet:
    """What the blocking and the asyncio client share: one channel (and its method table) per
    connection, taken round robin, the call metadata, the deadlines, and the region table."""

    options: ClientOptions

    def _open(self, secure_channel: Any, insecure_channel: Any) -> None:
        """Checks self.options and opens its connections with the given channel factories."""
        self.options.check()
        target = self.options.target
        creds = self.options.credentials()
        self._metadata = self.options.metadata()
        self._wait = True if self.options.wait_for_ready else None
        self._channels: List[Any] = []
        self._calls: List[Dict[str, Any]] = []
        for i in range(self.options.connections):
            args = self.options.channel_args(i)
            ch = secure_channel(target, creds, args) if creds is not None else \
                insecure_channel(target, args)
            self._channels.append(ch)
            self._calls.append(_callables(ch))
        self._turn = itertools.count()
        self.regions = RegionTable()
        self._region_socket: Optional[RegionSocket] = None

    def _methods(self) -> Dict[str, Any]:
        return self._calls[next(self._turn) % len(self._calls)]

    def _timeout(self, timeout: Optional[float], default: Optional[float] = None) -> Optional[float]:
        if timeout is not None:
            return timeout
        return self.options.timeout if default is None else min(
            default, self.options.timeout or default)


class Client(_ChannelSet):
    """A connection to one attnd (or to many behind one target with ``lb_policy="round_robin"``).

    Args:
        target: ``host:port``, ``dns:///name:port``, ``ipv4:a:p,b:p``, ``unix:/path``.
        tls: TLS with the system's root certificates (implied by any of the next three).
        tls_ca: the CA that signed attnd's certificate (PEM bytes or a path).
        tls_cert, tls_key: this client's certificate and key, for mTLS (PEM bytes or paths).
        tls_server_name: the name to check attnd's certificate against, when it is not the
            target's host.
        token: bearer token (sent as ``authorization: Bearer <token>``).
        timeout: default deadline of the calls that move tensors, in seconds (None: none);
            GetServerInfo, health and region calls wait at most 10 s unless told otherwise.
        retries: how many times a call that changes nothing on the server (Attend, Echo,
            GetServerInfo, health, ListRegions) is sent again after UNAVAILABLE, with exponential
            backoff from ``retry_backoff`` seconds, within its deadline. Steps and session calls
            are never resent.
        connections: HTTP/2 connections the calls are spread over, round robin (one connection
            moves about one core's worth of bytes; more help many threads).
        max_message_bytes: largest message sent or received (attnd's --max_message_bytes).
        wait_for_ready: calls wait for the connection (up to their deadline) instead of failing
            at once with UNAVAILABLE while attnd is unreachable.
        lb_policy: gRPC load-balancing policy, e.g. ``round_robin`` over every address of the target.
        channel_options: extra gRPC channel arguments, ``[(name, value), ...]``.
        transport: how Attend, Echo, Step and BatchStep go out: ``"native"`` through the C++
            client library (libattn_client_c.so; a blocking call then costs what the C++
            client's does, where grpcio's can cost several times that), ``"grpcio"``, or
            ``"auto"`` (native where the library loads and takes the settings: channel options
            must be integers). Default: $ATTND_TRANSPORT, else auto. ``client.transport`` says
            which one is in use, ``client.transport_note`` why not native. The other calls, and
            attend_stream, always use grpcio (grpc.aio in the asyncio client).
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, tls: bool = False,
                 tls_ca: PathOrPem = None, tls_cert: PathOrPem = None, tls_key: PathOrPem = None,
                 tls_server_name: Optional[str] = None, token: Optional[str] = None,
                 timeout: Optional[float] = None, retries: int = 3, retry_backoff: float = 0.05,
                 connections: int = 1, max_message_bytes: int = 256 << 20,
                 wait_for_ready: bool = False, lb_policy: Optional[str] = None,
                 channel_options: Sequence[Tuple[str, Any]] = (),
                 transport: Optional[str] = None):
        self.options = ClientOptions(
            target=target, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
            tls_server_name=tls_server_name, token=token, timeout=timeout, retries=retries,
            retry_backoff=retry_backoff, connections=connections,
            max_message_bytes=max_message_bytes, wait_for_ready=wait_for_ready,
            lb_policy=lb_policy, channel_options=tuple(channel_options), transport=transport)
        self._senders: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._senders_lock = threading.Lock()
        self._open(grpc.secure_channel, grpc.insecure_channel)
        self._native: Optional[_native.NativeChannel] = None
        self.transport, self.transport_note = self._open_native()
        self._region_lock = threading.Lock()

    def _open_native(self) -> Tuple[str, str]:
        """The native transport where asked for and possible: ("native" or "grpcio", and why
        not native when it is not)."""
        try:
            lib, pairs, why = _native.decide(self.options)
            if lib is None:
                return "grpcio", why
            self._native = _native.NativeChannel(lib, pairs)
        except InvalidArgument:
            self.close()
            raise
        return "native", ""

    # ---- plumbing -------------------------------------------------------------------------------

    def _unary(self, method: str, request: Any, timeout: Optional[float]) -> Any:
        """A unary call with retries of UNAVAILABLE for the calls that change nothing. request:
        a message's bytes, a protobuf message, or (Attend and Step on the native transport, as
        _core.prepare_* leave large ones) a _wire.Message sent part by part."""
        native = self._native if method in _native.METHODS else None
        call = None if native is not None else self._methods()[method]
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                if native is not None:
                    if type(request) is _wire.Message:
                        return native.call_parts(method, request.parts, left)
                    return native.call(method, request, left)
                return call(request, timeout=left, metadata=self._metadata,
                            wait_for_ready=self._wait)
            except (grpc.RpcError, _native.CallError) as e:
                if (e.code() == grpc.StatusCode.UNAVAILABLE and method in _core.IDEMPOTENT and
                        attempt < self.options.retries):
                    attempt += 1
                    pause = _core.backoff(self.options, attempt)
                    if deadline is None or time.monotonic() + pause < deadline:
                        time.sleep(pause)
                        continue
                raise from_rpc_error(e) from None

    def close(self) -> None:
        """Closes the connections (and the region socket: attnd drops this client's regions)."""
        if self._region_socket is not None:
            self._region_socket.close()
            self._region_socket = None
        if self._native is not None:  # kept: its calls now fail with CANCELLED, "closed"
            self._native.close()
        for ch in self._channels:
            ch.close()
        if self._senders is not None:
            self._senders.shutdown(wait=True)
            self._senders = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- stateless attention --------------------------------------------------------------------

    def attend(self, q: Any, k: Any, v: Any, *, cu_seqlens_q: Optional[Sequence[int]] = None,
               cu_seqlens_k: Optional[Sequence[int]] = None, causal: bool = False,
               window: Optional[Tuple[int, int]] = None, scale: float = 0.0,
               return_lse: bool = False, high_priority: bool = False, out: Any = None,
               lse_out: Any = None, timeout: Optional[float] = None, q_descale: Any = None,
               k_descale: Any = None, v_descale: Any = None,
               o_dtype: Any = None) -> AttendResult:
        """Attention over a packed varlen batch (attn.v1 Attend).

        Args:
            q: [total_q, heads, head_dim]; k, v: [total_k, kv_heads, head_dim]; numpy arrays or
                torch tensors (CPU or CUDA) of float32, float16 or bfloat16, all of one dtype; or k
                and v (and q too) of FP8 E4M3 codes (numpy uint8, torch.float8_e4m3fn on the CPU)
                with their descales q_descale, k_descale, v_descale (1 value per tensor or
                [batch, num_kv_heads]) and, for FP8 q, o_dtype ("float16" or "bfloat16"); see
                attention.proto's Fp8Attend.
            cu_seqlens_q, cu_seqlens_k: cumulative lengths [batch + 1] (None: one sequence).
            causal: causal mask, aligned bottom-right.
            window: sliding window (left, right); -1 leaves a side unbounded.
            scale: softmax scale (0: 1/sqrt(head_dim)).
            return_lse: also return the log-sum-exp, float32 [heads, total_q].
            high_priority: batched before normal requests.
            out, lse_out: write o (and lse) here: in place when they lie in a registered region
                (required for GPU regions), else copied from the answer.
            timeout: deadline in seconds (default: the client's).

        Returns:
            AttendResult(o, lse, timing, request_id); o is a numpy array (read-only, a view of the
            received message) when q is one, a torch tensor on q's device when q is one.

        Raises:
            AttndError (InvalidArgument, ResourceExhausted, ...) with attnd's message.
        """
        p = _core.prepare_attend(self.regions, q, k, v, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, causal=causal, window=window,
                                 scale=scale, return_lse=return_lse, high_priority=high_priority,
                                 out=out, lse_out=lse_out,
                                 fp8=_core.fp8_field(q_descale, k_descale, v_descale, o_dtype),
                                 joined=self._native is None)
        _core.cuda_synchronize(p.cuda_sync)
        buf = self._unary("Attend", p.message, self._timeout(timeout))
        return _core.read_attend(buf, p)

    def attend_stream(self, items: Iterable[Any], *, depth: int = 8, ordered: bool = True,
                      return_exceptions: bool = False, timeout: Optional[float] = None,
                      **defaults: Any) -> Iterator[Any]:
        """Many Attends pipelined on one AttendStream, up to `depth` in flight.

        Args:
            items: AttendItem(q, k, v, ...), (q, k, v) tuples or dicts of attend's arguments.
            depth: requests in flight at once.
            ordered: yield results in the order of items (else as they come; each result's
                request_id is its item's index + 1).
            return_exceptions: yield a failed item's AttndError in its place instead of raising
                it (a bad item does not end the stream on the server).
            defaults: attend's options (causal=..., return_lse=..., and for FP8 tensors
                q_descale=..., k_descale=..., v_descale=..., o_dtype=...) for items that do not
                set them.

        Yields:
            AttendResult per item.
        """
        if depth < 1:
            raise InvalidArgument(f"depth must be >= 1, got {depth}")
        base = _core.attend_defaults(**defaults)
        slots = threading.Semaphore(depth)
        lock = threading.Lock()
        prepared: Dict[int, _core.Prepared] = {}
        state = {"error": None, "stop": False}

        def requests() -> Iterator[bytes]:
            try:
                for index, item in enumerate(items):
                    slots.acquire()
                    if state["stop"]:
                        return
                    p = _core.stream_request(item, index, self.regions, base)
                    _core.cuda_synchronize(p.cuda_sync)
                    with lock:
                        prepared[index] = p
                    yield p.message
            except Exception as e:  # reported to the caller once the answers are in
                state["error"] = e

        call = self._methods()["AttendStream"](requests(), timeout=self._timeout(timeout),
                                               metadata=self._metadata, wait_for_ready=self._wait)
        waiting: Dict[int, Any] = {}
        next_index = 0
        try:
            for buf in call:
                with lock:
                    index, result = _core.read_stream_item(buf, prepared)
                slots.release()
                if not ordered:
                    yield _deliver(result, return_exceptions)
                    continue
                waiting[index] = result
                while next_index in waiting:
                    yield _deliver(waiting.pop(next_index), return_exceptions)
                    next_index += 1
            if state["error"] is not None:
                raise state["error"]
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            state["stop"] = True
            slots.release()
            call.cancel()

    def echo(self, payload: Any, response_bytes: int = 0,
             timeout: Optional[float] = None) -> memoryview:
        """Sends payload (bytes, or a numpy array / torch tensor's bytes) through Echo and returns
        what came back (all of it, or its first response_bytes) as a view of the received message."""
        buf = self._unary("Echo", _core.prepare_echo(payload, response_bytes),
                          self._timeout(timeout))
        return _core.read_echo(buf)

    def info(self, timeout: Optional[float] = None) -> Any:
        """GetServerInfo: version, backend, device, limits, KV cache, replica id (a protobuf
        message, attn.v1.GetServerInfoResponse)."""
        return self._unary("GetServerInfo", _proto.GetServerInfoRequest(),
                           self._timeout(timeout, _INFO_TIMEOUT))

    def health(self, service: str = "", timeout: Optional[float] = None) -> bool:
        """grpc.health.v1 Check: True when SERVING."""
        response = self._unary("Check", _proto.HealthCheckRequest(service=service),
                               self._timeout(timeout, _INFO_TIMEOUT))
        return response.status == _proto.HealthCheckResponse.SERVING

    # ---- sessions -------------------------------------------------------------------------------

    def create_session(self, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: Any = "bfloat16", max_tokens: int = 0,
                       timeout: Optional[float] = None, *, cache_dtype: Any = None,
                       k_scales: Any = None, v_scales: Any = None) -> "Session":
        """Creates a KV-cache session (its cache in float16 or bfloat16) on this attnd.

        cache_dtype="fp8_e4m3" with k_scales and v_scales (one float per KV head each) keeps the
        cache in FP8 E4M3: the server quantizes each step's k_new/v_new to E4M3(x / scale),
        saturating to +-448; q and o stay in dtype."""
        request, spec = _core.create_session_request(num_layers, num_kv_heads, head_dim, dtype,
                                                     max_tokens, cache_dtype, k_scales, v_scales)
        response = self._unary("CreateSession", request, self._timeout(timeout))
        return Session(self, _core.session_info(response, spec))

    def session(self, session_id: str) -> "Session":
        """A Session object for an existing session id (made by another process, say)."""
        return Session(self, SessionInfo(session_id=session_id,
                                         replica_id=session_id.rsplit(".", 1)[0]))

    def step(self, session: Any, layer: int, q: Any, k_new: Any, v_new: Any, *, scale: float = 0.0,
             return_lse: bool = False, window: Optional[Tuple[int, int]] = None, out: Any = None,
             lse_out: Any = None, timeout: Optional[float] = None, k_new_scales: Any = None,
             v_new_scales: Any = None) -> StepResult:
        """One step of one layer (attn.v1 Step): appends k_new and v_new to the layer's cache and
        returns attention of q over all of it (causal inside the new tokens). session: a Session
        or its id. q [new_tokens, heads, d], k_new and v_new [new_tokens, kv_heads, d] in the
        session's dtype; or, for an FP8 cache, k_new and v_new as E4M3 codes (numpy uint8 or
        torch.float8_e4m3fn on the CPU) quantized with the session's scales, sent as
        k_new_scales and v_new_scales (they must equal the session's). Not resent on
        UNAVAILABLE (a step changes the cache)."""
        native = self._native
        if (native is not None and out is None and lse_out is None and k_new_scales is None and
                v_new_scales is None and not self.regions.entries):
            try:
                done = native.step(_core.session_id_of(session), int(layer), q, k_new, v_new,
                                   float(scale or 0.0), return_lse, _core._window(window),
                                   self._timeout(timeout))
            except _native.CallError as e:
                raise from_rpc_error(e) from None
            if done is not None:
                return StepResult(*done)
        p = _core.prepare_step(self.regions, session, layer, q, k_new, v_new, scale, return_lse,
                               window, out, lse_out, k_new_scales, v_new_scales,
                               joined=native is None)
        _core.cuda_synchronize(p.cuda_sync)
        buf = self._unary("Step", p.message, self._timeout(timeout))
        return _core.read_step(buf, p)

    def batch_step(self, items: Sequence[Any], *, timeout: Optional[float] = None,
                   return_exceptions: bool = False) -> List[Any]:
        """Many steps of one or many sessions in one call, computed together (attn.v1 BatchStep).

        items: StepItem(session, layer, q, k_new, v_new, ...) or tuples in that order. Returns a
        StepResult per item. Items succeed or fail on their own: a failed item raises
        BatchStepError (whose ``results`` hold every item's outcome) unless return_exceptions,
        in which case its AttndError takes its place in the list. Items whose tensors together
        pass half of max_message_bytes go in several calls; a call of those that fails fails its
        own items only (each gets the call's error). With connections=N, a batch of more than
        8 MiB of tensors is cut into about N calls sent at once over the N connections, where no
        session has steps in two of them; otherwise the calls go one after the other, in order.
        """
        spread = self.options.connections
        parts = _core.prepare_batch_steps(self.regions, items, self.options.max_message_bytes // 2,
                                          spread)
        for _, prepared in parts:
            _core.synchronize_inputs(prepared)

        def send(part: Tuple[Any, Any]) -> List[Any]:
            try:
                buf = self._unary("BatchStep", part[0], self._timeout(timeout))
            except AttndError as e:
                return _core.part_failed(e, len(parts), part[1])
            return _core.read_batch_step(buf, part[1])

        if _core.parts_go_at_once(items, parts, spread):
            answers = list(self._part_senders().map(send, parts))
        else:
            answers = [send(part) for part in parts]
        results = [r for answer in answers for r in answer]
        if not return_exceptions and any(isinstance(r, AttndError) for r in results):
            raise BatchStepError(results)
        return results

    def _part_senders(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads that send the parts of a large BatchStep at once (one per connection)."""
        with self._senders_lock:
            if self._senders is None:
                self._senders = concurrent.futures.ThreadPoolExecutor(
                    self.options.connections, thread_name_prefix="attnd-batch-step")
            return self._senders

    def prepare_batch_step(self, items: Sequence[Any]) -> PreparedBatchStep:
        """A BatchStep of these items coded once, to send many times (a decode loop): each item's
        q, k_new, v_new and out (and lse_out with return_lse) must lie in a region registered
        with this client, and stay there; only the layer changes from call to call
        (``prepared.step(layer)``). The answers and errors are those of batch_step. See
        attnd.prepared."""
        return PreparedBatchStep(self, BatchStepTemplate(self.regions, items))

    def truncate_session(self, session_id: str, tokens: int,
                         timeout: Optional[float] = None) -> TruncateResult:
        response = self._unary("TruncateSession",
                               _proto.TruncateSessionRequest(session_id=session_id, tokens=int(tokens)),
                               self._timeout(timeout))
        return TruncateResult(list(response.cached_tokens), response.freed_pages)

    def fork_session(self, session_id: str, timeout: Optional[float] = None) -> SessionInfo:
        response = self._unary("ForkSession", _proto.ForkSessionRequest(session_id=session_id),
                               self._timeout(timeout))
        return SessionInfo(session_id=response.session_id, replica_id=response.replica_id)

    def close_session(self, session_id: str, timeout: Optional[float] = None) -> int:
        response = self._unary("CloseSession", _proto.CloseSessionRequest(session_id=session_id),
                               self._timeout(timeout))
        return response.freed_pages

    # ---- shared memory --------------------------------------------------------------------------

    def list_regions(self, timeout: Optional[float] = None) -> Any:
        """ListRegions: this client identity's regions, the socket path and the limits."""
        return self._unary("ListRegions", _proto.ListRegionsRequest(),
                           self._timeout(timeout, _INFO_TIMEOUT))

    def _socket(self) -> RegionSocket:
        with self._region_lock:
            if self._region_socket is None:
                self._region_socket = RegionSocket(self.list_regions().socket_path)
            return self._region_socket

    def register_region(self, region: Any, name: Optional[str] = None,
                        timeout: Optional[float] = None) -> str:
        """Registers a HostRegion or CudaRegion with attnd (once; then any tensor inside it travels
        by reference). Returns the region's name. The registration lasts while this client is
        open: attnd drops it when the client closes or the process exits."""
        name = name or next_region_name()
        sock = self._socket()
        if isinstance(region, HostRegion):
            request = _proto.RegisterRegionRequest(name=name, kind=_proto.RegionKind["REGION_KIND_HOST"],
                                                   handle=sock.send_fd(region.fd))
        elif isinstance(region, CudaRegion):
            request = _proto.RegisterRegionRequest(
                name=name, kind=_proto.RegionKind["REGION_KIND_CUDA"], handle=sock.lease(),
                cuda_ipc_handle=region.ipc_handle, device_id=region.cuda_device,
                bytes=region.nbytes)
        else:
            raise TypeError(f"expected a HostRegion or CudaRegion, got {type(region).__name__}")
        self._unary("RegisterRegion", request, self._timeout(timeout, _INFO_TIMEOUT))
        self.regions.add(Registered(name, region))
        return name

    def unregister_region(self, region: Any, timeout: Optional[float] = None) -> None:
        """Unregisters a region (by object or name)."""
        names = [e.name for e in self.regions.entries if e.region is region or e.name == region]
        if not names:
            raise NotFound(f"region {region!r} is not registered by this client")
        for name in names:
            self.regions.remove(name)
            self._unary("UnregisterRegion", _proto.UnregisterRegionRequest(name=name),
                        self._timeout(timeout, _INFO_TIMEOUT))


def _deliver(result: Any, return_exceptions: bool) -> Any:
    if isinstance(result, AttndError) and not return_exceptions:
        raise result
    return result


def _registered(ch: Any) -> Dict[str, Any]:
    """grpcio >= 1.63 registers a method with the channel once (`_registered_method`), which saves
    work on every call; older ones do not take the argument."""
    try:
        params = inspect.signature(ch.unary_unary).parameters
    except (TypeError, ValueError):
        return {}
    return {"_registered_method": True} if "_registered_method" in params else {}


def _callables(ch: grpc.Channel) -> Dict[str, Any]:
    raw = _wire.identity
    reg = _registered(ch)
    out: Dict[str, Any] = {}
    for name in ("Attend", "Step", "BatchStep", "Echo"):
        out[name] = ch.unary_unary(_proto.ATTENTION[name], request_serializer=raw,
                                   response_deserializer=raw, **reg)
    out["AttendStream"] = ch.stream_stream(_proto.ATTENTION["AttendStream"], request_serializer=raw,
                                           response_deserializer=raw, **reg)
    typed = (("CreateSession", _proto.ATTENTION, _proto.CreateSessionResponse),
             ("TruncateSession", _proto.ATTENTION, _proto.TruncateSessionResponse),
             ("ForkSession", _proto.ATTENTION, _proto.ForkSessionResponse),
             ("CloseSession", _proto.ATTENTION, _proto.CloseSessionResponse),
             ("GetServerInfo", _proto.ATTENTION, _proto.GetServerInfoResponse),
             ("RegisterRegion", _proto.SHARED_MEMORY, _proto.RegisterRegionResponse),
             ("UnregisterRegion", _proto.SHARED_MEMORY, _proto.UnregisterRegionResponse),
             ("ListRegions", _proto.SHARED_MEMORY, _proto.ListRegionsResponse),
             ("Check", _proto.HEALTH, _proto.HealthCheckResponse))
    for name, paths, response in typed:
        out[name] = ch.unary_unary(paths[name], request_serializer=_serialize,
                                   response_deserializer=response.FromString, **reg)
    return out


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


class Session:
    """A KV-cache session on one attnd: its per-layer caches live there; each step sends only the
    new tokens. A context manager: leaving the ``with`` block closes it.

    Attributes: ``id``, ``info`` (SessionInfo: replica, page tokens, TTL, token limit, shape).
    """

    def __init__(self, client: Client, info: SessionInfo):
        self.client = client
        self.info = info
        self.closed = False

    @property
    def id(self) -> str:
        return self.info.session_id

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def step(self, layer: int, q: Any, k_new: Any, v_new: Any, **options: Any) -> StepResult:
        """One step of one layer; see Client.step for the options."""
        return self.client.step(self, layer, q, k_new, v_new, **options)

    def truncate(self, tokens: int, timeout: Optional[float] = None) -> TruncateResult:
        """Drops the last `tokens` tokens of every layer (rejected draft tokens)."""
        return self.client.truncate_session(self.id, tokens, timeout)

    def fork(self, timeout: Optional[float] = None) -> "Session":
        """A new session sharing this one's cache as it is now (copy-on-write)."""
        forked = self.client.fork_session(self.id, timeout)
        info = SessionInfo(**{**self.info.__dict__, "session_id": forked.session_id,
                              "replica_id": forked.replica_id or self.info.replica_id})
        return Session(self.client, info)

    def close(self, timeout: Optional[float] = None) -> int:
        """Closes the session; returns the KV pages freed. Closing twice is a no-op."""
        if self.closed:
            return 0
        freed = self.client.close_session(self.id, timeout)
        self.closed = True
        return freed

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.closed:
            try:
                self.close()
            except NotFound:  # expired meanwhile: nothing left to free
                self.closed = True
