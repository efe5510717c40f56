"""Client.batch_step's items coded, and its answers read, by attnd._fast (attnd/_fast.c): the
request is the Python coding's byte for byte, over every kind of item it takes (numpy arrays and
torch tensors of each dtype, region slices and bytes in the message, scales, windows, lse, any
layer, sessions or their ids, tuples and dicts); what it leaves to Python (FP8 scales, tensors to
make contiguous, lists of windows) is coded by Python; the answers match the float64 reference,
the prepared path's and the Python reading's; a bad item fails alone with its gRPC code; an answer
it does not expect is read (and reported) by Python."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import numpy as np
import pytest

import attnd
import attnd.aio
from attnd import _core, _tensors, _wire
from attnd.regions import Registered, RegionTable
from conftest import TOLERANCE, check_lse, make, reference, relative_error, values

HEADS, KV_HEADS, D = 4, 2, 64
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}

pytestmark = pytest.mark.skipif(_core.FAST is None, reason="attnd._fast is not loaded: "
                                "BatchSteps are coded in Python")


def python_coding(regions, items, max_bytes=None):
    """prepare_batch_steps as the package does it without attnd._fast."""
    fast, _core.FAST = _core.FAST, None
    try:
        return _core.prepare_batch_steps(regions, items, max_bytes)
    finally:
        _core.FAST = fast


def python_reading(buf, prepared):
    fast, _core.FAST = _core.FAST, None
    try:
        return _core.read_batch_step(buf, prepared)
    finally:
        _core.FAST = fast


class FakeSession:
    def __init__(self, sid):
        self.id = sid


def random_items(rng, region, lib, n):
    """n items of random shapes, dtypes, options, places (region or message) and flavours."""
    torch = pytest.importorskip("torch") if lib == "torch" else None
    items = []
    for i in range(n):
        dtype = ["fp32", "fp16", "bf16"][rng.integers(3)]
        tokens = int(rng.integers(1, 4))
        in_region = bool(rng.integers(2))

        def tensor(shape, dt=NP_DTYPES[dtype], region_ok=True):
            if in_region and region_ok:
                x = region.array(shape, dt)
                x[...] = rng.integers(0, 255, size=shape).astype(dt)
            else:
                x = rng.integers(0, 255, size=shape).astype(dt)
            if torch is None:
                return x
            if x.dtype == np.uint16:
                return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(x)

        q = tensor((tokens, HEADS, D))
        k = tensor((tokens, KV_HEADS, D), region_ok=bool(rng.integers(2)))
        v = tensor((tokens, KV_HEADS, D))
        return_lse = bool(rng.integers(2))
        out = tensor((tokens, HEADS, D)) if rng.integers(2) else None
        lse_out = tensor((HEADS, tokens), np.float32) if return_lse and rng.integers(2) else None
        if torch is not None and lse_out is not None and lse_out.dtype != torch.float32:
            lse_out = lse_out.view(torch.float32)
        session = ["ra.a", "ra.session-" + "x" * int(rng.integers(0, 200)), "",
                   FakeSession("rb.s%d" % i)][rng.integers(4)]
        layer = int([0, 1, 127, 128, 2 ** 31 - 1, -1, -(2 ** 31)][rng.integers(7)])
        scale = [0.0, -0.0, 0.125, 1e-50, -1e-50, float("nan"), 3, np.float32(0.5)][rng.integers(8)]
        window = [None, (-1, -1), (5, 0), (0, 3), (-1, 7), (1 << 40, -5)][rng.integers(6)]
        item = attnd.StepItem(session, layer, q, k, v, scale=scale, return_lse=return_lse,
                              window=window, out=out, lse_out=lse_out)
        kind = rng.integers(3)
        if kind == 1:
            item = (item.session, item.layer, item.q, item.k_new, item.v_new, item.scale,
                    item.return_lse, item.window, item.out, item.lse_out)
        elif kind == 2:
            item = dict(item.__dict__)
        items.append(item)
    return items


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_the_request_is_the_python_codings_byte_for_byte(lib):
    rng = np.random.default_rng(71)
    region = attnd.HostRegion(8 << 20)
    other = attnd.HostRegion(1 << 20)
    table = RegionTable()
    table.add(Registered("r-other", other))
    table.add(Registered("r1", region))
    try:
        for trial in range(60):
            region.reset()
            items = random_items(rng, region, lib, int(rng.integers(1, 9)))
            (want, want_p), = python_coding(table, items)
            (got, got_p), = _core.prepare_batch_steps(table, items, None)
            assert type(got_p) is _core.CodedBatch, f"trial {trial}: left to Python"
            assert got == want, f"trial {trial}"
            assert len(got_p) == len(want_p)
            for a, b in zip(got_p, want_p):
                assert (a.out is b.out and a.lse_out is b.lse_out and
                        a.o_in_region == b.o_in_region and a.lse_in_region == b.lse_in_region and
                        a.cuda_sync == b.cuda_sync and a.maker.np_bf16 == b.maker.np_bf16)
    finally:
        region.close()
        other.close()


def test_what_it_does_not_take_is_coded_by_python():
    region = attnd.HostRegion(1 << 20)
    table = RegionTable()
    table.add(Registered("r1", region))
    q = region.array((1, HEADS, D), np.float16)
    k = np.ones((1, KV_HEADS, D), np.float16)
    base = attnd.StepItem("ra.a", 1, q, k, k, out=region.array((1, HEADS, D), np.float16))
    fp8 = np.zeros((1, KV_HEADS, D), np.uint8)
    cases = [replace(base, k_new=fp8, v_new=fp8, k_new_scales=[0.5, 0.5],
                     v_new_scales=[0.25, 0.25]),                           # FP8 scales
             replace(base, k_new=np.ones((1, D, KV_HEADS), np.float16).transpose(0, 2, 1)),
             replace(base, window=[3, 0]),                                 # a list, not a tuple
             replace(base, q=np.ones((1, HEADS, D), np.float64))]          # a dtype Python refuses
    try:
        for item in cases[:3]:
            (got, p), = _core.prepare_batch_steps(table, [base, item], None)
            assert type(p) is list  # coded by Python
            assert got == python_coding(table, [base, item])[0][0]
        with pytest.raises(attnd.InvalidArgument, match="float64 is not supported"):
            _core.prepare_batch_steps(table, [base, cases[3]], None)
        # steps over max_bytes go in several calls, as Python cuts them
        parts = _core.prepare_batch_steps(table, [replace(base, q=np.ones((1, HEADS, D),
                                                                           np.float16))] * 3,
                                          HEADS * D * 2 + 200)
        assert len(parts) == 3
    finally:
        region.close()


class Batch:
    """Decode steps of b sessions in a region: q, o [b, 1, HEADS, D], k, v [b, 1, KV_HEADS, D],
    lse [b, HEADS, 1]."""

    def __init__(self, region, b, dtype):
        dt = NP_DTYPES[dtype]
        self.dtype = dtype
        self.q = region.array((b, 1, HEADS, D), dt)
        self.k = region.array((b, 1, KV_HEADS, D), dt)
        self.v = region.array((b, 1, KV_HEADS, D), dt)
        self.o = region.array((b, 1, HEADS, D), dt)
        self.lse = region.array((b, HEADS, 1), np.float32)

    def items(self, sessions, layers, return_lse=True):
        return [attnd.StepItem(s, layers[i], self.q[i], self.k[i], self.v[i], out=self.o[i],
                               lse_out=self.lse[i] if return_lse else None,
                               return_lse=return_lse)
                for i, s in enumerate(sessions)]

    def fill(self, rng):
        exact = []
        for x in (self.q, self.k, self.v):
            src, x64 = make(rng, x.shape, self.dtype)
            x[...] = src
            exact.append(x64)
        self.o.fill(0xFFFF if self.dtype == "bf16" else np.nan)
        self.lse.fill(np.nan)
        return exact


@pytest.fixture(scope="module")
def region(client):
    r = attnd.HostRegion(8 << 20)
    client.register_region(r)
    yield r
    client.unregister_region(r)
    r.close()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_region_steps_match_the_reference_the_prepared_path_and_the_python_reading(
        client, region, dtype):
    rng = np.random.default_rng(72)
    b, layers = 5, 3
    region.reset()
    ours = [client.create_session(layers, KV_HEADS, D, dtype) for _ in range(b)]
    theirs = [client.create_session(layers, KV_HEADS, D, dtype) for _ in range(b)]
    mine, other = Batch(region, b, dtype), Batch(region, b, dtype)
    prepared = client.prepare_batch_step(other.items(theirs, [0] * b))
    kv = [[[np.zeros((0, KV_HEADS, D))] * 2 for _ in range(layers)] for _ in range(b)]
    try:
        for step in range(4):
            per = [int(x) for x in rng.integers(0, layers, size=b)]  # mixed layers
            q64, k64, v64 = mine.fill(rng)
            for x, y in ((other.q, mine.q), (other.k, mine.k), (other.v, mine.v)):
                x[...] = y
            items = mine.items(ours, per)
            message, coded = _core.prepare_batch_step(client.regions, items)
            assert type(coded) is _core.CodedBatch
            buf = client._unary("BatchStep", message, 60)
            results = _core.read_batch_step(buf, coded)
            assert type(results) is list
            r_prepared = prepared.step(per)
            for i in range(b):
                kv[i][per[i]][0] = np.concatenate([kv[i][per[i]][0], k64[i]])
                kv[i][per[i]][1] = np.concatenate([kv[i][per[i]][1], v64[i]])
                o_ref, lse_ref = reference(q64[i], kv[i][per[i]][0], kv[i][per[i]][1],
                                           causal=True)
                assert relative_error(values(mine.o[i], dtype), o_ref) <= TOLERANCE[dtype]
                check_lse(mine.lse[i], lse_ref)
                assert np.array_equal(mine.o[i].view(np.uint16), other.o[i].view(np.uint16))
                assert np.array_equal(mine.lse[i], other.lse[i])
                assert results[i].o is items[i].out and results[i].lse is items[i].lse_out
            assert [r.cached_tokens for r in results] == r_prepared.cached_tokens == \
                [len(kv[i][per[i]][0]) for i in range(b)]
            slow = python_reading(buf, coded.prepared())
            for a, c in zip(results, slow):
                assert type(a) is _core.StepResult
                assert (a.o is c.o and a.lse is c.lse and a.cached_tokens == c.cached_tokens and
                        a.timing == c.timing)
            assert results[0].timing.total_us > 0
    finally:
        for s in ours + theirs:
            s.close()


def same_errors(a, b):
    assert str(a) == str(b) and a.code == b.code
    for x, y in zip(a.results, b.results):
        assert type(x) is type(y)
        if isinstance(x, attnd.AttndError):
            assert x.message == y.message and x.code == y.code


def test_a_bad_item_fails_alone_with_its_code(client, region, monkeypatch):
    rng = np.random.default_rng(73)
    region.reset()
    sessions = [client.create_session(2, KV_HEADS, D, "fp16") for _ in range(3)]
    try:
        batch = Batch(region, 3, "fp16")
        q64, k64, v64 = batch.fill(rng)
        with pytest.raises(attnd.BatchStepError) as e:
            client.batch_step(batch.items(sessions, [1, 7, 1], return_lse=False))
        r = e.value.results
        assert isinstance(r[1], attnd.InvalidArgument) and "layer 7" in r[1].message
        assert r[1].code == grpc.StatusCode.INVALID_ARGUMENT
        assert [x.cached_tokens for x in (r[0], r[2])] == [1, 1]
        for i in (0, 2):
            o_ref, _ = reference(q64[i], k64[i], v64[i], causal=True)
            assert relative_error(values(batch.o[i], "fp16"), o_ref) <= TOLERANCE["fp16"]
        # a closed session: NOT_FOUND for its item; the same errors as the Python path's
        sessions[2].close()
        batch.fill(rng)
        items = batch.items(sessions, [0, 0, 0], return_lse=False)
        got = client.batch_step(items, return_exceptions=True)
        assert isinstance(got[2], attnd.NotFound) and got[2].code == grpc.StatusCode.NOT_FOUND
        assert sessions[2].id in got[2].message
        with pytest.raises(attnd.BatchStepError) as fast:
            client.batch_step(items)
        monkeypatch.setattr(_core, "FAST", None)
        with pytest.raises(attnd.BatchStepError) as slow:
            client.batch_step(items)
        same_errors(fast.value, slow.value)
    finally:
        for s in sessions:
            if not s.closed:
                s.close()


def test_an_unexpected_answer_is_read_by_python():
    region = attnd.HostRegion(1 << 20)
    table = RegionTable()
    table.add(Registered("r1", region))
    try:
        q = region.array((1, HEADS, D), np.float16)
        items = [attnd.StepItem("ra.a", 0, q, q[:, :KV_HEADS], q[:, :KV_HEADS],
                                out=region.array((1, HEADS, D), np.float16))] * 2
        (_, coded), = _core.prepare_batch_steps(table, items, None)
        o = (_wire._varint_field(1, 2) + _wire._packed(2, (1, HEADS, D)) +
             _wire._len_field(4, _wire._len_field(1, b"r1")))
        ok = _wire._len_field(3, _wire._len_field(1, o) + _wire._varint_field(3, 9))
        good = _wire._len_field(1, ok) * 2
        r = _core.read_batch_step(good, coded)
        assert [x.cached_tokens for x in r] == [9, 9] and r[0].o is items[0].out
        failed = _wire._len_field(1, _wire._varint_field(1, 5) + _wire._len_field(2, b"gone"))
        r = _core.read_batch_step(_wire._len_field(1, ok) + failed, coded)
        assert isinstance(r[1], attnd.NotFound) and r[1].message.endswith("gone")
        inline = _wire._len_field(3, _wire._len_field(1, _wire._varint_field(1, 2) +
                                                      _wire._packed(2, (1, HEADS, D)) +
                                                      _wire._len_field(3, bytes(2 * HEADS * D))))
        for bad, match in ((good[:-3], "malformed"),
                           (_wire._len_field(1, ok), "1 results for 2 items"),
                           (_wire._len_field(1, ok) + _wire._len_field(1, b""),
                            "status 0 has no response"),
                           (_wire._len_field(1, ok) + _wire._len_field(1, inline),
                            "in the message where a region was asked for")):
            with pytest.raises(attnd.AttndError, match=match):
                _core.read_batch_step(bad, coded)
    finally:
        region.close()


def inline_answer(items, rng, timing=True):
    """A BatchStepResponse whose outputs the message holds (as for items outside regions): per
    item o of q's shape and dtype, lse float32 [heads, tokens] where asked, random bytes."""
    out = b""
    for it in items:
        q = it.q
        shape = tuple(q.shape)
        code = {"float32": 1, "float16": 2}.get(str(q.dtype).replace("torch.", ""), 3)
        nbytes = _tensors.DTYPE_BYTES[code] * int(np.prod(shape))
        o = (_wire._varint_field(1, code) + _wire._packed(2, shape) +
             _wire._len_field(3, rng.integers(0, 256, size=nbytes, dtype=np.uint8).tobytes()))
        body = _wire._len_field(1, o) + _wire._varint_field(3, 11)
        if it.return_lse:
            lse = rng.standard_normal(shape[1] * shape[0]).astype(np.float32).tobytes()
            body += _wire._len_field(2, _wire._varint_field(1, 1) +
                                     _wire._packed(2, (shape[1], shape[0])) +
                                     _wire._len_field(3, lse))
        if timing:
            body += _wire._len_field(4, b"\x21" + np.float64(5.5).tobytes())
        out += _wire._len_field(1, _wire._len_field(3, body))
    return out


