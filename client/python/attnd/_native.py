"""The native transport of the blocking and the asyncio Client: Attend, Echo, Step and BatchStep
sent by the C++ client library (libattn_client_c.so, attn/client/c_api.h) instead of grpcio.

The request is the same bytes the grpcio path sends, in its parts (the small fields and the
caller's arrays where they lie: none joined or copied); the answer is copied once, from gRPC's
slices into a fresh bytes object, as grpcio does. A Step of numpy arrays is coded and read by the
library itself, called from attnd._fast (attnd/_fast.c) where that module loads. What this saves
is grpcio's own cost per call, which on some hosts is several times the C++ client's, and the
Python work of coding (docs/PERF.md). The GIL is released for the length of a call.

The library is found at $ATTND_NATIVE_LIB, else next to this module (where the build tree's copy
of the package and `ATTND_NATIVE_LIB=... pip install` put it). Without it, or with settings it
cannot take (a channel option whose value is not an integer), ``transport="auto"`` uses grpcio.

The asyncio client's calls (AsyncNativeChannel) start on the library's completion queue and
return at once; the event loop watches the queue's file descriptor and resolves each call's future
when it completes. Its BatchSteps of numpy arrays are coded and read by the library too.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import grpc

import numpy as np

from ._tensors import _pybytes_new
from ._wire import ServerTiming
from .errors import InvalidArgument, status_code

LIBRARY = "libattn_client_c.so"
ABI_VERSION = 3
METHODS = frozenset(("Attend", "Echo", "Step", "BatchStep"))
_MESSAGE_BYTES = 4096

_lock = threading.Lock()
_loaded: Optional[Tuple[Optional[ctypes.CDLL], str]] = None


def library_path() -> Optional[Path]:
    """Where the library would be loaded from (None: nowhere)."""
    env = os.environ.get("ATTND_NATIVE_LIB")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent / LIBRARY
    return here if here.is_file() else None


def load() -> Tuple[Optional[ctypes.CDLL], str]:
    """The library and "" when it loads, else None and why not (once per process)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> Tuple[Optional[ctypes.CDLL], str]:
    path = library_path()
    if path is None:
        return None, f"{LIBRARY} not found (set ATTND_NATIVE_LIB)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"{path}: {e}"
    lib.attn_c_abi_version.restype = ctypes.c_int
    lib.attn_c_abi_version.argtypes = ()
    version = lib.attn_c_abi_version()
    if version != ABI_VERSION:
        return None, f"{path}: C interface version {version}, this package needs {ABI_VERSION}"
    strings = ctypes.POINTER(ctypes.c_char_p)
    lib.attn_c_client_create.restype = ctypes.c_void_p
    lib.attn_c_client_create.argtypes = (strings, strings, ctypes.c_size_t, ctypes.c_char_p,
                                         ctypes.c_size_t)
    lib.attn_c_client_destroy.restype = None
    lib.attn_c_client_destroy.argtypes = (ctypes.c_void_p,)
    lib.attn_c_call_parts.restype = ctypes.c_int
    lib.attn_c_call_parts.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64,
                                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                      ctypes.c_size_t)
    lib.attn_c_response_size.restype = ctypes.c_size_t
    lib.attn_c_response_size.argtypes = (ctypes.c_void_p,)
    lib.attn_c_response_take.restype = None
    lib.attn_c_response_take.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    lib.attn_c_response_free.restype = None
    lib.attn_c_response_free.argtypes = (ctypes.c_void_p,)
    lib.attn_c_queue_create.restype = ctypes.c_void_p
    lib.attn_c_queue_create.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
    lib.attn_c_queue_fd.restype = ctypes.c_int
    lib.attn_c_queue_fd.argtypes = (ctypes.c_void_p,)
    lib.attn_c_queue_cancel.restype = None
    lib.attn_c_queue_cancel.argtypes = (ctypes.c_void_p, ctypes.c_uint64)
    lib.attn_c_queue_poll.restype = ctypes.c_size_t
    lib.attn_c_queue_poll.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_size_t)
    lib.attn_c_queue_destroy.restype = None
    lib.attn_c_queue_destroy.argtypes = (ctypes.c_void_p,)
    lib.attn_c_call_start.restype = ctypes.c_int
    lib.attn_c_call_start.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_int64, ctypes.c_uint64, ctypes.c_char_p,
                                      ctypes.c_size_t)
    global _fast, _fast_single
    _fast = _load_fast(path)
    from . import _core

    if _core.FAST is None and _core.fast_usable(_fast):  # found beside the library
        _core.FAST = _fast
    if _fast is not None:
        addresses = [ctypes.cast(f, ctypes.c_void_p).value
                     for f in (lib.attn_c_step, lib.attn_c_batch_step_start, lib.attn_c_step_start)]
        try:
            _fast.bind(*addresses)
            _fast_single = True
        except TypeError:  # a module older than the library: BatchSteps only
            _fast.bind(*addresses[:2])
            _fast_single = False
    return lib, ""


