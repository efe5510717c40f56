"""The raw wire coding of Attend, AttendStream, Step, BatchStep and Echo.

The same bytes the C++ client writes (client/src/wire_coding.cc): protobuf's wire format, written
here with each tensor's bytes appended after its header, so that no protobuf message ever holds a
copy of a tensor; and responses read the other way, o and lse left where they lie in the received
message (the outputs are views over it). Other messages go through protobuf (attnd._proto).
Field numbers are those of attention.proto (the tests check them against the descriptors).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, List, Optional, Sequence, Tuple

from ._tensors import DTYPE_BYTES, Payload

# wire types
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_MASK64 = (1 << 64) - 1

# AttendRequest
ATTEND_Q, ATTEND_K, ATTEND_V = 1, 2, 3
ATTEND_CU_Q, ATTEND_CU_K, ATTEND_CAUSAL, ATTEND_SCALE, ATTEND_WINDOW = 4, 5, 6, 7, 8
ATTEND_RETURN_LSE, ATTEND_PRIORITY, ATTEND_REQUEST_ID = 9, 10, 11
ATTEND_O_REGION, ATTEND_LSE_REGION, ATTEND_FP8 = 12, 13, 20
# StepRequest
STEP_SESSION, STEP_LAYER, STEP_Q, STEP_K, STEP_V = 1, 2, 3, 4, 5
STEP_SCALE, STEP_RETURN_LSE, STEP_WINDOW = 6, 7, 8
STEP_O_REGION, STEP_LSE_REGION = 20, 21
STEP_K_NEW_SCALES, STEP_V_NEW_SCALES = 22, 23
BATCH_STEPS = 1
# Tensor, RegionSlice, SlidingWindow
TENSOR_DTYPE, TENSOR_SHAPE, TENSOR_DATA, TENSOR_REGION = 1, 2, 3, 4
SLICE_REGION, SLICE_OFFSET, SLICE_BYTES = 1, 2, 3
WINDOW_LEFT, WINDOW_RIGHT = 1, 2
# EchoRequest / EchoResponse
ECHO_PAYLOAD, ECHO_RESPONSE_BYTES = 1, 2
# AttendResponse / StepResponse / BatchStepResponse
RESP_O, RESP_LSE = 1, 2
ATTEND_RESP_TIMING, ATTEND_RESP_REQUEST_ID = 3, 4
ATTEND_RESP_STATUS_CODE, ATTEND_RESP_STATUS_MESSAGE = 5, 6
STEP_RESP_CACHED, STEP_RESP_TIMING = 3, 4
RESULT_STATUS_CODE, RESULT_STATUS_MESSAGE, RESULT_RESPONSE = 1, 2, 3

_SMALL = [bytes((i,)) for i in range(128)]


def varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    n &= _MASK64  # negative int32/int64: ten bytes, as protobuf writes them
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def fixed_varint(n: int, width: int) -> bytes:
    """n as a varint of exactly `width` bytes (padded with continuation bytes: protobuf reads a
    non-minimal varint as the same value), so that a value can be rewritten in place. A negative
    n takes ten bytes, as protobuf writes it."""
    n &= _MASK64
    out = bytearray()
    for _ in range(width - 1):
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    if n > 0x7F:
        raise ValueError(f"{n} does not fit a varint of {width} bytes")
    out.append(n)
    return bytes(out)


LAYER_WIDTH = 10  # bytes of a layer rewritten in place: any int32, negative ones too


def _tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def _len_field(number: int, body: bytes) -> bytes:
    return _tag(number, _LEN) + varint(len(body)) + body


def _varint_field(number: int, value: int) -> bytes:
    return _tag(number, _VARINT) + varint(value)


def _packed(number: int, values: Sequence[int]) -> bytes:
    if not values:
        return b""
    return _len_field(number, b"".join(varint(int(v)) for v in values))


def _packed_floats(number: int, values: Optional[Sequence[float]]) -> bytes:
    if values is None or len(values) == 0:
        return b""
    return _len_field(number, struct.pack(f"<{len(values)}f", *(float(v) for v in values)))


def _float_field(number: int, value: float) -> bytes:
    packed = struct.pack("<f", value)
    return b"" if packed == b"\0\0\0\0" else _tag(number, _FIXED32) + packed


def _window(number: int, window: Optional[Tuple[int, int]]) -> bytes:
    if window is None:
        return b""
    left, right = int(window[0]), int(window[1])
    if left < 0 and right < 0:
        return b""
    body = (_varint_field(WINDOW_LEFT, left) if left else b"") + \
           (_varint_field(WINDOW_RIGHT, right) if right else b"")
    return _len_field(number, body)


def region_slice(number: int, region: str, offset: int, nbytes: int) -> bytes:
    body = _len_field(SLICE_REGION, region.encode())
    if offset:
        body += _varint_field(SLICE_OFFSET, offset)
    if nbytes:
        body += _varint_field(SLICE_BYTES, nbytes)
    return _len_field(number, body)


@lru_cache(maxsize=4096)
def _tensor_head(number: int, dtype: int, shape: Tuple[int, ...], nbytes: int) -> bytes:
    """A Tensor field up to and including its data field's tag and length (the data follows)."""
    fields = _varint_field(TENSOR_DTYPE, dtype) + _packed(TENSOR_SHAPE, shape)
    if nbytes == 0:
        return _len_field(number, fields)
    data_head = _tag(TENSOR_DATA, _LEN) + varint(nbytes)
    return _tag(number, _LEN) + varint(len(fields) + len(data_head) + nbytes) + fields + data_head


