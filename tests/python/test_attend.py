"""Attend through the Python client against the float64 reference: every dtype (numpy) and shape
family, outputs into caller buffers, Echo, and the wire coding's field numbers."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import attnd
from attnd import _proto, _tensors, _wire
from conftest import (TOLERANCE, check_lse, make, poisoned, reference, relative_error, values,
                      wire_dtype_names)

# (name, q rows per sequence, k rows per sequence, heads, kv heads, head dim, options)
FAMILIES = [
    ("one-sequence", [37], [53], 4, 4, 64, {}),
    ("causal-bottom-right", [20], [50], 4, 4, 64, {"causal": True}),
    ("varlen-gqa-causal", [5, 33, 1, 17], [5, 40, 9, 17], 8, 2, 128, {"causal": True}),
    ("mqa-d32", [12, 30], [12, 30], 6, 1, 32, {}),
    ("sliding-window-causal", [40], [40], 4, 2, 64, {"causal": True, "window": (8, 0)}),
    ("window-both-sides", [30], [45], 2, 2, 64, {"window": (5, 3)}),
    ("scale", [16, 9], [24, 9], 4, 4, 64, {"scale": 0.37}),
    ("d96", [25], [31], 3, 1, 96, {"causal": True}),
    ("d256", [9, 14], [11, 14], 2, 2, 256, {}),
    ("rows-without-keys", [6, 4, 3], [6, 0, 2], 2, 2, 64, {"causal": True}),
]


_head_dims = []


def supported_head_dims(client):
    if not _head_dims:
        _head_dims.extend(client.info().head_dims)
    return _head_dims


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("dtype", wire_dtype_names())
@pytest.mark.parametrize("family", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_attend_matches_float64_reference(client, family, dtype):
    name, lq, lk, heads, kv_heads, d, opts = family
    if d not in supported_head_dims(client):
        pytest.skip(f"this attnd was built without head_dim {d} (ATTN_HEAD_DIMS)")
    rng = np.random.default_rng(zlib.crc32(f"{name}/{dtype}".encode()))
    cu_q, cu_k = _cu(lq), _cu(lk)
    q, q64 = make(rng, (cu_q[-1], heads, d), dtype)
    k, k64 = make(rng, (cu_k[-1], kv_heads, d), dtype)
    v, v64 = make(rng, (cu_k[-1], kv_heads, d), dtype)
    varlen = len(lq) > 1
    r = client.attend(q, k, v, cu_seqlens_q=cu_q if varlen else None,
                      cu_seqlens_k=cu_k if varlen else None, return_lse=True, **opts)
    o_ref, lse_ref = reference(q64, k64, v64, cu_q, cu_k, **opts)
    assert r.o.shape == q.shape and r.o.dtype == q.dtype
    assert relative_error(values(r.o, dtype), o_ref) <= TOLERANCE[dtype.split("-")[0]]
    check_lse(r.lse, lse_ref)
    assert r.lse.dtype == np.float32 and r.timing.total_us > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attend_into_caller_buffers(client, dtype):
    rng = np.random.default_rng(7)
    q, q64 = make(rng, (50, 4, 64), dtype)
    k, k64 = make(rng, (60, 2, 64), dtype)
    v, v64 = make(rng, (60, 2, 64), dtype)
    out = poisoned(q.shape, dtype)
    if dtype == "fp32":
        out = out.astype(np.float32)
    lse_out = np.full((4, 50), np.nan, dtype=np.float32)
    r = client.attend(q, k, v, causal=True, return_lse=True, out=out, lse_out=lse_out)
    assert r.o is out and r.lse is lse_out
    o_ref, lse_ref = reference(q64, k64, v64, causal=True)
    assert relative_error(values(out, dtype), o_ref) <= TOLERANCE[dtype]
    check_lse(lse_out, lse_ref)


def test_non_contiguous_inputs_are_sent_by_value(client):
    rng = np.random.default_rng(3)
    big, big64 = make(rng, (40, 8, 64), "fp16")
    q, q64 = big[:, ::2], big64[:, ::2]  # every other head: not contiguous
    k, k64 = make(rng, (40, 4, 64), "fp16")
    r = client.attend(q, k, k, causal=True)
    o_ref, _ = reference(q64, k64, k64, causal=True)
    assert relative_error(values(r.o, "fp16"), o_ref) <= TOLERANCE["fp16"]


def test_outputs_are_read_only_views_of_the_answer(client):
    rng = np.random.default_rng(4)
    q, _ = make(rng, (8, 2, 64), "fp32")
    o = client.attend(q, q, q).o
    assert not o.flags.writeable  # a view of the received message, not a copy
    o.copy()[0, 0, 0] = 1.0


def test_echo_round_trips_bytes_and_arrays(client):
    payload = np.random.default_rng(5).integers(0, 255, 100_000, dtype=np.uint8).tobytes()
    assert bytes(client.echo(payload)) == payload
    assert bytes(client.echo(payload, response_bytes=1000)) == payload[:1000]
    arr = np.arange(1000, dtype=np.float16)
    assert bytes(client.echo(arr)) == arr.tobytes()
    assert bytes(client.echo(b"")) == b""


def test_info_and_health(client):
    info = client.info()
    assert info.backend in ("cpu", "cuda")
    assert info.replica_id and 128 in info.head_dims
    assert client.health() is True


def test_many_threads_share_one_client(server):
    import concurrent.futures

    rng = np.random.default_rng(6)
    q, q64 = make(rng, (32, 4, 64), "fp16")
    o_ref, _ = reference(q64, q64, q64, causal=True)
    with attnd.Client(server.target, connections=3) as c:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda _: c.attend(q, q, q, causal=True).o, range(24)))
    for o in outs:
        assert relative_error(values(o, "fp16"), o_ref) <= TOLERANCE["fp16"]


def test_wire_field_numbers_match_the_proto():
    f = _proto.field_number
    assert (f("AttendRequest", "q"), f("AttendRequest", "k"), f("AttendRequest", "v")) == \
        (_wire.ATTEND_Q, _wire.ATTEND_K, _wire.ATTEND_V)
    assert f("AttendRequest", "cu_seqlens_q") == _wire.ATTEND_CU_Q
    assert f("AttendRequest", "cu_seqlens_k") == _wire.ATTEND_CU_K
    assert f("AttendRequest", "causal") == _wire.ATTEND_CAUSAL
    assert f("AttendRequest", "softmax_scale") == _wire.ATTEND_SCALE
    assert f("AttendRequest", "window") == _wire.ATTEND_WINDOW
    assert f("AttendRequest", "return_lse") == _wire.ATTEND_RETURN_LSE
    assert f("AttendRequest", "priority") == _wire.ATTEND_PRIORITY
    assert f("AttendRequest", "request_id") == _wire.ATTEND_REQUEST_ID
    assert f("AttendRequest", "o_region") == _wire.ATTEND_O_REGION
    assert f("AttendRequest", "lse_region") == _wire.ATTEND_LSE_REGION
    assert f("AttendRequest", "fp8") == _wire.ATTEND_FP8
    assert f("StepRequest", "session_id") == _wire.STEP_SESSION
    assert f("StepRequest", "layer") == _wire.STEP_LAYER
    assert f("StepRequest", "k_new") == _wire.STEP_K and f("StepRequest", "v_new") == _wire.STEP_V
    assert f("StepRequest", "softmax_scale") == _wire.STEP_SCALE
    assert f("StepRequest", "return_lse") == _wire.STEP_RETURN_LSE
    assert f("StepRequest", "window") == _wire.STEP_WINDOW
    assert f("StepRequest", "o_region") == _wire.STEP_O_REGION
    assert f("StepRequest", "lse_region") == _wire.STEP_LSE_REGION
    assert f("Tensor", "dtype") == _wire.TENSOR_DTYPE and f("Tensor", "data") == _wire.TENSOR_DATA
    assert f("Tensor", "shape") == _wire.TENSOR_SHAPE and f("Tensor", "region") == _wire.TENSOR_REGION
    assert f("RegionSlice", "offset") == _wire.SLICE_OFFSET
    assert f("AttendResponse", "request_id") == _wire.ATTEND_RESP_REQUEST_ID
    assert f("AttendResponse", "status_code") == _wire.ATTEND_RESP_STATUS_CODE
    assert f("AttendResponse", "timing") == _wire.ATTEND_RESP_TIMING
    assert f("StepResponse", "cached_tokens") == _wire.STEP_RESP_CACHED
    assert f("StepResponse", "timing") == _wire.STEP_RESP_TIMING
    assert f("StepResult", "response") == _wire.RESULT_RESPONSE
    assert f("EchoRequest", "response_bytes") == _wire.ECHO_RESPONSE_BYTES
    assert _proto.DType == {"DTYPE_UNSPECIFIED": 0, "DTYPE_FLOAT32": _tensors.FLOAT32,
                            "DTYPE_FLOAT16": _tensors.FLOAT16, "DTYPE_BFLOAT16": _tensors.BFLOAT16,
                            "DTYPE_FLOAT8_E4M3": _tensors.FLOAT8_E4M3}


def test_wire_coding_is_what_protobuf_writes():
    """The hand-written request parses with protobuf into the same message the fields describe,
    and a protobuf-serialized response reads back the same."""
    rng = np.random.default_rng(8)
    q, _ = make(rng, (3, 2, 32), "bf16")
    k, _ = make(rng, (5, 1, 32), "bf16")
    p = attnd._core.prepare_attend(attnd.regions.RegionTable(), q, k, k, cu_seqlens_q=[0, 1, 3],
                                   cu_seqlens_k=[0, 2, 5], causal=True, window=(4, -1),
                                   scale=0.5, return_lse=True, high_priority=True, out=None,
                                   lse_out=None, request_id=77)
    m = _proto.AttendRequest.FromString(p.message)
    assert m.q.dtype == _proto.DType["DTYPE_BFLOAT16"] and list(m.q.shape) == [3, 2, 32]
    assert m.q.data == q.tobytes() and m.k.data == k.tobytes() and m.v.data == k.tobytes()
    assert list(m.cu_seqlens_q) == [0, 1, 3] and list(m.cu_seqlens_k) == [0, 2, 5]
    assert m.causal and m.return_lse and m.priority == 1 and m.request_id == 77
    assert m.softmax_scale == 0.5 and (m.window.left, m.window.right) == (4, -1)
    assert p.message == m.SerializeToString()  # byte for byte, as the generated code writes it

    o = np.arange(6, dtype=np.float16).reshape(3, 2, 1)
    resp = _proto.AttendResponse(request_id=9)
    resp.o.dtype = _proto.DType["DTYPE_FLOAT16"]
    resp.o.shape.extend([3, 2, 1])
    resp.o.data = o.tobytes()
    resp.timing.compute_us = 12.5
    resp.timing.batch_tokens = 3
    fp16_q = np.zeros((3, 2, 1), np.float16)
    r = attnd._core.read_attend(resp.SerializeToString(), attnd._core.Prepared(
        b"", _tensors.OutputMaker(fp16_q), None, None, False, False, None))
    assert np.array_equal(r.o, o) and r.lse is None and r.request_id == 9
    assert r.timing.compute_us == 12.5 and r.timing.batch_tokens == 3


def test_malformed_answers_raise_internal(client):
    prepared = attnd._core.Prepared(b"", _tensors.OutputMaker(np.zeros(1, np.float32)), None, None,
                                    False, False, None)
    resp = _proto.AttendResponse()
    resp.o.dtype = _proto.DType["DTYPE_FLOAT32"]
    resp.o.shape.extend([2, 2])
    resp.o.data = b"\0" * 12  # 16 needed
    with pytest.raises(attnd.AttndError, match="malformed.*12 bytes") as e:
        attnd._core.read_attend(resp.SerializeToString(), prepared)
    assert e.value.code.name == "INTERNAL"
    with pytest.raises(attnd.AttndError, match="malformed"):
        attnd._core.read_attend(b"\x0a\xff", prepared)


def _e4m3_table() -> np.ndarray:
    """The value of every E4M3FN code from its bit fields (NaN for the two NaN codes)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 0xF, codes & 0x7
    table = sign * np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
    table[(codes & 0x7F) == 0x7F] = np.nan
    return table