_fast: Any = None  # attnd._fast (the decode step in C) once bound to the library, else None
_fast_single = False  # whether _fast starts single Step calls on a queue too


def _load_fast(library: Path) -> Any:
    """attnd._fast from the package (or as attnd._core found it), else from beside the library
    (a bundle that carries both); None where neither loads (no binary for this interpreter: the
    step's work stays in Python)."""
    from . import _core

    if _core.FAST is not None:
        return _core.FAST
    try:
        from . import _fast as fast  # type: ignore[attr-defined]

        return fast
    except ImportError:
        pass
    beside = library.parent / "_fast.abi3.so"
    return _core.fast_from_file(beside) if beside.is_file() else None


class CallError(Exception):
    """A failed native call, shaped as grpc.RpcError is for errors.from_rpc_error."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self._code = status_code(code)
        self._message = message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message


def settings(options: Any) -> Tuple[Optional[List[Tuple[str, str]]], str]:
    """options (a ClientOptions) as the library's settings, or None and why it cannot take them."""
    from ._core import _read_pem  # the same PEM reading as the grpcio path

    out = [("target", options.target), ("connections", str(options.connections)),
           ("max_message_bytes", str(options.max_message_bytes)),
           ("wait_for_ready", "1" if options.wait_for_ready else "0")]
    if options.uses_tls():
        out.append(("tls", "1"))
        for key, value, name in (("tls_ca_pem", options.tls_ca, "tls_ca"),
                                 ("tls_cert_pem", options.tls_cert, "tls_cert"),
                                 ("tls_key_pem", options.tls_key, "tls_key")):
            pem = _read_pem(value, name)
            if pem is not None:
                out.append((key, pem.decode()))
    if options.tls_server_name:
        out.append(("tls_server_name", options.tls_server_name))
    if options.token:
        out.append(("token", options.token))
    if options.lb_policy:
        out.append(("lb_policy", options.lb_policy))
    for name, value in options.channel_options:
        if isinstance(value, bool) or not isinstance(value, int):
            return None, f"channel option {name!r}: the native transport takes integer values only"
        out.append((f"arg:{name}", str(value)))
    return out, ""


def decide(options: Any) -> Tuple[Optional[ctypes.CDLL], List[Tuple[str, str]], str]:
    """Whether a client of these options (a ClientOptions) goes native: the library and its
    settings, or None and why not ("asked for" when options ask for grpcio). Raises
    InvalidArgument, with the reason, when native was asked for and cannot be had."""
    asked = options.transport_asked()
    if asked == "grpcio":
        return None, [], "asked for"
    lib, why = load()
    pairs = None
    if lib is not None:
        pairs, why = settings(options)
    if lib is None or pairs is None:
        if asked == "native":
            raise InvalidArgument(f"transport='native': {why}")
        return None, [], why
    return lib, pairs, ""


def _create_client(lib: ctypes.CDLL, pairs: List[Tuple[str, str]]) -> int:
    """The library's client of these settings; InvalidArgument with its reason otherwise."""
    keys = (ctypes.c_char_p * len(pairs))(*[k.encode() for k, _ in pairs])
    values = (ctypes.c_char_p * len(pairs))(*[v.encode() for _, v in pairs])
    error = ctypes.create_string_buffer(_MESSAGE_BYTES)
    handle = lib.attn_c_client_create(keys, values, len(pairs), error, _MESSAGE_BYTES)
    if not handle:
        raise InvalidArgument(f"native transport: {error.value.decode(errors='replace')}")
    return handle