@lru_cache(maxsize=4096)
def _region_tensor_parts(dtype: int, shape: Tuple[int, ...], region: str) -> Tuple[bytes, bytes]:
    """A Tensor's dtype and shape fields, and its slice's region field (what region_slice writes
    first): the same for every step of a decode loop over one region."""
    return (_varint_field(TENSOR_DTYPE, dtype) + _packed(TENSOR_SHAPE, shape),
            _len_field(SLICE_REGION, region.encode()))


class Message:
    """A message being written: its parts (bytes and tensor payloads, in order) and size."""

    __slots__ = ("parts", "size", "cuda")

    def __init__(self) -> None:
        self.parts: List[Any] = []
        self.size = 0
        self.cuda = False  # a part is a CUDA tensor

    def add(self, b: bytes) -> None:
        if b:
            self.parts.append(b)
            self.size += len(b)

    def tensor(self, number: int, p: Payload, region: Optional[Tuple[str, int]] = None) -> None:
        """Tensor p as field `number`: its bytes, or (region name, offset) in a shared region."""
        if region is not None:
            head, name = _region_tensor_parts(p.dtype, tuple(p.shape), region[0])
            body = name
            if region[1]:
                body += _varint_field(SLICE_OFFSET, region[1])
            if p.nbytes:
                body += _varint_field(SLICE_BYTES, p.nbytes)
            self.add(_len_field(number, head + _len_field(TENSOR_REGION, body)))
            return
        self.add(_tensor_head(number, p.dtype, tuple(p.shape), p.nbytes))
        if p.nbytes:
            self.parts.append(p.data)
            self.size += p.nbytes
            if p.cuda >= 0:
                self.cuda = True

    def embed(self, number: int, inner: "Message") -> None:
        self.add(_tag(number, _LEN) + varint(inner.size))
        self.parts.extend(inner.parts)
        self.size += inner.size
        self.cuda = self.cuda or inner.cuda


@dataclass
class Outputs:
    """Where o or lse is wanted: a region slice (name, offset, bytes) instead of the message."""

    o_region: Optional[Tuple[str, int, int]] = None
    lse_region: Optional[Tuple[str, int, int]] = None


