"""The native transport of the blocking Client: Attend, Echo, Step and BatchStep sent by the C++
client library (libattn_client_c.so, attn/client/c_api.h) instead of grpcio.

The request is the same bytes the grpcio path sends, read in place by the library; the answer is
copied once, from gRPC's slices into a fresh bytes object, as grpcio does. What it saves is
grpcio's own cost per call, which on some hosts is several times the C++ client's (docs/PERF.md).
ctypes releases the GIL for the length of a call, so other threads run meanwhile.

The library is found at $ATTND_NATIVE_LIB, else next to this module (where the build tree's copy
of the package and `ATTND_NATIVE_LIB=... pip install` put it). Without it, or with settings it
cannot take (a channel option whose value is not an integer), ``transport="auto"`` uses grpcio.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any, List, Optional, Tuple

import grpc

import numpy as np

from ._tensors import _NP_CODES, _pybytes_new
from ._wire import ServerTiming
from .errors import InvalidArgument, status_code

LIBRARY = "libattn_client_c.so"
ABI_VERSION = 1
METHODS = frozenset(("Attend", "Echo", "Step", "BatchStep"))
_MESSAGE_BYTES = 4096
_TIMING_BYTES = 512

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
    lib.attn_c_call.restype = ctypes.c_int
    lib.attn_c_call.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                ctypes.c_size_t)
    tensor = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
              ctypes.c_size_t]
    lib.attn_c_step.restype = ctypes.c_int
    lib.attn_c_step.argtypes = tuple(
        [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32] + tensor * 3 +
        [ctypes.c_float, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t])
    lib.attn_c_response_size.restype = ctypes.c_size_t
    lib.attn_c_response_size.argtypes = (ctypes.c_void_p,)
    lib.attn_c_response_take.restype = None
    lib.attn_c_response_take.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    lib.attn_c_response_free.restype = None
    lib.attn_c_response_free.argtypes = (ctypes.c_void_p,)
    global _fast
    _fast = _load_fast(path)
    if _fast is not None:
        _fast.bind(ctypes.cast(lib.attn_c_step, ctypes.c_void_p).value)
    return lib, ""


_fast: Any = None  # attnd._fast (the decode step in C) once bound to the library, else None


def _load_fast(library: Path) -> Any:
    """attnd._fast from the package, else from beside the library (a bundle that carries both);
    None where neither loads (no binary for this interpreter: the step's work stays in Python)."""
    try:
        from . import _fast as fast  # type: ignore[attr-defined]

        return fast
    except ImportError:
        pass
    beside = library.parent / "_fast.abi3.so"
    if not beside.is_file():
        return None
    import importlib.machinery
    import importlib.util

    try:
        loader = importlib.machinery.ExtensionFileLoader(__package__ + "._fast", str(beside))
        spec = importlib.util.spec_from_file_location(__package__ + "._fast", str(beside),
                                                      loader=loader)
        fast = importlib.util.module_from_spec(spec)
        loader.exec_module(fast)
        return fast
    except ImportError:
        return None


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
    if options.tls or options.tls_ca is not None or options.tls_cert is not None:
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


class NativeChannel:
    """A C++ client (its connections) for the four raw calls of one Client."""

    def __init__(self, lib: ctypes.CDLL, pairs: List[Tuple[str, str]]):
        self._lib = lib
        keys = (ctypes.c_char_p * len(pairs))(*[k.encode() for k, _ in pairs])
        values = (ctypes.c_char_p * len(pairs))(*[v.encode() for _, v in pairs])
        error = ctypes.create_string_buffer(_MESSAGE_BYTES)
        handle = lib.attn_c_client_create(keys, values, len(pairs), error, _MESSAGE_BYTES)
        if not handle:
            raise InvalidArgument(f"native transport: {error.value.decode(errors='replace')}")
        self._handle: Optional[int] = handle
        self._methods = {m: m.encode() for m in METHODS}
        self._local = threading.local()  # each thread's out-parameters (_Scratch)

    def _scratch(self) -> "_Scratch":
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = _Scratch()
        return s

    def call(self, method: str, request: Any, timeout: Optional[float]) -> bytes:
        """One blocking call; the answer's bytes, or CallError."""
        handle = self._handle
        if handle is None:
            raise CallError(grpc.StatusCode.CANCELLED.value[0], "the client is closed")
        data, size = _address(request)
        timeout_ms = -1 if timeout is None else max(1, int(timeout * 1000.0 + 0.999))
        s = self._scratch()
        response = s.response
        code = self._lib.attn_c_call(handle, self._methods[method], data, size, timeout_ms,
                                     s.response_ref, s.message, _MESSAGE_BYTES)
        if code != 0:
            raise CallError(code, s.message.value.decode(errors="replace"))
        return self._take(response)

    def call_parts(self, method: str, parts: List[Any], timeout: Optional[float]) -> bytes:
        """call() of a message still in its parts (bytes and the caller's CPU buffers, in
        order): each goes out where it lies, none is joined or copied."""
        handle = self._handle
        if handle is None:
            raise CallError(grpc.StatusCode.CANCELLED.value[0], "the client is closed")
        n = len(parts)
        addresses = (ctypes.c_void_p * n)()
        sizes = (ctypes.c_size_t * n)()
        for i, part in enumerate(parts):
            addresses[i], sizes[i] = _part_address(part)
        timeout_ms = -1 if timeout is None else max(1, int(timeout * 1000.0 + 0.999))
        s = self._scratch()
        code = self._lib.attn_c_call_parts(handle, self._methods[method], addresses, sizes, n,
                                           timeout_ms, s.response_ref, s.message, _MESSAGE_BYTES)
        if code != 0:
            raise CallError(code, s.message.value.decode(errors="replace"))
        return self._take(s.response)

    def _take(self, response: Any) -> bytes:
        n = self._lib.attn_c_response_size(response)
        out = _pybytes_new(None, n)  # fresh: nobody else has seen it yet
        self._lib.attn_c_response_take(response, out)  # a bytes argument passes its buffer
        return out

    def step(self, session_id: str, layer: int, q: Any, k_new: Any, v_new: Any, scale: float,
             return_lse: bool, window: Optional[Tuple[int, int]], timeout: Optional[float]) -> Any:
        """A Step coded and read by the library, q, k_new and v_new read in place and o written
        straight into the answer's array: (o, lse, cached_tokens, timing), or None when the step
        is not one it takes (tensors other than C-contiguous numpy arrays of 3 dimensions): the
        caller then codes it itself. Kept short: a decode step's client time is mostly this
        function's. Raises CallError."""
        if _fast is not None:
            if type(q) is not np.ndarray or type(k_new) is not np.ndarray or \
                    type(v_new) is not np.ndarray:
                return None
            handle = self._handle
            if handle is None:
                raise CallError(grpc.StatusCode.CANCELLED.value[0], "the client is closed")
            left, right = window if window is not None else (-1, -1)
            r = _fast.step(handle, session_id.encode(), layer, q, k_new, v_new, scale, return_lse,
                           left, right,
                           -1 if timeout is None else max(1, int(timeout * 1000.0 + 0.999)))
            if r is None or r[0] == 0:
                return r and (np.frombuffer(r[1], dtype=q.dtype).reshape(q.shape),
                              None if r[2] is None else np.frombuffer(r[2], dtype=np.float32)
                              .reshape(q.shape[1], q.shape[0]), r[3],
                              ServerTiming(r[4], (0, len(r[4]))))
            raise CallError(r[0], r[1])
        args: List[Any] = []
        for x in (q, k_new, v_new):
            if type(x) is not np.ndarray or x.ndim != 3 or not x.flags.c_contiguous:
                return None
            code = _NP_CODES.get(x.dtype)
            if code is None:
                return None
            shape = x.shape
            args += (code, shape[0], shape[1], shape[2], x.ctypes.data, x.nbytes)
        handle = self._handle
        if handle is None:
            raise CallError(grpc.StatusCode.CANCELLED.value[0], "the client is closed")
        s = self._scratch()
        o_bytes = q.nbytes
        o = _pybytes_new(None, o_bytes)  # fresh: nobody else has seen them yet
        lse_bytes = 4 * q.shape[0] * q.shape[1] if return_lse else 0
        lse = _pybytes_new(None, lse_bytes) if return_lse else None
        left, right = window if window is not None else (-1, -1)
        timeout_ms = -1 if timeout is None else max(1, int(timeout * 1000.0 + 0.999))
        code = self._lib.attn_c_step(
            handle, session_id.encode(), layer, *args, scale, 1 if return_lse else 0, left, right,
            timeout_ms, o, o_bytes, lse, lse_bytes, s.cached_ref, s.timing, _TIMING_BYTES,
            s.timing_size_ref, s.message, _MESSAGE_BYTES)
        if code != 0:
            raise CallError(code, s.message.value.decode(errors="replace"))
        n = s.timing_size.value
        o_array = np.frombuffer(o, dtype=q.dtype).reshape(q.shape)
        lse_array = np.frombuffer(lse, dtype=np.float32).reshape(q.shape[1], q.shape[0]) \
            if return_lse else None
        return o_array, lse_array, s.cached.value, ServerTiming(ctypes.string_at(s.timing, n),
                                                                  (0, n))

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.attn_c_client_destroy(handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutting down
            pass


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
        self.cached = ctypes.c_int64()
        self.cached_ref = ctypes.byref(self.cached)
        self.timing = ctypes.create_string_buffer(_TIMING_BYTES)
        self.timing_size = ctypes.c_size_t()
        self.timing_size_ref = ctypes.byref(self.timing_size)


def _address(request: Any) -> Tuple[Any, int]:
    """The request's bytes as (pointer, size) without a copy: bytes in place, any other buffer
    (bytearray, memoryview) through ctypes' view of it."""
    if isinstance(request, bytes):
        return request, len(request)
    view = memoryview(request).cast("B")
    n = view.nbytes
    if n == 0:
        return None, 0
    if view.readonly:  # a read-only buffer's address, through numpy's view of it
        return ctypes.c_void_p(np.frombuffer(view, dtype=np.uint8).ctypes.data), n
    return (ctypes.c_char * n).from_buffer(view), n
