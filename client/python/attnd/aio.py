"""The asyncio client of attnd, on grpc.aio: the surface of attnd.Client with coroutines.

    import asyncio, attnd.aio
    async def main():
        async with attnd.aio.Client("127.0.0.1:50051") as client:
            results = await asyncio.gather(*(client.attend(q, k, v) for _ in range(64)))
    asyncio.run(main())

One Client belongs to one event loop (grpc.aio's rule); any number of calls may be in flight.

Attend, Echo, Step and BatchStep go through the C++ client library where it loads (the native
transport, as for attnd.Client; ``transport=`` chooses): each call starts on the library's
completion queue and the loop reads its answer when it completes, without grpc.aio's cost per call,
and coalesced steps of numpy arrays are coded and read by the library.

Steps issued in the same turn of the event loop (64 sessions' coroutines each awaiting
``client.step``, say) go to attnd together in BatchSteps, where each keeps its own result or
error: 4 calls of 16 steps instead of 64 Step calls (``coalesce_steps=False`` sends each as a
Step). A BatchStep carries at most ``max_coalesced_steps`` steps (16 by default: several calls in
flight let the loop work on the answers of one while attnd computes the others; one call of all
64 made each turn wait for its whole round trip, 0.55x the steps/s of 16 on an H100 host) and
``max_coalesced_bytes`` of tensors (and never more than half of ``max_message_bytes``):
concurrent prefills go in several calls rather than in one message too large to send or answer.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

import numpy as np

from . import _core, _native, _proto, _tensors, _wire
from ._core import (AttendResult, ClientOptions, PathOrPem, SessionInfo, StepResult,
                    TruncateResult)
from .client import _ChannelSet, _deliver
from .errors import AttndError, BatchStepError, InvalidArgument, NotFound, from_rpc_error
from .prepared import AsyncPreparedBatchStep, BatchStepTemplate
from .regions import CudaRegion, HostRegion, Registered, RegionSocket, next_region_name

_INFO_TIMEOUT = 10.0


class Client(_ChannelSet):
    """asyncio twin of attnd.Client (same arguments and methods, as coroutines), and:

    Args:
        transport: as attnd.Client's (``"native"``, ``"grpcio"`` for grpc.aio, or ``"auto"``).
        coalesce_steps: steps asked for in one turn of the event loop travel together in
            BatchSteps (False: one Step call each).
        max_coalesced_steps, max_coalesced_bytes: the most steps, and request bytes, one such
            BatchStep carries (bytes: at most half of max_message_bytes either way).
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, tls: bool = False,
                 tls_ca: PathOrPem = None, tls_cert: PathOrPem = None, tls_key: PathOrPem = None,
                 tls_server_name: Optional[str] = None, token: Optional[str] = None,
                 timeout: Optional[float] = None, retries: int = 3, retry_backoff: float = 0.05,
                 connections: int = 1, max_message_bytes: int = 256 << 20,
                 wait_for_ready: bool = False, lb_policy: Optional[str] = None,
                 channel_options: Sequence[Tuple[str, Any]] = (), coalesce_steps: bool = True,
                 max_coalesced_steps: int = 16, max_coalesced_bytes: int = 32 << 20,
                 transport: Optional[str] = None):
        self.options = ClientOptions(
            target=target, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
            tls_server_name=tls_server_name, token=token, timeout=timeout, retries=retries,
            retry_backoff=retry_backoff, connections=connections,
            max_message_bytes=max_message_bytes, wait_for_ready=wait_for_ready,
            lb_policy=lb_policy, channel_options=tuple(channel_options), transport=transport)
        self._open(grpc.aio.secure_channel, grpc.aio.insecure_channel)
        # The native transport's library and settings; its channel is opened by the first call,
        # on the loop that runs it.
        self._native_lib, self._native_pairs, self.transport_note = _native.decide(self.options)
        self.transport = "native" if self._native_lib is not None else "grpcio"
        self._native: Optional[_native.AsyncNativeChannel] = None
        self._steps = (_StepCoalescer(self, max_coalesced_steps,
                                      min(max_coalesced_bytes, max_message_bytes // 2))
                       if coalesce_steps else None)

    def _native_channel(self) -> Optional[_native.AsyncNativeChannel]:
        if self._native is None and self._native_lib is not None:
            self._native = _native.AsyncNativeChannel(self._native_lib, self._native_pairs,
                                                      asyncio.get_running_loop())
        return self._native

    async def _unary(self, method: str, request: Any, timeout: Optional[float]) -> Any:
        """A unary call with retries of UNAVAILABLE for the calls that change nothing; request as
        for attnd.Client._unary."""
        native = self._native_channel() if method in _native.METHODS else None
        call = None if native is not None else self._methods()[method]
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                if native is not None:
                    parts = request.parts if type(request) is _wire.Message else [request]
                    return await native.call_parts(method, parts, left)
                return await call(request, timeout=left, metadata=self._metadata,
                                  wait_for_ready=self._wait)
            except (grpc.RpcError, _native.CallError) as e:
                if (e.code() == grpc.StatusCode.UNAVAILABLE and method in _core.IDEMPOTENT and
                        attempt < self.options.retries):
                    attempt += 1
                    pause = _core.backoff(self.options, attempt)
                    if deadline is None or time.monotonic() + pause < deadline:
                        await asyncio.sleep(pause)
                        continue
                raise from_rpc_error(e) from None

    async def close(self) -> None:
        if self._steps is not None:
            await self._steps.drain()
        if self._native is not None:
            await self._native.close()
        self._native_lib = None  # later calls go to the closed channels and fail
        if self._region_socket is not None:
            self._region_socket.close()
            self._region_socket = None
        for ch in self._channels:
            await ch.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- stateless attention --------------------------------------------------------------------

    async def attend(self, q: Any, k: Any, v: Any, *, cu_seqlens_q: Optional[Sequence[int]] = None,
                     cu_seqlens_k: Optional[Sequence[int]] = None, causal: bool = False,
                     window: Optional[Tuple[int, int]] = None, scale: float = 0.0,
                     return_lse: bool = False, high_priority: bool = False, out: Any = None,
                     lse_out: Any = None, timeout: Optional[float] = None, q_descale: Any = None,
                     k_descale: Any = None, v_descale: Any = None,
                     o_dtype: Any = None) -> AttendResult:
        """See attnd.Client.attend (FP8 tensors with their descales included)."""
        p = _core.prepare_attend(self.regions, q, k, v, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, causal=causal, window=window,
                                 scale=scale, return_lse=return_lse, high_priority=high_priority,
                                 out=out, lse_out=lse_out,
                                 fp8=_core.fp8_field(q_descale, k_descale, v_descale, o_dtype),
                                 joined=self.transport != "native")
        _core.cuda_synchronize(p.cuda_sync)
        buf = await self._unary("Attend", p.message, self._timeout(timeout))
        return _core.read_attend(buf, p)

    async def attend_stream(self, items: Any, *, depth: int = 8, ordered: bool = True,
                            return_exceptions: bool = False, timeout: Optional[float] = None,
                            **defaults: Any) -> AsyncIterator[Any]:
        """See attnd.Client.attend_stream; items may be an iterable or an async iterable."""
        if depth < 1:
            raise InvalidArgument(f"depth must be >= 1, got {depth}")
        base = _core.attend_defaults(**defaults)
        slots = asyncio.Semaphore(depth)
        prepared: Dict[int, _core.Prepared] = {}
        call = self._methods()["AttendStream"](timeout=self._timeout(timeout),
                                               metadata=self._metadata, wait_for_ready=self._wait)
        failure: List[BaseException] = []

        async def write() -> None:
            try:
                index = 0
                async for item in _aiter(items):
                    await slots.acquire()
                    p = _core.stream_request(item, index, self.regions, base)
                    _core.cuda_synchronize(p.cuda_sync)
                    prepared[index] = p
                    await call.write(p.message)
                    index += 1
                await call.done_writing()
            except asyncio.CancelledError:
                raise
            except grpc.RpcError:
                pass  # the call failed: the reader reports its status
            except Exception as e:
                failure.append(e)
                await call.done_writing()

        writer = asyncio.ensure_future(write())
        waiting: Dict[int, Any] = {}
        next_index = 0
        try:
            while True:
                buf = await call.read()
                if buf is grpc.aio.EOF:
                    break
                index, result = _core.read_stream_item(buf, prepared)
                slots.release()
                if not ordered:
                    yield _deliver(result, return_exceptions)
                    continue
                waiting[index] = result
                while next_index in waiting:
                    yield _deliver(waiting.pop(next_index), return_exceptions)
                    next_index += 1
            await writer
            if failure:
                raise failure[0]
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            if not writer.done():
                writer.cancel()
            call.cancel()

    async def echo(self, payload: Any, response_bytes: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        buf = await self._unary("Echo", _core.prepare_echo(payload, response_bytes),
                                self._timeout(timeout))
        return _core.read_echo(buf)

    async def info(self, timeout: Optional[float] = None) -> Any:
        return await self._unary("GetServerInfo", _proto.GetServerInfoRequest(),
                                 self._timeout(timeout, _INFO_TIMEOUT))

    async def health(self, service: str = "", timeout: Optional[float] = None) -> bool:
        response = await self._unary("Check", _proto.HealthCheckRequest(service=service),
                                     self._timeout(timeout, _INFO_TIMEOUT))
        return response.status == _proto.HealthCheckResponse.SERVING

    # ---- sessions -------------------------------------------------------------------------------

    async def create_session(self, num_layers: int, num_kv_heads: int, head_dim: int,
                             dtype: Any = "bfloat16", max_tokens: int = 0,
                             timeout: Optional[float] = None, *, cache_dtype: Any = None,
                             k_scales: Any = None, v_scales: Any = None) -> "Session":
        request, spec = _core.create_session_request(num_layers, num_kv_heads, head_dim, dtype,
                                                     max_tokens, cache_dtype, k_scales, v_scales)
        response = await self._unary("CreateSession", request, self._timeout(timeout))
        return Session(self, _core.session_info(response, spec))

    def session(self, session_id: str) -> "Session":
        return Session(self, SessionInfo(session_id=session_id,
                                         replica_id=session_id.rsplit(".", 1)[0]))

    async def step(self, session: Any, layer: int, q: Any, k_new: Any, v_new: Any, *,
                   scale: float = 0.0, return_lse: bool = False,
                   window: Optional[Tuple[int, int]] = None, out: Any = None, lse_out: Any = None,
                   timeout: Optional[float] = None, k_new_scales: Any = None,
                   v_new_scales: Any = None) -> StepResult:
        """See attnd.Client.step (steps of one turn of the event loop travel as one BatchStep
        unless the client was made with coalesce_steps=False)."""
        # Plain numpy steps on the native transport are coded and read by the library.
        spec = None
        if (self.transport == "native" and out is None and lse_out is None and
                k_new_scales is None and v_new_scales is None and not self.regions.entries and
                _native_arrays(q, k_new, v_new)):
            left, right = (-1, -1) if window is None else _core._window(window)
            sid = session if isinstance(session, str) else session.id
            spec = (sid.encode(), int(layer), q, k_new, v_new, float(scale or 0.0),
                    bool(return_lse), left, right)
        if self._steps is not None:
            if spec is not None:
                coded = functools.partial(self._coded_step, session, layer, q, k_new, v_new,
                                          scale, return_lse, window)
                item = _Pending(q.nbytes + k_new.nbytes + v_new.nbytes, coded, spec, q)
            else:
                item = _Pending.of(*self._coded_step(session, layer, q, k_new, v_new, scale,
                                                     return_lse, window, out, lse_out,
                                                     k_new_scales, v_new_scales))
            return await self._steps.add(item, self.options.timeout if timeout is None else
                                         timeout)
        native = self._native_channel() if spec is not None else None
        if native is not None:
            try:
                results = await native.batch_step([spec], [q], self._timeout(timeout), single=True)
            except _native.CallError as e:
                raise from_rpc_error(e) from None
            if results is not None:  # None: the library does not take these tensors
                if isinstance(results[0], _native.CallError):
                    raise from_rpc_error(results[0])
                return StepResult(*results[0])
        p = _core.prepare_step(self.regions, session, layer, q, k_new, v_new, scale, return_lse,
                               window, out, lse_out, k_new_scales, v_new_scales,
                               joined=self.transport != "native")
        _core.cuda_synchronize(p.cuda_sync)
        buf = await self._unary("Step", p.message, self._timeout(timeout))
        return _core.read_step(buf, p)

    def _coded_step(self, session: Any, layer: int, q: Any, k_new: Any, v_new: Any, scale: float,
                    return_lse: bool, window: Optional[Tuple[int, int]], out: Any = None,
                    lse_out: Any = None, k_new_scales: Any = None,
                    v_new_scales: Any = None) -> Tuple[Any, _core.Prepared]:
        """A step's StepRequest message coded here (its parts) and how to read its answer."""
        m, maker, o_in, lse_in, device = _core.step_message(
            self.regions, session, layer, q, k_new, v_new, scale, return_lse, window, out,
            lse_out, k_new_scales, v_new_scales)
        return m, _core.Prepared(b"", maker, out, lse_out, o_in, lse_in, device)

    async def batch_step(self, items: Sequence[Any], *, timeout: Optional[float] = None,
                         return_exceptions: bool = False) -> List[Any]:
        """See attnd.Client.batch_step."""
        spread = self.options.connections
        parts = _core.prepare_batch_steps(self.regions, items, self.options.max_message_bytes // 2,
                                          spread)
        for _, prepared in parts:
            _core.synchronize_inputs(prepared)

        async def send(part: Tuple[Any, Any]) -> List[Any]:
            try:
                buf = await self._unary("BatchStep", part[0], self._timeout(timeout))
            except AttndError as e:
                return _core.part_failed(e, len(parts), part[1])
            return _core.read_batch_step(buf, part[1])

        if _core.parts_go_at_once(items, parts, spread):
            answers = await asyncio.gather(*(send(part) for part in parts))
        else:
            answers = [await send(part) for part in parts]
        results = [r for answer in answers for r in answer]
        if not return_exceptions and any(isinstance(r, AttndError) for r in results):
            raise BatchStepError(results)
        return results

    def prepare_batch_step(self, items: Sequence[Any]) -> AsyncPreparedBatchStep:
        """See attnd.Client.prepare_batch_step; ``await prepared.step(layer)`` sends it."""
        return AsyncPreparedBatchStep(self, BatchStepTemplate(self.regions, items))

    async def truncate_session(self, session_id: str, tokens: int,
                               timeout: Optional[float] = None) -> TruncateResult:
        response = await self._unary(
            "TruncateSession", _proto.TruncateSessionRequest(session_id=session_id, tokens=int(tokens)),
            self._timeout(timeout))
        return TruncateResult(list(response.cached_tokens), response.freed_pages)

    async def fork_session(self, session_id: str, timeout: Optional[float] = None) -> SessionInfo:
        response = await self._unary("ForkSession", _proto.ForkSessionRequest(session_id=session_id),
                                     self._timeout(timeout))
        return SessionInfo(session_id=response.session_id, replica_id=response.replica_id)

    async def close_session(self, session_id: str, timeout: Optional[float] = None) -> int:
        response = await self._unary("CloseSession",
                                     _proto.CloseSessionRequest(session_id=session_id),
                                     self._timeout(timeout))
        return response.freed_pages

    # ---- shared memory --------------------------------------------------------------------------

    async def list_regions(self, timeout: Optional[float] = None) -> Any:
        return await self._unary("ListRegions", _proto.ListRegionsRequest(),
                                 self._timeout(timeout, _INFO_TIMEOUT))

    async def register_region(self, region: Any, name: Optional[str] = None,
                              timeout: Optional[float] = None) -> str:
        """See attnd.Client.register_region."""
        name = name or next_region_name()
        if self._region_socket is None:
            self._region_socket = RegionSocket((await self.list_regions()).socket_path)
        sock = self._region_socket
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
        await self._unary("RegisterRegion", request, self._timeout(timeout, _INFO_TIMEOUT))
        self.regions.add(Registered(name, region))
        return name

    async def unregister_region(self, region: Any, timeout: Optional[float] = None) -> None:
        names = [e.name for e in self.regions.entries if e.region is region or e.name == region]
        if not names:
            raise NotFound(f"region {region!r} is not registered by this client")
        for name in names:
            self.regions.remove(name)
            await self._unary("UnregisterRegion", _proto.UnregisterRegionRequest(name=name),
                              self._timeout(timeout, _INFO_TIMEOUT))


def _native_arrays(q: Any, k: Any, v: Any) -> bool:
    """Whether the library can code and read steps of these tensors as they are: numpy arrays of
    3 dimensions, C-contiguous, of a wire dtype (float32, float16, bfloat16 bits as uint16, FP8
    codes as uint8; attnd._fast checks the same)."""
    return (type(q) is _ndarray and type(k) is _ndarray and type(v) is _ndarray and
            q.ndim == 3 and k.ndim == 3 and v.ndim == 3 and q.flags.c_contiguous and
            k.flags.c_contiguous and v.flags.c_contiguous and q.dtype.char in "feHB" and
            k.dtype.char in "feHB" and v.dtype.char in "feHB")


_ndarray = np.ndarray
_FLOAT32 = np.dtype(np.float32)


class _Pending:
    """A step waiting in the coalescer: its request's size, how to code it here (-> message,
    Prepared), and, for the library's coding, its spec (attnd._fast.batch_step_start's) and q."""

    __slots__ = ("size", "coded", "spec", "q", "future", "_message")

    def __init__(self, size: int, coded: Any, spec: Any = None, q: Any = None):
        self.size = size
        self.coded = coded
        self.spec = spec
        self.q = q
        self.future: Optional[asyncio.Future] = None
        self._message: Any = None

    @classmethod
    def of(cls, message: Any, prepared: _core.Prepared) -> "_Pending":
        """A step coded already."""
        p = cls(message.size, None)
        p._message = (message, prepared)
        return p

    def message(self) -> Tuple[Any, _core.Prepared]:
        if self._message is None:
            self._message = self.coded()
        return self._message


class _StepCoalescer:
    """Collects the steps a Client is asked for during one turn of its event loop and sends them
    when the turn ends: one Step where there is one, else BatchSteps of at most `limit` items and
    `max_bytes` of request (one group per deadline; an answer is never larger than its request: o
    has q's shape, lse is 4 bytes per query head and token). A step larger than max_bytes goes
    alone. Each caller's future gets its own item's result or error; a failed call fails every
    item it carried. Items whose caller was cancelled before sending are left out. On the native
    transport, a BatchStep whose steps are all numpy arrays is coded and read by the library: it
    starts as the turn ends, and its completion settles its callers' futures (attnd._fast), with
    no task of its own; other BatchSteps are coded here, each by a task."""

    def __init__(self, client: Client, limit: int, max_bytes: int):
        self._client = client
        self._limit = max(1, int(limit))
        self._max_bytes = max(1, int(max_bytes))
        self._pending: Dict[Optional[float], List[_Pending]] = {}
        self._scheduled = False
        self._sending: "set[asyncio.Task]" = set()
        self._in_flight = 0  # calls of the library's coding not yet completed
        self._idle: Optional[asyncio.Future] = None  # drain() waits on it for them

    def add(self, item: _Pending, timeout: Optional[float]) -> asyncio.Future:
        """item queued for the end of this turn; the future its caller awaits."""
        loop = asyncio.get_running_loop()
        item.future = future = loop.create_future()
        pending = self._pending.get(timeout)
        if pending is None:
            self._pending[timeout] = [item]
        else:
            pending.append(item)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    async def drain(self) -> None:
        while self._sending or self._in_flight:
            if self._sending:
                await asyncio.gather(*self._sending, return_exceptions=True)
            if self._in_flight:
                self._idle = asyncio.get_running_loop().create_future()
                await self._idle

    def _flush(self) -> None:
        self._scheduled = False
        groups, self._pending = self._pending, {}
        for timeout, items in groups.items():
            for batch in _core.cut_by_size(items, lambda it: it.size, self._max_bytes,
                                           self._limit):
                self._send_now(batch, timeout)

    def _send_now(self, items: List[_Pending], timeout: Optional[float]) -> None:
        """items' call started: by the library where it codes them all, else by a task."""
        items = [it for it in items if not it.future.done()]
        if not items:
            return
        native = self._client._native_channel()
        specs = [it.spec for it in items]
        if native is not None and None not in specs:
            try:
                tag = native.start_steps(specs, timeout, len(specs) == 1,
                                         functools.partial(self._completed, items))
            except _native.CallError as e:  # refused: each item fails with it
                _fail(items, from_rpc_error(e))
                return
            except Exception as e:
                _fail(items, e)
                return
            if tag is not None:
                self._in_flight += 1
                return
        task = asyncio.ensure_future(self._send(items, timeout))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _completed(self, items: List[_Pending], code: int, answer: bytes, batch: Any) -> None:
        """The completion of a call the library coded: each item's outcome to its future."""
        self._in_flight -= 1
        try:
            if code != 0:  # the call failed: so did each of its items
                _fail(items, from_rpc_error(
                    _native.CallError(code, answer.decode(errors="replace"))))
            else:
                _native._fast.batch_step_settle(batch, [it.future for it in items],
                                                [it.q for it in items], StepResult,
                                                _wire.ServerTiming, _ndarray, _FLOAT32,
                                                _item_error)
        except Exception as e:  # reading the answer failed: the items not settled fail with it
            _fail(items, e)
        finally:
            if not self._in_flight and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)

    async def _send(self, items: List[_Pending], timeout: Optional[float]) -> None:
        """items coded here, sent, and each one's outcome to its future."""
        items = [it for it in items if not it.future.done()]
        if not items:
            return
        try:
            coded = []  # a step that cannot be coded fails alone
            for it in items:
                try:
                    coded.append((it, it.message()))
                except Exception as e:
                    _settle(it, e)
            items = [it for it, _ in coded]
            if not items:
                return
            results = await self._send_coded([c for _, c in coded], timeout)
        except _native.CallError as e:  # the call failed: so did each of its items
            results = _core.copies_of(from_rpc_error(e), len(items))
        except Exception as e:
            results = _core.copies_of(e, len(items))
        for it, r in zip(items, results):
            _settle(it, r)

    async def _send_coded(self, coded: List[Tuple[Any, _core.Prepared]],
                          timeout: Optional[float]) -> List[Any]:
        _core.synchronize_inputs([p for _, p in coded])
        if len(coded) == 1:
            m, p = coded[0]
            p.message = self._outgoing(m)
            return [_core.read_step(await self._client._unary("Step", p.message, timeout), p)]
        m = _wire.batch_step_request([c[0] for c in coded])
        buf = await self._client._unary("BatchStep", self._outgoing(m), timeout)
        return _core.read_batch_step(buf, [p for _, p in coded])

    def _outgoing(self, m: Any) -> Any:
        """m as it goes out: in its parts on the native transport (when large and all on the CPU),
        else joined."""
        if self._client.transport == "native" and not m.cuda and m.size >= _core.PARTS_MIN_BYTES:
            return m
        return _tensors.assemble(m.parts, m.size, m.cuda)


def _item_error(code: int, message: str) -> AttndError:
    """A coalesced step's own failure (its code and message in the BatchStep's answer)."""
    return from_rpc_error(_native.CallError(code, message))


def _fail(items: List[_Pending], error: Exception) -> None:
    """Each item not settled yet fails with its own copy of error."""
    live = [it for it in items if not it.future.done()]
    for it, e in zip(live, _core.copies_of(error, len(live))):
        it.future.set_exception(e)


def _settle(item: _Pending, result: Any) -> None:
    """item's future gets result (an exception or a StepResult), unless its caller stopped
    waiting."""
    if item.future.done():
        return
    if isinstance(result, Exception):
        item.future.set_exception(result)
    else:
        item.future.set_result(result)


async def _aiter(items: Any) -> AsyncIterator[Any]:
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


class Session:
    """asyncio twin of attnd.Session; ``async with`` closes it."""

    def __init__(self, client: Client, info: SessionInfo):
        self.client = client
        self.info = info
        self.closed = False

    @property
    def id(self) -> str:
        return self.info.session_id

    def __repr__(self) -> str:
        return f"aio.Session({self.id!r})"

    async def step(self, layer: int, q: Any, k_new: Any, v_new: Any, **options: Any) -> StepResult:
        return await self.client.step(self, layer, q, k_new, v_new, **options)

    async def truncate(self, tokens: int, timeout: Optional[float] = None) -> TruncateResult:
        return await self.client.truncate_session(self.id, tokens, timeout)

    async def fork(self, timeout: Optional[float] = None) -> "Session":
        forked = await self.client.fork_session(self.id, timeout)
        info = SessionInfo(**{**self.info.__dict__, "session_id": forked.session_id,
                              "replica_id": forked.replica_id or self.info.replica_id})
        return Session(self.client, info)

    async def close(self, timeout: Optional[float] = None) -> int:
        if self.closed:
            return 0
        freed = await self.client.close_session(self.id, timeout)
        self.closed = True
        return freed

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self.closed:
            try:
                await self.close()
            except NotFound:
                self.closed = True
