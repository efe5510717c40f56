"""Prepared BatchSteps over host regions (Client.prepare_batch_step and its asyncio twin): the
request is the ordinary one with its layers rewritten; the answers match the float64 reference
and the ordinary batch_step's bit for bit; bad cases (a wrong layer, a closed session, a region
slot too small, tensors outside the regions, an unregistered region) fail as they do on the
ordinary path, item by item, the other items applied."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

import attnd
import attnd.aio
from attnd import _core, _proto
from attnd.prepared import BatchStepTemplate
from attnd.regions import Registered, RegionTable
from conftest import (BACKEND, LSE_TOLERANCE, TOLERANCE, check_lse, make, reference,
                      relative_error, values)

HEADS, KV_HEADS, D = 4, 2, 64
NP_DTYPES = {"fp16": np.float16, "bf16": np.uint16}


class Batch:
    """The step tensors of a batch of sessions in a region: q, o [B, n, HEADS, D], k, v
    [B, n, KV_HEADS, D], lse [B, HEADS, n]."""

    def __init__(self, region, b, n, dtype):
        dt = NP_DTYPES[dtype]
        self.dtype = dtype
        self.q = region.array((b, n, HEADS, D), dt)
        self.k = region.array((b, n, KV_HEADS, D), dt)
        self.v = region.array((b, n, KV_HEADS, D), dt)
        self.o = region.array((b, n, HEADS, D), dt)
        self.lse = region.array((b, HEADS, n), np.float32)

    def items(self, sessions, layer, return_lse=False, **opts):
        return [attnd.StepItem(s, layer, self.q[i], self.k[i], self.v[i], out=self.o[i],
                               lse_out=self.lse[i] if return_lse else None,
                               return_lse=return_lse, **opts)
                for i, s in enumerate(sessions)]

    def fill(self, rng):
        """Fresh inputs, poisoned outputs; the inputs' exact values in float64."""
        exact = []
        for x in (self.q, self.k, self.v):
            src, x64 = make(rng, x.shape, self.dtype)
            x[...] = src
            exact.append(x64)
        self.poison()
        return exact

    def poison(self):
        self.o.fill(0xFFFF if self.dtype == "bf16" else np.nan)
        self.lse.fill(np.nan)

    def copy_inputs(self, other):
        for mine, theirs in ((self.q, other.q), (self.k, other.k), (self.v, other.v)):
            mine[...] = theirs
        self.poison()


class Caches:
    """What each session should hold: per session and layer, the exact keys and values sent."""

    def __init__(self, b, layers):
        self.k = [[np.zeros((0, KV_HEADS, D))] * layers for _ in range(b)]
        self.v = [[np.zeros((0, KV_HEADS, D))] * layers for _ in range(b)]

    def append(self, i, layer, k64, v64):
        self.k[i][layer] = np.concatenate([self.k[i][layer], k64])
        self.v[i][layer] = np.concatenate([self.v[i][layer], v64])


@pytest.fixture(scope="module")
def region(client):
    r = attnd.HostRegion(8 << 20)
    client.register_region(r)
    yield r
    client.unregister_region(r)
    r.close()


def test_prepared_request_is_the_ordinary_one_with_its_layers_rewritten():
    region = attnd.HostRegion(1 << 20)
    table = RegionTable()
    table.add(Registered("r1", region))
    batch = Batch(region, 3, 2, "bf16")
    items = batch.items(["ra.a", "ra.bb", "ra.ccc"], 0, return_lse=True, scale=0.3,
                        window=(5, 0))
    t = BatchStepTemplate(table, items)
    size = len(t.message(None))
    for layers in (0, 1, 127, 128, 2 ** 31 - 1, -1, [3, 0, 200], np.int64(5)):
        per = list(layers) if isinstance(layers, list) else [int(layers)] * 3
        want, _ = _core.prepare_batch_step(
            table, [replace(it, layer=n) for it, n in zip(items, per)])
        got = t.message(layers)
        assert len(got) == size  # the layers are rewritten in place
        parsed = _proto.BatchStepRequest.FromString(got)
        assert parsed == _proto.BatchStepRequest.FromString(want)
        assert [s.layer for s in parsed.steps] == per
        assert parsed.steps[1].q.region.region == "r1" and parsed.steps[2].lse_region.region == "r1"
    assert t.message(7) is t.message(7)  # a layer's message is kept
    assert [s.layer for s in _proto.BatchStepRequest.FromString(t.message(None)).steps] == [0] * 3
    with pytest.raises(attnd.InvalidArgument, match="2 layers for a prepared BatchStep of 3 steps"):
        t.message([1, 2])
    region.close()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_prepared_steps_match_the_reference_and_the_ordinary_path(client, region, dtype):
    rng = np.random.default_rng(61)
    b, layers = 3, 2
    mine = [client.create_session(layers, KV_HEADS, D, dtype) for _ in range(b)]
    theirs = [client.create_session(layers, KV_HEADS, D, dtype) for _ in range(b)]
    caches = Caches(b, layers)
    region.reset()
    try:
        for n, tokens in ((5, 1), (1, 4)):  # a prefill chunk, then decode steps
            ours, other = Batch(region, b, n, dtype), Batch(region, b, n, dtype)
            items = ours.items(mine, 0, return_lse=True)
            prepared = client.prepare_batch_step(items)
            assert len(prepared) == b and prepared.session_ids == [s.id for s in mine]
            for _ in range(tokens):
                for layer in range(layers):
                    q64, k64, v64 = ours.fill(rng)
                    other.copy_inputs(ours)
                    r = prepared.step(layer)
                    assert r._results is None  # checked in one pass: every item OK, o in region
                    ordinary = client.batch_step(other.items(theirs, layer, return_lse=True))
                    for i in range(b):
                        caches.append(i, layer, k64[i], v64[i])
                        o_ref, lse_ref = reference(q64[i], caches.k[i][layer], caches.v[i][layer],
                                                   causal=True)
                        assert relative_error(values(ours.o[i], dtype), o_ref) <= TOLERANCE[dtype]
                        check_lse(ours.lse[i], lse_ref)
                        same_answer(ours.o[i], other.o[i], ours.lse[i], other.lse[i], dtype)
                        assert r[i].o is items[i].out and r[i].lse is items[i].lse_out
                    assert r.cached_tokens == [x.cached_tokens for x in ordinary] == \
                        [len(caches.k[0][layer])] * b
    finally:
        for s in mine + theirs:
            s.close()