def _parts_arrays(parts: List[Any]) -> Tuple[Any, Any]:
    n = len(parts)
    addresses = (ctypes.c_void_p * n)()
    sizes = (ctypes.c_size_t * n)()
    for i, part in enumerate(parts):
        addresses[i], sizes[i] = _part_address(part)
    return addresses, sizes


class NativeChannel:
    """A C++ client (its connections) for the four raw calls of one Client."""

    def __init__(self, lib: ctypes.CDLL, pairs: List[Tuple[str, str]]):
        self._lib = lib
        self._handle: Optional[int] = _create_client(lib, pairs)
        self._methods = {m: m.encode() for m in METHODS}
        # Calls in flight, so that close() during them frees the library's client only after the
        # last one returns (it would otherwise be freed under them).
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closing = False
        self._local = threading.local()  # each thread's out-parameters (_Scratch)

    def _scratch(self) -> "_Scratch":
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = _Scratch()
        return s

    def call(self, method: str, request: Any, timeout: Optional[float]) -> bytes:
        """One blocking call of a message's bytes (any buffer, read in place); the answer's
        bytes, or CallError."""
        return self.call_parts(method, [request], timeout)

    def call_parts(self, method: str, parts: List[Any], timeout: Optional[float]) -> bytes:
        """call() of a message still in its parts (bytes and the caller's CPU buffers, in
        order): each goes out where it lies, none is joined or copied."""
        n = len(parts)
        addresses, sizes = _parts_arrays(parts)
        s = self._scratch()
        handle = self._enter()
        try:
            code = self._lib.attn_c_call_parts(handle, self._methods[method], addresses, sizes, n,
                                               _timeout_ms(timeout), s.response_ref, s.message,
                                               _MESSAGE_BYTES)
        finally:
            self._leave()
        if code != 0:
            raise CallError(code, s.message.value.decode(errors="replace"))
        n = self._lib.attn_c_response_size(s.response)
        out = _pybytes_new(None, n)  # fresh: nobody else has seen it yet
        self._lib.attn_c_response_take(s.response, out)  # a bytes argument passes its buffer
        return out

    def step(self, session_id: str, layer: int, q: Any, k_new: Any, v_new: Any, scale: float,
             return_lse: bool, window: Optional[Tuple[int, int]], timeout: Optional[float]) -> Any:
        """A Step coded and read by the library (attn_c_step, called by attnd._fast): q, k_new
        and v_new read in place, o written straight into the answer's array. (o, lse,
        cached_tokens, timing), or None when it does not take the step (no attnd._fast, or
        tensors other than C-contiguous numpy arrays of 3 dimensions and a wire dtype): the
        caller then codes it itself. Raises CallError."""
        if _fast is None or type(q) is not np.ndarray or type(k_new) is not np.ndarray or \
                type(v_new) is not np.ndarray:
            return None
        left, right = window if window is not None else (-1, -1)
        handle = self._enter()
        try:
            r = _fast.step(handle, session_id.encode(), layer, q, k_new, v_new, scale, return_lse,
                           left, right, _timeout_ms(timeout))
        finally:
            self._leave()
        if r is None:
            return None
        if r[0] != 0:
            raise CallError(r[0], r[1])
        return _step_result(r, q)

    def _enter(self) -> int:
        with self._lock:
            if self._closing:
                raise CallError(grpc.StatusCode.CANCELLED.value[0], "the client is closed")
            self._in_flight += 1
            return self._handle

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            last = self._closing and self._in_flight == 0
        if last:
            self._destroy()

    def close(self) -> None:
        """Frees the library's client now, or once the calls in flight have returned; calls made
        after close() fail with CANCELLED."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            now = self._in_flight == 0
        if now:
            self._destroy()

    def _destroy(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.attn_c_client_destroy(handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutting down
            pass


def _step_result(r: Tuple[Any, ...], q: Any) -> Any:
    """(o, lse, cached_tokens, timing) of a step the library read: r = (0, o bytes, lse bytes or
    None, cached_tokens, timing bytes)."""
    _, o, lse, cached, timing = r
    return (np.frombuffer(o, dtype=q.dtype).reshape(q.shape),
            None if lse is None else
            np.frombuffer(lse, dtype=np.float32).reshape(q.shape[1], q.shape[0]),
            cached, ServerTiming(timing, (0, len(timing))))


class AsyncNativeChannel:
    """The native transport of one attnd.aio.Client: its calls start on the library's completion
    queue without blocking, and the event loop that made it reads their completions when the
    queue's file descriptor turns readable. Use it from that loop only."""

    _POLL = 64  # completions taken per attn_c_queue_poll

    def __init__(self, lib: ctypes.CDLL, pairs: List[Tuple[str, str]],
                 loop: asyncio.AbstractEventLoop):
        self._lib = lib
        self._loop = loop
        self._handle: Optional[int] = _create_client(lib, pairs)
        error = ctypes.create_string_buffer(_MESSAGE_BYTES)
        self._queue: Optional[int] = lib.attn_c_queue_create(error, _MESSAGE_BYTES)
        if not self._queue:
            lib.attn_c_client_destroy(self._handle)
            raise InvalidArgument(f"native transport: {error.value.decode(errors='replace')}")
        self._fd = lib.attn_c_queue_fd(self._queue)
        loop.add_reader(self._fd, self._on_completions)
        self._methods = {m: m.encode() for m in METHODS}
        # tag -> (what the call borrows, done(code, answer) run at its completion): kept until
        # the completion, even when the caller stopped waiting, since the library reads the bytes.
        self._calls: Dict[int, Tuple[Any, Callable[[int, bytes], None]]] = {}
        self._tags = itertools.count(1)
        self._message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        self._done_tags = (ctypes.c_uint64 * self._POLL)()
        self._done_codes = (ctypes.c_int32 * self._POLL)()
        self._done_responses = (ctypes.c_void_p * self._POLL)()
        self._idle: Optional[asyncio.Future] = None  # close() waits on it for the last call

    @property
    def batch_steps_native(self) -> bool:
        """Whether BatchSteps of numpy arrays are coded here by the library (attnd._fast)."""
        return _fast is not None

    async def call_parts(self, method: str, parts: List[Any], timeout: Optional[float]) -> bytes:
        """One call of a message in its parts (bytes and CPU buffers, sent where they lie); the
        answer's bytes, or CallError."""
        addresses, sizes = _parts_arrays(parts)
        tag = next(self._tags)
        code = self._lib.attn_c_call_start(self._live(), self._queue, self._methods[method],
                                           addresses, sizes, len(parts), _timeout_ms(timeout),
                                           tag, self._message, _MESSAGE_BYTES)
        if code != 0:
            raise CallError(code, self._message.value.decode(errors="replace"))
        return await self._wait(tag, (parts, addresses, sizes), lambda code, answer: answer)

    def start_steps(self, specs: List[Tuple[Any, ...]], timeout: Optional[float], single: bool,
                    done: Callable[[int, bytes, Any], None]) -> Optional[int]:
        """Starts a BatchStep (single: the one step of specs as a Step call) coded and read by the
        library: specs as attnd._fast.batch_step_start takes them. Returns the call's tag (for
        cancel), or None when the library does not take these tensors (nothing started: the
        caller codes the call itself); raises CallError when the library refuses it. When it
        completes, the loop calls done(code, answer, batch): code 0 (then batch is read by
        attnd._fast.batch_step_settle or batch_step_read), or the call's failure with its
        message in answer."""
        if _fast is None or (single and not _fast_single):
            return None
        tag = next(self._tags)
        r = _fast.batch_step_start(self._live(), self._queue, tag, specs, _timeout_ms(timeout),
                                   single)
        if r is None:
            return None
        if r[0] != 0:
            raise CallError(r[0], r[1])
        batch = r[1]
        self._calls[tag] = ((specs, batch), lambda code, answer: done(code, answer, batch))
        return tag

    def cancel(self, tag: int) -> None:
        """Cancels a call still running (its completion still comes)."""
        if self._queue is not None:
            self._lib.attn_c_queue_cancel(self._queue, tag)

    async def batch_step(self, specs: List[Tuple[Any, ...]], queries: List[Any],
                         timeout: Optional[float], single: bool = False) -> Optional[List[Any]]:
        """start_steps awaited: per item, (o, lse, cached_tokens, timing) or a CallError; None
        when the library does not take these tensors (the caller codes the call itself). Raises
        CallError when the call fails as a whole."""
        future = self._loop.create_future()

        def done(code: int, answer: bytes, batch: Any) -> None:
            _settle(future, code, answer, lambda _: [
                CallError(item[0], item[1]) if item[0] != 0 else _step_result(item, q)
                for item, q in zip(_fast.batch_step_read(batch), queries)])

        tag = self.start_steps(specs, timeout, single, done)
        if tag is None:
            return None
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel(tag)  # its completion still comes
            raise

    def _live(self) -> int:
        if self._handle is None:
            raise CallError(grpc.StatusCode.CANCELLED.value[0], "the client is closed")
        return self._handle

    async def _wait(self, tag: int, keep: Any, read: Callable[[int, bytes], Any]) -> Any:
        future = self._loop.create_future()
        self._calls[tag] = (keep, lambda code, answer: _settle(
            future, code, answer, lambda a: read(code, a)))
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel(tag)  # its completion still comes
            raise

    def _on_completions(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            pass
        lib = self._lib
        while True:
            n = lib.attn_c_queue_poll(self._queue, self._done_tags, self._done_codes,
                                      self._done_responses, self._POLL)
            for i in range(n):
                response = self._done_responses[i]
                size = lib.attn_c_response_size(response)
                if size:
                    answer = _pybytes_new(None, size)
                    lib.attn_c_response_take(response, answer)
                else:  # a BatchStep read into its items, or an empty answer
                    answer = b""
                    lib.attn_c_response_free(response)
                self._complete(self._done_tags[i], self._done_codes[i], answer)
            if n < self._POLL:
                break
        if not self._calls and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _complete(self, tag: int, code: int, answer: bytes) -> None:
        call = self._calls.pop(tag, None)
        if call is None:  # a call whose start failed after the library had started it
            return
        try:
            call[1](code, answer)
        except Exception as e:  # a completion's reader failed: the loop goes on with the others
            self._loop.call_exception_handler({
                "message": "attnd: reading a native call's completion failed", "exception": e})

    async def close(self) -> None:
        """Cancels the calls still running, waits for their completions, then frees the queue
        and the library's client; later calls fail with CANCELLED."""
        if self._queue is None:
            return
        for tag in list(self._calls):
            self._lib.attn_c_queue_cancel(self._queue, tag)
        if self._calls:
            self._idle = self._loop.create_future()
            await self._idle
        self._loop.remove_reader(self._fd)
        queue, self._queue = self._queue, None
        handle, self._handle = self._handle, None
        self._lib.attn_c_queue_destroy(queue)
        self._lib.attn_c_client_destroy(handle)


def _settle(future: asyncio.Future, code: int, answer: bytes,
            read: Callable[[bytes], Any]) -> None:
    """A completed call's outcome into future: read(answer), or the call's CallError; nothing
    where the caller stopped waiting."""
    if future.done():
        return
    if code != 0:
        future.set_exception(CallError(code, answer.decode(errors="replace")))
        return
    try:
        future.set_result(read(answer))
    except Exception as e:  # reading the answer failed: that call's error
        future.set_exception(e)


def _timeout_ms(timeout: Optional[float]) -> int:
    return -1 if timeout is None else max(1, int(timeout * 1000.0 + 0.999))


def _part_address(part: Any) -> Tuple[int, int]:
    """(address, size) of a message part: a bytes object's own buffer, or any CPU buffer's
    (through numpy's view of it, which takes read-only ones too). The part must stay alive."""
    if type(part) is bytes:
        return ctypes.cast(ctypes.c_char_p(part), ctypes.c_void_p).value or 0, len(part)
    view = np.frombuffer(part, dtype=np.uint8)
    return view.ctypes.data, view.nbytes


class _Scratch:
    """One thread's out-parameters of the library's calls (reused call after call)."""

    def __init__(self) -> None:
        self.message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        self.response = ctypes.c_void_p()
        self.response_ref = ctypes.byref(self.response)