def attend_request(q: Payload, k: Payload, v: Payload, regions: Sequence[Optional[Tuple[str, int]]],
                   cu_seqlens_q: Optional[Sequence[int]], cu_seqlens_k: Optional[Sequence[int]],
                   causal: bool, scale: float, window: Optional[Tuple[int, int]],
                   return_lse: bool, high_priority: bool, request_id: int,
                   outputs: Optional[Outputs], fp8: Optional[bytes] = None) -> Message:
    m = Message()
    m.tensor(ATTEND_Q, q, regions[0])
    m.tensor(ATTEND_K, k, regions[1])
    m.tensor(ATTEND_V, v, regions[2])
    tail = b""
    if cu_seqlens_q is not None:
        tail += _packed(ATTEND_CU_Q, cu_seqlens_q)
    if cu_seqlens_k is not None:
        tail += _packed(ATTEND_CU_K, cu_seqlens_k)
    if causal:
        tail += _varint_field(ATTEND_CAUSAL, 1)
    if scale:
        tail += _float_field(ATTEND_SCALE, scale)
    tail += _window(ATTEND_WINDOW, window)
    if return_lse:
        tail += _varint_field(ATTEND_RETURN_LSE, 1)
    if high_priority:
        tail += _varint_field(ATTEND_PRIORITY, 1)
    if request_id:
        tail += _varint_field(ATTEND_REQUEST_ID, request_id)
    if outputs is not None:
        if outputs.o_region is not None:
            tail += region_slice(ATTEND_O_REGION, *outputs.o_region)
        if outputs.lse_region is not None:
            tail += region_slice(ATTEND_LSE_REGION, *outputs.lse_region)
    if fp8 is not None:
        tail += _len_field(ATTEND_FP8, fp8)
    m.add(tail)
    return m


def step_request(session_id: str, layer: int, q: Payload, k: Payload, v: Payload,
                 regions: Sequence[Optional[Tuple[str, int]]], scale: float, return_lse: bool,
                 window: Optional[Tuple[int, int]], outputs: Optional[Outputs],
                 layer_width: int = 0, k_new_scales: Optional[Sequence[float]] = None,
                 v_new_scales: Optional[Sequence[float]] = None) -> Message:
    """A StepRequest. With layer_width, the layer is written even when 0, as a varint of that
    many bytes right after the session id's field (layer_offset says where its value starts).
    k_new_scales, v_new_scales: the scales of k_new and v_new sent as FP8 codes."""
    m = Message()
    head = _len_field(STEP_SESSION, session_id.encode()) if session_id else b""
    if layer_width:
        head += _tag(STEP_LAYER, _VARINT) + fixed_varint(layer, layer_width)
    elif layer:
        head += _varint_field(STEP_LAYER, layer)
    m.add(head)
    m.tensor(STEP_Q, q, regions[0])
    m.tensor(STEP_K, k, regions[1])
    m.tensor(STEP_V, v, regions[2])
    tail = b""
    if scale:
        tail += _float_field(STEP_SCALE, scale)
    if return_lse:
        tail += _varint_field(STEP_RETURN_LSE, 1)
    tail += _window(STEP_WINDOW, window)
    if outputs is not None:
        if outputs.o_region is not None:
            tail += region_slice(STEP_O_REGION, *outputs.o_region)
        if outputs.lse_region is not None:
            tail += region_slice(STEP_LSE_REGION, *outputs.lse_region)
    tail += _packed_floats(STEP_K_NEW_SCALES, k_new_scales)
    tail += _packed_floats(STEP_V_NEW_SCALES, v_new_scales)
    m.add(tail)
    return m


def layer_offset(session_id: str) -> int:
    """Where the layer's value starts in a StepRequest written with layer_width."""
    return (len(_len_field(STEP_SESSION, session_id.encode())) if session_id else 0) + \
        len(_tag(STEP_LAYER, _VARINT))


def batch_step_request(steps: Sequence[Message]) -> Message:
    m = Message()
    for s in steps:
        m.embed(BATCH_STEPS, s)
    return m


