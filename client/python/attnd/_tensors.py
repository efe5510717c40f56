"""numpy arrays and torch tensors as attn.v1 tensors, and back, without a float32 detour.

A request tensor is read once, from its own memory into the message; an output is a view over
the received message (numpy: read-only, as the message's bytes are immutable; torch on the CPU:
a tensor sharing the message's memory) or, for a CUDA tensor, one copy to the device.

Element types: float32, float16 and bfloat16. numpy has no bfloat16 of its own: pass
``ml_dtypes.bfloat16`` arrays where ml_dtypes is installed, or uint16 arrays holding the bf16 bits
(outputs come back in the same flavour as q). torch: float32, float16, bfloat16 on the CPU or
a CUDA device. FP8 E4M3 codes: numpy uint8 arrays, or torch.float8_e4m3fn tensors on the CPU
(FP8 tensors do not travel in shared-memory regions).
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .errors import InvalidArgument

try:  # optional: numpy's bfloat16
    import ml_dtypes as _ml_dtypes

    BFLOAT16_NP: Optional[np.dtype] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the host
    BFLOAT16_NP = None

# attn.v1 DType values (checked against the descriptors by the tests).
FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3 = 1, 2, 3, 4
DTYPE_BYTES = {FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2, FLOAT8_E4M3: 1}
DTYPE_NAMES = {FLOAT32: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16",
               FLOAT8_E4M3: "float8_e4m3"}

# uint8 arrays hold FP8 E4M3 codes (OCP E4M3FN), whose descales go beside them (attend's
# q_descale, k_descale, v_descale).
_NP_CODES = {np.dtype(np.float32): FLOAT32, np.dtype(np.float16): FLOAT16,
             np.dtype(np.uint16): BFLOAT16, np.dtype(np.uint8): FLOAT8_E4M3}
if BFLOAT16_NP is not None:
    _NP_CODES[BFLOAT16_NP] = BFLOAT16

_torch: Any = None  # the torch module, once a torch tensor has been seen
_TORCH_CODES: dict = {}


def _load_torch() -> Any:
    global _torch
    if _torch is None:
        import torch

        _TORCH_CODES.update({torch.float32: FLOAT32, torch.float16: FLOAT16,
                             torch.bfloat16: BFLOAT16})
        if hasattr(torch, "float8_e4m3fn"):
            _TORCH_CODES[torch.float8_e4m3fn] = FLOAT8_E4M3
        # Outputs on the CPU are tensors over the received (immutable) message, which only they
        # hold: torch warns, once per process, that it cannot mark such tensors read-only. That
        # one warning is spent here, silenced.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.frombuffer(b"\0", dtype=torch.uint8)
        _torch = torch
    return _torch


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def dtype_code(name: Any) -> int:
    """attn.v1 DType of a dtype name ("bf16", "bfloat16", ...), numpy dtype or torch dtype."""
    if isinstance(name, int):
        return name
    text = str(name).replace("torch.", "").lower()
    codes = {"fp32": FLOAT32, "float32": FLOAT32, "fp16": FLOAT16, "float16": FLOAT16,
             "half": FLOAT16, "bf16": BFLOAT16, "bfloat16": BFLOAT16, "fp8": FLOAT8_E4M3,
             "float8_e4m3": FLOAT8_E4M3, "float8_e4m3fn": FLOAT8_E4M3,
             "fp8_e4m3": FLOAT8_E4M3}
    if text in codes:
        return codes[text]
    raise InvalidArgument(f"unknown dtype {name!r}: use float32, float16 or bfloat16")


class Payload:
    """One request tensor: its wire dtype and shape, and where its bytes are.

    ``data`` is a buffer over the caller's memory (CPU), or the contiguous torch tensor itself when
    it lives on a CUDA device (copied straight into the message). ``ptr`` is the address of its
    first byte (for finding it in a shared-memory region), ``cuda`` its device index or -1.
    """

    __slots__ = ("dtype", "shape", "nbytes", "_data", "ptr", "cuda", "source")

    def __init__(self, dtype: int, shape: Tuple[int, ...], nbytes: int, data: Any, ptr: int,
                 cuda: int, source: Any):
        self.dtype = dtype
        self.shape = shape
        self.nbytes = nbytes
        self._data = data
        self.ptr = ptr
        self.cuda = cuda
        self.source = source

    @property
    def data(self) -> Any:
        # A CPU torch tensor's buffer is made only when its bytes go into a message: a tensor in a
        # shared region is sent as (region, offset), and making it costs more than the rest.
        if self._data is None:
            torch = _load_torch()
            flat = self.source.view(torch.uint8) if self.dtype == FLOAT8_E4M3 else \
                self.source.view(torch.int16) if self.dtype != FLOAT32 else self.source
            self._data = flat.numpy().data
        return self._data


def payload(x: Any, name: str) -> Payload:
    """The Payload of a numpy array or torch tensor (made contiguous if it is not: a copy)."""
    if type(x) is np.ndarray:
        dt = x.dtype
        code = _NP_CODES.get(dt)
        if code is None:
            raise InvalidArgument(f"{name}: dtype {x.dtype} is not supported: use float32, float16, "
                                  "bfloat16 (ml_dtypes) or uint16 holding bfloat16 bits")
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        # ml_dtypes' bfloat16 exports no buffer format: its bits as uint16
        buf = x.view(np.uint16).data if dt is BFLOAT16_NP else x.data
        return Payload(code, x.shape, x.nbytes, buf, 0, -1, x)
    if isinstance(x, np.ndarray):  # a subclass
        return payload(np.asarray(x), name)
    if is_torch(x):
        torch = _load_torch()
        code = _TORCH_CODES.get(x.dtype)
        if code is None:
            raise InvalidArgument(f"{name}: dtype {x.dtype} is not supported: use torch.float32, "
                                  "torch.float16 or torch.bfloat16")
        x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        if x.is_cuda:
            return Payload(code, tuple(x.shape), nbytes, x, x.data_ptr(), x.device.index or 0, x)
        return Payload(code, tuple(x.shape), nbytes, None, x.data_ptr(), -1, x)
    raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")


def array_ptr(p: Payload) -> int:
    """Address of a payload's first byte (numpy's is looked up only when regions need it)."""
    if p.ptr == 0 and isinstance(p.source, np.ndarray):
        p.ptr = p.source.__array_interface__["data"][0]
    return p.ptr


class OutputMaker:
    """Makes the outputs of a call in the caller's flavour: numpy like q, or torch on q's device."""

    __slots__ = ("torch_device", "np_bf16")

    def __init__(self, q: Any):
        if isinstance(q, np.ndarray):
            self.torch_device = None
            # bf16 comes back as ml_dtypes.bfloat16 when q was one, else as uint16 bits.
            self.np_bf16 = q.dtype if q.dtype == BFLOAT16_NP else np.dtype(np.uint16)
        elif is_torch(q):
            self.torch_device = q.device
            self.np_bf16 = None
        else:
            raise TypeError(f"q: expected a numpy array or a torch tensor, got {type(q).__name__}")

    def tensor(self, code: int, shape: Sequence[int], buf: Any, offset: int) -> Any:
        """A tensor of the given dtype and shape over buf[offset:] (the received message)."""
        count = 1
        for s in shape:
            count *= s
        if self.torch_device is None:
            if code == FLOAT32:
                dt = np.float32
            elif code == FLOAT16:
                dt = np.float16
            else:
                dt = self.np_bf16
            return np.frombuffer(buf, dtype=dt, count=count, offset=offset).reshape(shape)
        torch = _torch
        dt = torch.float32 if code == FLOAT32 else torch.float16 if code == FLOAT16 else torch.bfloat16
        if count == 0:
            return torch.empty(tuple(shape), dtype=dt, device=self.torch_device)
        t = torch.frombuffer(buf, dtype=dt, count=count, offset=offset).view(tuple(shape))
        if self.torch_device.type != "cpu":
            t = t.to(self.torch_device)
        return t

    def empty(self, code: int, shape: Sequence[int]) -> Any:
        """A tensor for an output that a region holds (its caller gave `out`)."""
        return self.tensor(code, shape, bytes(DTYPE_BYTES[code] * _count(shape)), 0)


def _count(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- messages assembled in place ----------------------------------------------------------------

_pybytes_new = ctypes.pythonapi.PyBytes_FromStringAndSize
_pybytes_new.restype = ctypes.py_object
_pybytes_new.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)


def assemble(parts: Sequence[Any], total: int, cuda: bool = False) -> bytes:
    """The message of parts (bytes, buffers, and CUDA tensors) as one bytes object.

    CPU parts are joined (one copy each); a message with CUDA tensors (`cuda`) is written into a fresh bytes
    object that nobody else has seen yet, each tensor copied from the device straight into its
    place, so that device data is copied once, not to a host tensor and again into the message.
    """
    if not cuda:
        return b"".join(parts)
    torch = _load_torch()
    out = _pybytes_new(None, total)
    view = torch.frombuffer(out, dtype=torch.uint8)
    at = 0
    for p in parts:
        if is_torch(p):
            n = p.numel() * p.element_size()
            view[at:at + n].copy_(p.view(-1).view(torch.uint8))
        else:
            n = len(p) if isinstance(p, bytes) else memoryview(p).nbytes
            view[at:at + n].copy_(torch.frombuffer(p, dtype=torch.uint8)) if n else None
        at += n
    if at != total:
        raise AssertionError(f"message assembled to {at} bytes, expected {total}")
    return out
