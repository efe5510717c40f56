"""Same-host shared memory with attnd: host regions over numpy arrays, GPU regions over torch.

A region is registered once (``client.register_region(region)``) and reused: any tensor that lies
inside a registered region, given to ``attend`` or ``step`` as q, k or v (or as ``out`` /
``lse_out``), travels as (region, offset, bytes) instead of its bytes, so a co-located process
sends no tensor data over gRPC. attnd must run with ``--allow_shared_memory``.

- ``HostRegion(nbytes)``: a sealed memfd mapped here, handed to attnd over its region socket
  (the protocol of the comment above ``service SharedMemory`` in attention.proto). Views:
  ``region.array(shape, dtype)`` (numpy), ``region.tensor(shape, dtype)`` (torch, CPU).
- ``CudaRegion(nbytes, device)``: device memory allocated with the CUDA driver (``cuMemAlloc``,
  its own allocation, so that its legacy CUDA IPC handle covers exactly it), shared by that
  handle; needs attnd's CUDA backend. Views: ``region.tensor(shape, dtype)`` (torch, on the GPU).
  Inputs and outputs of a call must then all be in GPU regions. The caller must make the
  device work that wrote the inputs complete before the call (this client synchronizes the
  current torch stream of the tensors' device for you), and attnd has written the outputs when
  the call returns.

Both hand out views with a bump allocator (``array``/``tensor`` without an offset take the next
256-byte-aligned piece; ``reset()`` starts over).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
import threading
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import _tensors
from .errors import AttndError, InvalidArgument, Unavailable

_ALIGN = 256
_MEMFD_MAGIC = b"ATTNFD01"
_LEASE_MAGIC = b"ATTNLS01"


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    n = _tensors.DTYPE_BYTES[_tensors.dtype_code(dtype)] if not isinstance(dtype, np.dtype) \
        else dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


class _BumpAllocator:
    """Hands out aligned pieces of a region in order."""

    def __init__(self, size: int):
        self.size = size
        self.next = 0

    def take(self, nbytes: int, offset: Optional[int]) -> int:
        if offset is None:
            offset = self.next
            self.next = (offset + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if offset < 0 or offset + nbytes > self.size:
            raise InvalidArgument(f"region of {self.size} bytes has no room for {nbytes} bytes at "
                                  f"offset {offset}")
        return offset


class HostRegion:
    """A host shared-memory region: a sealed memfd of ``nbytes`` mapped read-write here."""

    kind = "host"
    cuda_device = -1

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise InvalidArgument("a region needs at least one byte")
        self.nbytes = int(nbytes)
        self.fd = os.memfd_create("attnd-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            # Backed now: a sparse page that cannot be allocated later would be SIGBUS, here or
            # in attnd.
            os.posix_fallocate(self.fd, 0, self.nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self._bytes.__array_interface__["data"][0]
        self._alloc = _BumpAllocator(self.nbytes)

    def array(self, shape: Sequence[int], dtype: Any, offset: Optional[int] = None) -> np.ndarray:
        """A numpy view of the region: float32, float16, uint16 (bf16 bits) or ml_dtypes.bfloat16."""
        dt = np.dtype(dtype)
        n = _nbytes(shape, dt)
        at = self._alloc.take(n, offset)
        return self._bytes[at:at + n].view(dt).reshape(tuple(shape))

    def tensor(self, shape: Sequence[int], dtype: Any, offset: Optional[int] = None) -> Any:
        """A torch (CPU) view of the region."""
        torch = _tensors._load_torch()
        n = _nbytes(shape, dtype)
        at = self._alloc.take(n, offset)
        t = torch.frombuffer(self._map, dtype=torch.uint8, count=n, offset=at)
        return t.view(dtype).view(tuple(shape))

    def reset(self) -> None:
        """Start handing out views from the region's start again."""
        self._alloc.next = 0

    def close(self) -> None:
        """Unmaps the region (once no view of it is left) and closes its memfd."""
        self._bytes = None
        try:
            self._map.close()
        except BufferError:
            pass  # views still exist: unmapped when they go
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "HostRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- CUDA ---------------------------------------------------------------------------------------