def _quantize(x: np.ndarray, scale: float) -> tuple:
    """Nearest E4M3 codes of x / scale (uint8) and the float64 values they stand for."""
    table = _e4m3_table()
    finite = np.where(np.isnan(table), np.inf, table)
    codes = np.abs((x / scale).reshape(-1, 1) - finite.reshape(1, -1)).argmin(axis=1)
    codes = codes.astype(np.uint8).reshape(x.shape)
    return codes, table[codes] * scale


@pytest.mark.parametrize("fp8_q", [False, True])
def test_fp8_attend_matches_the_reference_of_its_dequantized_inputs(client, fp8_q):
    if not client.info().fp8.attend_fp8_kv:
        pytest.skip("this server's backend has no FP8 Attend (GetServerInfo fp8)")
    rng = np.random.default_rng()
    lens_q, lens_k, heads, kv_heads, d = [5, 1, 9], [33, 7, 20], 8, 2, 64
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    kx = rng.standard_normal((cu_k[-1], kv_heads, d))
    vx = rng.standard_normal((cu_k[-1], kv_heads, d))
    k_scale, v_scale = np.abs(kx).max() / 448, np.abs(vx).max() / 448
    k8, k_values = _quantize(kx, k_scale)
    v8, v_values = _quantize(vx, v_scale)
    extra = {}
    if fp8_q:
        qx = rng.standard_normal((cu_q[-1], heads, d))
        q_scale = np.abs(qx).max() / 448
        q, q_values = _quantize(qx, q_scale)
        extra = {"q_descale": [q_scale], "o_dtype": "float16"}
    else:
        q, q_values = make(rng, (cu_q[-1], heads, d), "fp16")
    r = client.attend(q, k8, v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                      k_descale=[k_scale], v_descale=[v_scale], **extra)
    assert r.o.dtype == np.float16 and r.o.shape == (cu_q[-1], heads, d)
    o_ref, _ = reference(q_values, k_values, v_values, cu_q, cu_k, causal=True)
    assert relative_error(r.o.astype(np.float64), o_ref) <= TOLERANCE["fp16"]


def test_fp8_attend_without_descales_names_the_field(client):
    if not client.info().fp8.attend_fp8_kv:
        pytest.skip("this server's backend has no FP8 Attend (GetServerInfo fp8)")
    q = np.ones((4, 2, 64), dtype=np.float16)
    k = np.full((4, 2, 64), 0x38, dtype=np.uint8)
    with pytest.raises(attnd.InvalidArgument, match="fp8.v_descale is missing"):
        client.attend(q, k, k, k_descale=[1.0])