def echo_request(payload: Any, nbytes: int, response_bytes: int) -> Message:
    m = Message()
    if nbytes:
        m.add(_tag(ECHO_PAYLOAD, _LEN) + varint(nbytes))
        m.parts.append(payload)
        m.size += nbytes
    if response_bytes:
        m.add(_varint_field(ECHO_RESPONSE_BYTES, response_bytes))
    return m


# ---- reading -----------------------------------------------------------------------------------


class Malformed(Exception):
    """The server's answer could not be read (a bug or a server of another protocol)."""


def _read_varint(buf: bytes, at: int, end: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if at >= end or shift > 63:
            raise Malformed("truncated or over-long varint")
        b = buf[at]
        at += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, at
        shift += 7


def fields(buf: bytes, at: int, end: int) -> List[Tuple[int, int, Any]]:
    """The fields of the message in buf[at:end]: (number, wire type, value), where a
    length-delimited value is its (start, end) span, a fixed one its raw bytes."""
    out = []
    while at < end:
        key, at = _read_varint(buf, at, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, at = _read_varint(buf, at, end)
        elif wire_type == _LEN:
            n, at = _read_varint(buf, at, end)
            if at + n > end:
                raise Malformed(f"field {number}: length {n} runs past the end of its message")
            value = (at, at + n)
            at += n
        elif wire_type == _FIXED64:
            value = buf[at:at + 8]
            at += 8
        elif wire_type == _FIXED32:
            value = buf[at:at + 4]
            at += 4
        else:
            raise Malformed(f"field {number}: unsupported wire type {wire_type}")
        if at > end:
            raise Malformed(f"field {number} runs past the end of its message")
        out.append((number, wire_type, value))
    return out


def signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class TensorView:
    """A received Tensor: dtype, shape, and the span of its data in the message (or its region)."""

    __slots__ = ("dtype", "shape", "start", "end", "region")

    def __init__(self) -> None:
        self.dtype = 0
        self.shape: List[int] = []
        self.start = self.end = 0
        self.region: Optional[str] = None


def _varint_at(buf: bytes, at: int, end: int) -> Tuple[int, int]:
    """A varint at buf[at] (the one-byte case inline, the rest in _read_varint)."""
    if at < end:
        b = buf[at]
        if b < 0x80:
            return b, at + 1
    return _read_varint(buf, at, end)


def read_tensor(buf: bytes, span: Tuple[int, int], what: str) -> TensorView:
    t = TensorView()
    at, end = span
    while at < end:
        key, at = _varint_at(buf, at, end)
        number, wt = key >> 3, key & 7
        if wt == _VARINT:
            value, at = _varint_at(buf, at, end)
            if number == TENSOR_DTYPE:
                t.dtype = value
            elif number == TENSOR_SHAPE:  # unpacked encoding
                t.shape.append(signed64(value))
            continue
        if wt != _LEN:
            at = _skip(buf, at, end, number, wt)
            continue
        n, at = _varint_at(buf, at, end)
        stop = at + n
        if stop > end:
            raise Malformed(f"{what}: field {number}: length {n} runs past the end of its message")
        if number == TENSOR_DATA:
            t.start, t.end = at, stop
        elif number == TENSOR_SHAPE:
            shape = []
            while at < stop:
                v, at = _varint_at(buf, at, stop)
                shape.append(signed64(v))
            t.shape = shape
        elif number == TENSOR_REGION:
            for n2, w2, v2 in fields(buf, at, stop):
                if n2 == SLICE_REGION and w2 == _LEN:
                    t.region = bytes(buf[v2[0]:v2[1]]).decode()
        at = stop
    if t.dtype not in DTYPE_BYTES:
        raise Malformed(f"{what}: unknown dtype {t.dtype}")
    need = DTYPE_BYTES[t.dtype]
    for x in t.shape:
        if x < 0:
            raise Malformed(f"{what}: impossible shape {t.shape}")
        need *= x
    if t.region is None and t.end - t.start != need:
        raise Malformed(f"{what}: {t.end - t.start} bytes where its shape {t.shape} and dtype "
                        f"need {need}")
    return t


def _skip(buf: bytes, at: int, end: int, number: int, wt: int) -> int:
    """Past a field of another wire type than the reader expects (as protobuf skips unknowns)."""
    if wt == _VARINT:
        return _read_varint(buf, at, end)[1]
    if wt == _FIXED64:
        at += 8
    elif wt == _FIXED32:
        at += 4
    elif wt == _LEN:
        n, at = _read_varint(buf, at, end)
        at += n
    else:
        raise Malformed(f"field {number}: unsupported wire type {wt}")
    if at > end:
        raise Malformed(f"field {number} runs past the end of its message")
    return at


class ServerTiming:
    """Server-side timing of one request, in microseconds (attn.v1 ServerTiming): queue_us,
    transfer_us, compute_us, total_us, batch_requests, batch_tokens, host_copy_us. Read from
    the received message when first asked for."""

    __slots__ = ("_buf", "_start", "_end", "_values")
    _FIELDS = ("queue_us", "transfer_us", "compute_us", "total_us", "batch_requests",
               "batch_tokens", "host_copy_us")

    def __init__(self, buf: bytes = b"", span: Tuple[int, int] = (0, 0)):
        self._buf = buf
        self._start, self._end = span
        self._values: Optional[dict] = None

    def _parse(self) -> dict:
        values = {"queue_us": 0.0, "transfer_us": 0.0, "compute_us": 0.0, "total_us": 0.0,
                  "batch_requests": 0, "batch_tokens": 0, "host_copy_us": 0.0}
        for number, wt, value in fields(self._buf, self._start, self._end):
            if wt == _FIXED64 and number in _TIMING_DOUBLES:
                values[_TIMING_DOUBLES[number]] = struct.unpack("<d", value)[0]
            elif wt == _VARINT and number in _TIMING_INTS:
                values[_TIMING_INTS[number]] = signed64(value)
        self._values = values
        self._buf = b""
        return values

    def __getattr__(self, name: str) -> Any:
        if name in ServerTiming._FIELDS:
            values = self._values if self._values is not None else self._parse()
            return values[name]
        raise AttributeError(name)

    def as_dict(self) -> dict:
        return dict(self._values if self._values is not None else self._parse())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ServerTiming) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return "ServerTiming(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


_TIMING_DOUBLES = {1: "queue_us", 2: "transfer_us", 3: "compute_us", 4: "total_us",
                   7: "host_copy_us"}
_TIMING_INTS = {5: "batch_requests", 6: "batch_tokens"}


def read_timing(buf: bytes, span: Tuple[int, int]) -> ServerTiming:
    return ServerTiming(buf, span)


_EMPTY_TIMING = ServerTiming()


class Response:
    """An AttendResponse or StepResponse as read: o, lse, timing and the scalar fields."""

    __slots__ = ("o", "lse", "timing", "request_id", "status_code", "status_message",
                 "cached_tokens")

    def __init__(self) -> None:
        self.o: Optional[TensorView] = None
        self.lse: Optional[TensorView] = None
        self.timing = _EMPTY_TIMING
        self.request_id = 0
        self.status_code = 0
        self.status_message = ""
        self.cached_tokens = 0


def read_response(buf: bytes, span: Optional[Tuple[int, int]], step: bool) -> Response:
    """An AttendResponse (step=False) or StepResponse (step=True) in buf[span] (all of buf when
    span is None)."""
    at, end = span if span is not None else (0, len(buf))
    r = Response()
    timing_field = STEP_RESP_TIMING if step else ATTEND_RESP_TIMING
    while at < end:
        key, at = _varint_at(buf, at, end)
        number, wt = key >> 3, key & 7
        if wt == _LEN:
            n, at = _varint_at(buf, at, end)
            stop = at + n
            if stop > end:
                raise Malformed(f"field {number}: length {n} runs past the end of its message")
            if number == RESP_O:
                r.o = read_tensor(buf, (at, stop), "o")
            elif number == RESP_LSE:
                r.lse = read_tensor(buf, (at, stop), "lse")
            elif number == timing_field:
                r.timing = ServerTiming(buf, (at, stop))
            elif not step and number == ATTEND_RESP_STATUS_MESSAGE:
                r.status_message = bytes(buf[at:stop]).decode("utf-8", "replace")
            at = stop
        elif wt == _VARINT:
            value, at = _varint_at(buf, at, end)
            if step and number == STEP_RESP_CACHED:
                r.cached_tokens = signed64(value)
            elif not step and number == ATTEND_RESP_REQUEST_ID:
                r.request_id = value
            elif not step and number == ATTEND_RESP_STATUS_CODE:
                r.status_code = signed64(value)
        else:
            at = _skip(buf, at, end, number, wt)
    return r


def read_batch_step_response(buf: bytes) -> List[Tuple[int, str, Optional[Response]]]:
    """The results of a BatchStepResponse: (status code, message, response) each."""
    out = []
    for number, wt, value in fields(buf, 0, len(buf)):
        if number != BATCH_STEPS or wt != _LEN:
            continue
        code, message, response = 0, "", None
        for n2, w2, v2 in fields(buf, value[0], value[1]):
            if n2 == RESULT_STATUS_CODE and w2 == _VARINT:
                code = signed64(v2)
            elif n2 == RESULT_STATUS_MESSAGE and w2 == _LEN:
                message = bytes(buf[v2[0]:v2[1]]).decode("utf-8", "replace")
            elif n2 == RESULT_RESPONSE and w2 == _LEN:
                response = read_response(buf, v2, step=True)
        out.append((code, message, response))
    return out


_RESULT_TAG = (BATCH_STEPS << 3) | _LEN
_RESPONSE_TAG = (RESULT_RESPONSE << 3) | _LEN
_O_TAG = (RESP_O << 3) | _LEN


def all_steps_in_regions(buf: bytes, count: int, o_bytes: int) -> bool:
    """True when the BatchStepResponse in buf holds `count` results, each nothing but a response
    (status 0) whose o field is shorter than o_bytes (so its data is not in the message: it went
    to the region asked for). False means "read it all" (read_batch_step_response): an item
    failed, or the answer is laid out otherwise (a length over two bytes, a malformed answer).
    The per-step check of a prepared BatchStep whose outputs all lie in regions."""
    at, end, seen = 0, len(buf), 0
    while at < end:
        if buf[at] != _RESULT_TAG:
            return False
        n = buf[at + 1]
        at += 2
        if n >= 0x80:
            if at >= end or buf[at] >= 0x80:
                return False
            n = (n & 0x7F) | (buf[at] << 7)
            at += 1
        stop = at + n
        # the result: only its response field (a failed item starts with its status_code)
        if stop > end or n < 4 or buf[at] != _RESPONSE_TAG:
            return False
        m = buf[at + 1]
        if m >= 0x80:
            if buf[at + 2] >= 0x80:
                return False
            m = (m & 0x7F) | (buf[at + 2] << 7)
            at += 3
        else:
            at += 2
        # the response's first field is o, and o holds no data
        if at + m != stop or m < 2 or buf[at] != _O_TAG or buf[at + 1] >= 0x80 or \
                buf[at + 1] >= o_bytes:
            return False
        at = stop
        seen += 1
    return seen == count


def read_echo_response(buf: bytes) -> Tuple[int, int]:
    """The span of an EchoResponse's payload."""
    span = (0, 0)
    for number, wt, value in fields(buf, 0, len(buf)):
        if number == ECHO_PAYLOAD and wt == _LEN:
            span = value
    return span


def identity(b: bytes) -> bytes:
    """The serializer and deserializer of the raw calls: the message's bytes as they are."""
    return b