class _CudaDriver:
    """The few CUDA driver calls a GPU region needs, through ctypes (libcuda comes with the driver)."""

    _instance: Optional["_CudaDriver"] = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "_CudaDriver":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise AttndError(f"GPU regions need the CUDA driver (libcuda.so.1): {e}") from e
        self._check(self.lib.cuInit(0), "cuInit")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise AttndError(f"{what} failed: CUDA error {rc} "
                             f"({name.value.decode() if name.value else '?'})")

    def context(self, device: int) -> ctypes.c_void_p:
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                    "cuDevicePrimaryCtxRetain")
        return ctx

    def push(self, ctx: ctypes.c_void_p) -> None:
        self._check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")

    def pop(self) -> None:
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctx)), "cuCtxPopCurrent")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)),
                    "cuMemAlloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._check(self.lib.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")

    def address_range(self, ptr: int) -> Tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                     ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
        return base.value, size.value

    def ipc_handle(self, ptr: int) -> bytes:
        handle = (ctypes.c_char * 64)()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(ptr)),
                    "cuIpcGetMemHandle")
        return bytes(handle)


class _DeviceAllocation:
    """Device memory of a GPU region: freed by free(), or once nothing refers to it any more
    (the region and every tensor over it gone). Torch tensors over it hold it through
    __cuda_array_interface__."""

    def __init__(self, driver: "_CudaDriver", ctx: ctypes.c_void_p, ptr: int, nbytes: int,
                 owned: bool, keep: Any = None):
        self.driver, self.ctx, self.ptr, self.nbytes, self.owned = driver, ctx, ptr, nbytes, owned
        self.keep = keep  # from_tensor: the tensor whose allocation this is
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}

    def free(self) -> None:
        if self.owned and self.ptr:
            self.driver.push(self.ctx)
            try:
                self.driver.free(self.ptr)
            finally:
                self.driver.pop()
        self.ptr = 0
        self.keep = None

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


class CudaRegion:
    """GPU memory shared with attnd by a legacy CUDA IPC handle (attnd's CUDA backend only).

    ``CudaRegion(nbytes, device)`` allocates its own memory; ``CudaRegion.from_tensor(t)`` shares
    the allocation an existing CUDA tensor lies in (PyTorch's caching allocator's segment, from its
    start: the region covers the whole segment, and the tensor is at an offset inside it).
    """

    kind = "cuda"

    def __init__(self, nbytes: int, device: int = 0, *, _existing: Optional[Tuple[int, int]] = None,
                 _keep: Any = None):
        if nbytes <= 0:
            raise InvalidArgument("a region needs at least one byte")
        torch = _tensors._load_torch()
        self.cuda_device = int(device)
        driver = _CudaDriver.get()
        ctx = driver.context(self.cuda_device)
        driver.push(ctx)
        try:
            ptr, size = (driver.alloc(int(nbytes)), int(nbytes)) if _existing is None else _existing
            try:
                self.ipc_handle = driver.ipc_handle(ptr)
            except AttndError:
                if _existing is None:
                    driver.free(ptr)
                raise
        finally:
            driver.pop()
        self._allocation = _DeviceAllocation(driver, ctx, ptr, size, _existing is None, _keep)
        self.address, self.nbytes = ptr, size
        self._bytes = torch.as_tensor(self._allocation, device=f"cuda:{self.cuda_device}")
        self._alloc = _BumpAllocator(self.nbytes)

    @classmethod
    def from_tensor(cls, t: Any) -> "CudaRegion":
        """The region of the allocation CUDA tensor t lies in (t must stay alive meanwhile)."""
        if not t.is_cuda:
            raise InvalidArgument("from_tensor: the tensor is not on a CUDA device")
        driver = _CudaDriver.get()
        device = t.device.index or 0
        ctx = driver.context(device)
        driver.push(ctx)
        try:
            base, size = driver.address_range(t.data_ptr())
        finally:
            driver.pop()
        return cls(size, device, _existing=(base, size), _keep=t)

    def tensor(self, shape: Sequence[int], dtype: Any, offset: Optional[int] = None) -> Any:
        """A torch view of the region on its device (float32, float16, bfloat16)."""
        n = _nbytes(shape, dtype)
        at = self._alloc.take(n, offset)
        return self._bytes[at:at + n].view(dtype).view(tuple(shape))

    def reset(self) -> None:
        self._alloc.next = 0

    def close(self) -> None:
        """Frees memory this region allocated, now (tensors over it must not be used after).
        Unregister it from every client first: attnd must not hold an imported handle of freed
        memory. Without close(), the memory goes when the region and its tensors are all gone."""
        self._allocation.free()
        self.address = 0
        self._bytes = None

    def __enter__(self) -> "CudaRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- registration -------------------------------------------------------------------------------


