"""Host shared-memory regions over numpy arrays (and torch CPU tensors): registered once, reused by
Attend, Step and BatchStep for inputs and outputs; the bytes go through the region (attnd's
counters say so), the answers match the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import attnd
from conftest import (TOLERANCE, check_lse, make, metric, reference, relative_error, values,
                      torch_or_skip)


def fill(dst, src):
    dst[...] = src
    return dst


@pytest.fixture(scope="module")
def region_client(server):
    with attnd.Client(server.target, timeout=60) as c:
        region = attnd.HostRegion(8 << 20)
        name = c.register_region(region)
        listed = [r.name for r in c.list_regions().regions]
        assert name in listed
        yield c, region
        c.unregister_region(region)
        region.close()


def test_attend_through_a_host_region(server, region_client):
    c, region = region_client
    region.reset()
    rng = np.random.default_rng(41)
    q = region.array((64, 4, 64), np.uint16)
    k = region.array((80, 2, 64), np.uint16)
    v = region.array((80, 2, 64), np.uint16)
    out = region.array((64, 4, 64), np.uint16)
    lse_out = region.array((4, 64), np.float32)
    before = server.metrics()
    for i in range(3):  # registered once, reused with new inputs each time
        q_src, q64 = make(rng, q.shape, "bf16")
        k_src, k64 = make(rng, k.shape, "bf16")
        v_src, v64 = make(rng, v.shape, "bf16")
        fill(q, q_src), fill(k, k_src), fill(v, v_src)
        out.fill(0xFFFF)
        lse_out.fill(np.nan)
        r = c.attend(q, k, v, causal=True, return_lse=True, out=out, lse_out=lse_out)
        assert r.o is out and r.lse is lse_out
        o_ref, lse_ref = reference(q64, k64, v64, causal=True)
        assert relative_error(values(out, "bf16"), o_ref) <= TOLERANCE["bf16"]
        check_lse(lse_out, lse_ref)
    after = server.metrics()
    read = metric(after, "attn_shared_memory_tensor_bytes_total", direction="read") - \
        metric(before, "attn_shared_memory_tensor_bytes_total", direction="read")
    written = metric(after, "attn_shared_memory_tensor_bytes_total", direction="written") - \
        metric(before, "attn_shared_memory_tensor_bytes_total", direction="written")
    assert read == 3 * (q.nbytes + k.nbytes + v.nbytes)
    assert written == 3 * (out.nbytes + lse_out.nbytes)


def test_inputs_in_a_region_with_the_output_in_the_answer(region_client):
    c, region = region_client
    region.reset()
    rng = np.random.default_rng(42)
    q_src, q64 = make(rng, (30, 2, 64), "fp32")
    q = fill(region.array(q_src.shape, np.float32), q_src)
    r = c.attend(q, q, q)
    assert relative_error(values(r.o, "fp32"), reference(q64, q64, q64)[0]) <= TOLERANCE["fp32"]


def test_steps_through_a_host_region(region_client):
    c, region = region_client
    region.reset()
    rng = np.random.default_rng(43)
    heads, kv_heads, d = 4, 2, 64
    with c.create_session(1, kv_heads, d, "fp16") as s, c.create_session(1, kv_heads, d, "fp16") as t:
        caches = {s.id: [np.zeros((0, kv_heads, d))] * 2, t.id: [np.zeros((0, kv_heads, d))] * 2}
        bufs = {}
        for sid in (s.id, t.id):
            bufs[sid] = [region.array((16, heads, d), np.float16),
                         region.array((16, kv_heads, d), np.float16),
                         region.array((16, kv_heads, d), np.float16),
                         region.array((16, heads, d), np.float16)]
        for n in (16, 1, 1):
            items, refs = [], []
            for sess in (s, t):
                q, k, v, o = (b[:n] for b in bufs[sess.id])
                q_src, q64 = make(rng, q.shape, "fp16")
                k_src, k64 = make(rng, k.shape, "fp16")
                v_src, v64 = make(rng, v.shape, "fp16")
                fill(q, q_src), fill(k, k_src), fill(v, v_src)
                o.fill(np.nan)
                cache = caches[sess.id]
                cache[0] = np.concatenate([cache[0], k64])
                cache[1] = np.concatenate([cache[1], v64])
                items.append(attnd.StepItem(sess, 0, q, k, v, out=o))
                refs.append((o, reference(q64, cache[0], cache[1], causal=True)[0]))
            if n == 16:
                results = [s.step(0, *(items[0].q, items[0].k_new, items[0].v_new), out=items[0].out),
                           t.step(0, items[1].q, items[1].k_new, items[1].v_new, out=items[1].out)]
            else:
                results = c.batch_step(items)
            for r, (o, o_ref) in zip(results, refs):
                assert r.o is o
                assert relative_error(values(o, "fp16"), o_ref) <= TOLERANCE["fp16"]


def test_torch_cpu_tensors_in_a_host_region(region_client):
    torch = torch_or_skip()
    c, region = region_client
    region.reset()
    q = region.tensor((20, 2, 64), torch.bfloat16)
    out = region.tensor((20, 2, 64), torch.bfloat16)
    src = torch.randn(20, 2, 64)
    q.copy_(src.bfloat16())
    out.fill_(float("nan"))
    r = c.attend(q, q, q, causal=True, out=out)
    q64 = q.double().numpy()
    assert r.o is out
    assert relative_error(values(out, "bf16"), reference(q64, q64, q64, causal=True)[0]) <= \
        TOLERANCE["bf16"]


def test_unregistered_memory_travels_by_value(server):
    with attnd.Client(server.target) as c:
        region = attnd.HostRegion(1 << 20)
        c.register_region(region, name="temporary-region")
        with pytest.raises(attnd.AlreadyExists):
            c.register_region(region, name="temporary-region")
        c.regions.remove("temporary-region")  # forget it here only: arrays go by value now
        q_src, q64 = make(np.random.default_rng(44), (8, 2, 64), "fp32")
        q = fill(region.array(q_src.shape, np.float32), q_src)
        r = c.attend(q, q, q)
        assert relative_error(values(r.o, "fp32"), reference(q64, q64, q64)[0]) <= TOLERANCE["fp32"]
        with pytest.raises(attnd.NotFound):
            c.unregister_region("no-such-region")
        del q
        region.close()