def bits(x, lib):
    """x's bytes as integers (a numpy array or CPU torch tensor)."""
    if lib == "torch":
        import torch

        return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()]).numpy()
    return x.view({2: np.uint16, 4: np.uint32}[x.itemsize])


def same_results(a, b, lib):
    """Two readings' results: the same type, o and lse values (and the same out objects)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y) is _core.StepResult
        assert x.cached_tokens == y.cached_tokens and x.timing == y.timing
        for u, w in ((x.o, y.o), (x.lse, y.lse)):
            assert (u is None) == (w is None)
            if u is None:
                continue
            assert type(u) is type(w) and tuple(u.shape) == tuple(w.shape) and u.dtype == w.dtype
            if lib == "numpy":
                assert u.flags.writeable == w.flags.writeable
            assert np.array_equal(bits(u, lib), bits(w, lib))  # random bytes: NaNs among them


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_outputs_the_answer_holds_are_read_in_one_pass_as_python_reads_them(lib):
    """o and lse in the message: made over the answer (no out), or copied into out and lse_out
    (host memory, writable, q's kind): the Python reading's results, in one pass; an out it
    must convert or check is left to the Python reading, which says what is wrong."""
    rng = np.random.default_rng(76)
    torch = pytest.importorskip("torch") if lib == "torch" else None
    table = RegionTable()

    def as_lib(x):
        if torch is None:
            return x
        if x.dtype == np.uint16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    for trial in range(40):
        items = []
        for i in range(int(rng.integers(1, 6))):
            dt = NP_DTYPES[["fp32", "fp16", "bf16"][rng.integers(3)]]
            tokens = int(rng.integers(1, 3))
            q = as_lib(np.zeros((tokens, HEADS, D), dt))
            kv = as_lib(np.zeros((tokens, KV_HEADS, D), dt))
            lse = bool(rng.integers(2))
            out = as_lib(np.full((tokens, HEADS, D), 7, dt)) if rng.integers(2) else None
            lse_out = as_lib(np.zeros((HEADS, tokens), np.float32)) if lse and rng.integers(2) \
                else None
            items.append(attnd.StepItem("ra.s%d" % i, 0, q, kv, kv, return_lse=lse, out=out,
                                        lse_out=lse_out))
        (_, coded), = _core.prepare_batch_steps(table, items, None)
        assert type(coded) is _core.CodedBatch
        answer = inline_answer(items, rng, timing=bool(trial % 2))
        got = _core.read_batch_step(answer, coded)
        # the one-pass reading took it (the Python reading is not called)
        assert _core.FAST.read_batch_step(answer, coded.plan, _core.StepResult,
                                          _wire.ServerTiming, _wire._EMPTY_TIMING,
                                          _core._answer_output, np.ndarray) is not None
        got_o = [None if r.o is None else (r.o.clone() if torch else r.o.copy()) for r in got]
        want = python_reading(answer, coded.prepared())
        same_results(got, want, lib)
        for it, r, o in zip(items, got, got_o):
            assert r.o is it.out if it.out is not None else r.o is not it.out
            assert r.lse is it.lse_out if it.lse_out is not None else True
            if it.out is not None:  # written by the one-pass reading, as Python writes it
                same_results([r._replace(o=o)], [r], lib)

    # outs it leaves to Python: read-only, another kind than q, another dtype or shape
    q = np.zeros((1, HEADS, D), np.float16)
    kv = np.zeros((1, KV_HEADS, D), np.float16)
    ro = np.zeros((1, HEADS, D), np.float16)
    ro.flags.writeable = False
    for out, error in ((ro, "read-only"), (np.zeros((1, HEADS, D), np.float32), None),
                       (np.zeros((2, HEADS, D), np.float16), "has shape")):
        items = [attnd.StepItem("ra.a", 0, q, kv, kv, out=out)]
        (_, coded), = _core.prepare_batch_steps(table, items, None)
        answer = inline_answer(items, rng)
        assert _core.FAST.read_batch_step(answer, coded.plan, _core.StepResult,
                                          _wire.ServerTiming, _wire._EMPTY_TIMING,
                                          _core._answer_output, np.ndarray) is None
        if error is None:  # converted by the Python reading, as before
            r, = _core.read_batch_step(answer, coded)
            assert r.o is out and np.array_equal(out, python_reading(answer, coded)[0].o,
                                                 equal_nan=True)
        else:
            with pytest.raises((ValueError, attnd.InvalidArgument), match=error):
                _core.read_batch_step(answer, coded)


def test_inline_numpy_steps_match_the_reference(client):
    rng = np.random.default_rng(74)
    sessions = [client.create_session(1, KV_HEADS, D, "bf16") for _ in range(3)]
    kv = [(np.zeros((0, KV_HEADS, D)), np.zeros((0, KV_HEADS, D))) for _ in sessions]
    try:
        for _ in range(2):
            xs = [[make(rng, (1, h, D), "bf16") for h in (HEADS, KV_HEADS, KV_HEADS)]
                  for _ in sessions]
            items = [attnd.StepItem(s, 0, *(x[0] for x in xs[i]), return_lse=True)
                     for i, s in enumerate(sessions)]
            (_, coded), = _core.prepare_batch_steps(client.regions, items, None)
            assert type(coded) is _core.CodedBatch
            results = client.batch_step(items)
            for i, r in enumerate(results):
                kv[i] = (np.concatenate([kv[i][0], xs[i][1][1]]),
                         np.concatenate([kv[i][1], xs[i][2][1]]))
                o_ref, lse_ref = reference(xs[i][0][1], kv[i][0], kv[i][1], causal=True)
                assert r.o.dtype == np.uint16 and r.o.shape == (1, HEADS, D)
                assert relative_error(values(r.o, "bf16"), o_ref) <= TOLERANCE["bf16"]
                check_lse(r.lse, lse_ref)
    finally:
        for s in sessions:
            s.close()


def test_asyncio_region_steps(server):
    rng = np.random.default_rng(75)

    async def main():
        async with attnd.aio.Client(server.target, timeout=60) as c:
            region = attnd.HostRegion(1 << 20)
            await c.register_region(region)
            sessions = [await c.create_session(1, KV_HEADS, D, "fp16") for _ in range(2)]
            batch = Batch(region, 2, "fp16")
            q64, k64, v64 = batch.fill(rng)
            items = batch.items(sessions, [0, 0])
            results = await c.batch_step(items)
            for i, r in enumerate(results):
                o_ref, lse_ref = reference(q64[i], k64[i], v64[i], causal=True)
                assert r.o is items[i].out and r.cached_tokens == 1
                assert relative_error(values(batch.o[i], "fp16"), o_ref) <= TOLERANCE["fp16"]
                check_lse(batch.lse[i], lse_ref)
            got = await c.batch_step(batch.items(sessions, [0, 3]), return_exceptions=True)
            assert isinstance(got[1], attnd.InvalidArgument) and got[0].cached_tokens == 2
            for s in sessions:
                await s.close()
            await c.unregister_region(region)
            region.close()

    asyncio.run(main())