class Registered:
    """A region registered with one attnd under a name: its address range, for finding tensors."""

    __slots__ = ("name", "region", "start", "end", "cuda_device")

    def __init__(self, name: str, region: Any):
        self.name = name
        self.region = region
        self.start = region.address
        self.end = region.address + region.nbytes
        self.cuda_device = region.cuda_device


class RegionTable:
    """The regions a client has registered, and lookups of tensors in them."""

    def __init__(self) -> None:
        self.entries: List[Registered] = []
        self._lock = threading.Lock()
        self._specs: Tuple[List[Registered], Tuple[Tuple[int, int, int, bytes], ...]] = ([], ())

    def specs(self) -> Tuple[Tuple[int, int, int, bytes], ...]:
        """The entries as (start, end, CUDA device, name) tuples, for attnd._fast's coding (made
        again only when the entries change)."""
        entries = self.entries
        cached = self._specs
        if cached[0] is not entries:
            cached = (entries, tuple((e.start, e.end, e.cuda_device, e.name.encode())
                                     for e in entries))
            self._specs = cached
        return cached[1]

    def add(self, r: Registered) -> None:
        with self._lock:
            self.entries = self.entries + [r]

    def remove(self, name: str) -> Optional[Registered]:
        with self._lock:
            found = [e for e in self.entries if e.name == name]
            self.entries = [e for e in self.entries if e.name != name]
            return found[0] if found else None

    def find(self, ptr: int, nbytes: int, cuda_device: int) -> Optional[Tuple[str, int]]:
        """(region name, offset) when [ptr, ptr + nbytes) lies in a region of that memory."""
        for e in self.entries:
            if e.cuda_device == cuda_device and e.start <= ptr and ptr + nbytes <= e.end:
                return e.name, ptr - e.start
        return None


class RegionSocket:
    """A connection to attnd's region socket: passes memfds and takes leases. attnd drops the
    regions registered through it when it closes (close(), or this process's exit)."""

    def __init__(self, path: str):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            raise Unavailable(f"cannot connect to attnd's region socket {path}: {e} (shared "
                              "memory works only on attnd's host, as attnd's user)") from e
        self._lock = threading.Lock()

    def _answer(self) -> str:
        data = self._sock.recv(512)
        if not data:
            raise Unavailable("region socket closed by attnd")
        line = data.decode(errors="replace").rstrip("\n")
        if line.startswith("OK "):
            return line[3:]
        raise InvalidArgument("attnd refused: " + (line[4:] if line.startswith("ERR ") else line))

    def send_fd(self, fd: int) -> str:
        """Passes a memfd; returns the one-time handle RegisterRegion claims."""
        with self._lock:
            socket.send_fds(self._sock, [_MEMFD_MAGIC], [fd])
            return self._answer()

    def lease(self) -> str:
        """A lease tying a GPU region to this connection."""
        with self._lock:
            self._sock.send(_LEASE_MAGIC)
            return self._answer()

    def close(self) -> None:
        self._sock.close()


_name_lock = threading.Lock()
_name_counter = 0


def next_region_name() -> str:
    global _name_counter
    with _name_lock:
        _name_counter += 1
        return f"py{os.getpid()}-{_name_counter}"