def same_answer(o, o_other, lse, lse_other, dtype):
    """The prepared and the ordinary step of the same inputs agree: bit for bit on the CPU backend
    (one float32 order of operations), within the dtype's rounding on the CUDA one (its kernel
    choice may differ between two launches)."""
    if BACKEND == "cpu":
        assert np.array_equal(o.view(np.uint16), o_other.view(np.uint16))
        assert np.array_equal(lse, lse_other)
    else:
        assert relative_error(values(o, dtype), values(o_other, dtype)) <= TOLERANCE[dtype]
        assert np.max(np.abs(lse - lse_other)) < LSE_TOLERANCE


def both_fail(client, prepared, items, layer):
    """The BatchStepErrors of the prepared step at `layer` and of the ordinary one."""
    with pytest.raises(attnd.BatchStepError) as a:
        prepared.step(layer)
    with pytest.raises(attnd.BatchStepError) as b:
        client.batch_step([replace(it, layer=layer) for it in items])
    return a.value, b.value


def same_errors(a, b):
    assert str(a) == str(b) and a.code == b.code
    for x, y in zip(a.results, b.results):
        assert type(x) is type(y)
        if isinstance(x, attnd.AttndError):
            assert x.message == y.message and x.code == y.code


def test_bad_steps_fail_as_on_the_ordinary_path(client, region):
    rng = np.random.default_rng(62)
    region.reset()
    sessions = [client.create_session(2, KV_HEADS, D, "fp16") for _ in range(3)]
    try:
        batch = Batch(region, 3, 1, "fp16")
        items = batch.items(sessions, 0)
        prepared = client.prepare_batch_step(items)
        q64, k64, v64 = batch.fill(rng)
        # a layer out of range: every item fails, as on the ordinary path
        a, b = both_fail(client, prepared, items, 2)
        same_errors(a, b)
        assert all(isinstance(x, attnd.InvalidArgument) and "layer 2 is out of range" in x.message
                   for x in a.results)
        # one item's layer out of range: it fails alone, the others are applied (and right)
        r = prepared.step([1, 9, 1], return_exceptions=True)
        assert isinstance(r[1], attnd.InvalidArgument) and "layer 9" in r[1].message
        assert r.cached_tokens == [1, 0, 1]
        for i in (0, 2):
            o_ref, _ = reference(q64[i], k64[i], v64[i], causal=True)
            assert relative_error(values(batch.o[i], "fp16"), o_ref) <= TOLERANCE["fp16"]
        assert np.isnan(batch.o[1].astype(np.float32)).all()  # the failed item wrote nothing
        # a closed session: its item fails with NOT_FOUND, as on the ordinary path
        sessions[1].close()
        a, b = both_fail(client, prepared, items, 0)
        same_errors(a, b)
        assert isinstance(a.results[1], attnd.NotFound) and sessions[1].id in a.results[1].message
        assert a.results[0].cached_tokens + 1 == b.results[0].cached_tokens == 2
    finally:
        for s in sessions:
            if not s.closed:
                s.close()


def test_a_region_slot_too_small_fails_as_on_the_ordinary_path(client, region):
    rng = np.random.default_rng(63)
    region.reset()
    sessions = [client.create_session(1, KV_HEADS, D, "fp16") for _ in range(2)]
    try:
        batch = Batch(region, 2, 1, "fp16")
        batch.fill(rng)
        small = region.array((1, HEADS, D // 2), np.float16)  # half of o
        items = batch.items(sessions, 0)
        items[1] = replace(items[1], out=small)
        lse_small = region.array((HEADS - 1, 1), np.float32)
        lse_items = batch.items(sessions, 0, return_lse=True)
        lse_items[0] = replace(lse_items[0], lse_out=lse_small)
        for bad in (items, lse_items):
            a, b = both_fail(client, client.prepare_batch_step(bad), bad, 0)
            same_errors(a, b)
            assert sum(isinstance(x, attnd.InvalidArgument) for x in a.results) == 1
            failed = next(x for x in a.results if isinstance(x, attnd.AttndError))
            assert "o_region" in failed.message or "lse_region" in failed.message
    finally:
        for s in sessions:
            s.close()


def test_preparing_needs_every_tensor_in_a_region(client, region):
    region.reset()
    batch = Batch(region, 2, 1, "fp16")
    items = batch.items(["ra.x", "ra.y"], 0)
    elsewhere = np.zeros((1, HEADS, D), np.float16)
    for field, message in (("q", "item 1: q is empty or does not lie in a region"),
                           ("v_new", "item 1: v_new is empty or does not lie in a region"),
                           ("out", "item 1: out does not lie in a region")):
        value = elsewhere if field != "v_new" else elsewhere[:, :KV_HEADS]
        with pytest.raises(attnd.InvalidArgument, match=message):
            client.prepare_batch_step([items[0], replace(items[1], **{field: value})])
    with pytest.raises(attnd.InvalidArgument, match="item 0: out is needed"):
        client.prepare_batch_step([replace(items[0], out=None)])
    with pytest.raises(attnd.InvalidArgument, match="item 0: return_lse needs lse_out"):
        client.prepare_batch_step([replace(items[0], return_lse=True)])
    with pytest.raises(attnd.InvalidArgument, match="no items"):
        client.prepare_batch_step([])


def test_an_unregistered_region_fails_clearly(server):
    rng = np.random.default_rng(64)
    with attnd.Client(server.target, timeout=60) as c:
        region = attnd.HostRegion(1 << 20)
        name = c.register_region(region)
        s = c.create_session(1, KV_HEADS, D, "fp16")
        batch = Batch(region, 1, 1, "fp16")
        batch.fill(rng)
        prepared = c.prepare_batch_step(batch.items([s], 0))
        prepared.step(0)
        c.unregister_region(region)
        with pytest.raises(attnd.BatchStepError) as e:
            prepared.step(0)
        assert isinstance(e.value.results[0], attnd.NotFound) and name in e.value.message
        assert c.batch_step([attnd.StepItem(s, 0, batch.q[0], batch.k[0], batch.v[0])])[0] \
            .cached_tokens == 2  # the session is intact (and the unregistered arrays go by value)
        s.close()
        region.close()


def test_asyncio_prepared_batch_step(server):
    rng = np.random.default_rng(65)

    async def main():
        async with attnd.aio.Client(server.target, timeout=60) as c:
            region = attnd.HostRegion(4 << 20)
            await c.register_region(region)
            sessions = [await c.create_session(2, KV_HEADS, D, "bf16") for _ in range(4)]
            caches = Caches(4, 2)
            # two prepared batches in flight at once, over separate slots of the region
            batches = [Batch(region, 2, 1, "bf16"), Batch(region, 2, 1, "bf16")]
            prepared = [c.prepare_batch_step(bt.items(sessions[2 * j:2 * j + 2], 0, True))
                        for j, bt in enumerate(batches)]
            for layer in (0, 1, 1, 0):
                exact = [bt.fill(rng) for bt in batches]
                results = await asyncio.gather(*(p.step(layer) for p in prepared))
                for j, (bt, (q64, k64, v64)) in enumerate(zip(batches, exact)):
                    assert results[j].cached_tokens == [len(caches.k[2 * j][layer]) + 1] * 2
                    for i in range(2):
                        caches.append(2 * j + i, layer, k64[i], v64[i])
                        o_ref, lse_ref = reference(q64[i], caches.k[2 * j + i][layer],
                                                   caches.v[2 * j + i][layer], causal=True)
                        assert relative_error(values(bt.o[i], "bf16"), o_ref) <= TOLERANCE["bf16"]
                        check_lse(bt.lse[i], lse_ref)
            with pytest.raises(attnd.BatchStepError, match="layer 3 is out of range"):
                await prepared[0].step(3)
            r = await prepared[1].step(3, return_exceptions=True)
            assert all(isinstance(x, attnd.InvalidArgument) for x in r)
            for s in sessions:
                await s.close()
            await c.unregister_region(region)
            region.close()

    asyncio.run(main())
