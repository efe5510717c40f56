"""torch tensors through the client (CPU, and CUDA where there is a GPU), RemoteKVCache and
RemoteAttention, and CUDA IPC regions on attnd's CUDA backend. Skipped where torch is missing."""

from __future__ import annotations

import numpy as np
import pytest

import attnd
from conftest import (BACKEND, TOLERANCE, check_lse, reference, relative_error, torch_or_skip,
                      values)

torch = torch_or_skip()
import attnd.torch as at  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def rand(gen, shape, dtype, device="cpu"):
    x = torch.randn(*shape, generator=gen).to(dtype)
    return x.to(device), x.double().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attend_torch_tensors(client, dtype, device):
    gen = torch.Generator().manual_seed(51)
    dt = DTYPES[dtype]
    cu = [0, 20, 21, 60]
    q, q64 = rand(gen, (60, 8, 64), dt, device)
    k, k64 = rand(gen, (60, 2, 64), dt, device)
    v, v64 = rand(gen, (60, 2, 64), dt, device)
    r = client.attend(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True)
    assert r.o.dtype == dt and r.o.device.type == device and r.o.shape == q.shape
    assert r.lse.dtype == torch.float32 and r.lse.device.type == device
    o_ref, lse_ref = reference(q64, k64, v64, cu, cu, causal=True)
    assert relative_error(values(r.o, dtype), o_ref) <= TOLERANCE[dtype]
    check_lse(r.lse, lse_ref)
    # A view with strides goes by value (made contiguous); out= into a caller tensor.
    out = torch.full(q[:, ::2].shape, float("nan"), dtype=dt, device=device)
    r = client.attend(q[:, ::2], k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, out=out)
    assert r.o is out
    o_ref, _ = reference(q64[:, ::2], k64, v64, cu, cu, causal=True)
    assert relative_error(values(out, dtype), o_ref) <= TOLERANCE[dtype]


def test_torch_outputs_are_usable_tensors(client):
    q = torch.randn(17, 2, 64, dtype=torch.bfloat16)  # odd sizes: o's bytes start unaligned
    o = client.attend(q, q, q).o
    y = torch.nn.functional.linear(o.reshape(17, 128), torch.randn(5, 128, dtype=torch.bfloat16))
    assert y.shape == (17, 5) and torch.isfinite(y.float()).all()
    o.add_(1)  # the caller's to modify


@pytest.mark.parametrize("model_dtype,kv_dtype", [(torch.bfloat16, None),
                                                  (torch.float32, torch.float16)])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("transport,prepare", [("grpc", True), ("shm", True), ("shm", False)])
def test_remote_kv_cache(client, model_dtype, kv_dtype, batch, transport, prepare):
    """Prefill, decode, fork, truncate, crop and reorder, every output against the reference;
    "shm" goes through a host region, its BatchSteps prepared per shape (or coded each step)."""
    gen = torch.Generator().manual_seed(52)
    layers, heads, kv_heads, d = 2, 4, 2, 64
    wire = "bf16" if model_dtype == torch.bfloat16 else "fp16"
    cache = at.RemoteKVCache(client, layers, kv_heads, d, kv_dtype=kv_dtype, record_latency=True,
                             transport=transport, prepare_batches=prepare)
    attn = [at.RemoteAttention(i) for i in range(layers)]
    keys = [[np.zeros((0, kv_heads, d))] * batch for _ in range(layers)]
    vals = [[np.zeros((0, kv_heads, d))] * batch for _ in range(layers)]

    def run(c, n, ks, vs):
        for layer in range(layers):
            q = torch.randn(batch, n, heads, d, generator=gen).to(model_dtype)
            k = torch.randn(batch, n, kv_heads, d, generator=gen).to(model_dtype)
            v = torch.randn(batch, n, kv_heads, d, generator=gen).to(model_dtype)
            o = attn[layer](q, k, v, c)
            assert o.shape == q.shape and o.dtype == model_dtype and not o.isnan().any()
            for b in range(batch):
                # what the session holds: the values rounded to its dtype
                k64 = k[b].to(c.kv_dtype).double().numpy()
                v64 = v[b].to(c.kv_dtype).double().numpy()
                q64 = q[b].to(c.kv_dtype).double().numpy()
                ks[layer][b] = np.concatenate([ks[layer][b], k64])
                vs[layer][b] = np.concatenate([vs[layer][b], v64])
                o_ref, _ = reference(q64, ks[layer][b], vs[layer][b], causal=True)
                assert relative_error(values(o[b], "fp32"), o_ref) <= TOLERANCE[wire]

    with cache:
        run(cache, 11, keys, vals)
        run(cache, 1, keys, vals)
        assert cache.seq_length() == 12 and len(cache.latencies[0]) == 2
        child = cache.fork()
        ckeys = [list(x) for x in keys]
        cvals = [list(x) for x in vals]
        run(child, 1, ckeys, cvals)
        child.truncate(2)
        for layer in range(layers):
            for b in range(batch):
                ckeys[layer][b], cvals[layer][b] = ckeys[layer][b][:-2], cvals[layer][b][:-2]
        run(child, 2, ckeys, cvals)
        run(cache, 1, keys, vals)
        child.close()
        # crop: a positive length keeps that many tokens; 0 or negative drops -length, given as
        # an int or a 0-d tensor (transformers' assisted generation passes both kinds)
        run(cache, 3, keys, vals)
        for length, dropped in ((torch.tensor(0), 0), (0, 0), (torch.tensor(-1), 1), (14, 1)):
            before = cache.seq_length()
            cache.crop(length)
            assert cache.seq_length() == before - dropped and isinstance(cache.seq_length(), int)
            for layer in range(layers):
                for b in range(batch):
                    keys[layer][b] = keys[layer][b][:len(keys[layer][b]) - dropped]
                    vals[layer][b] = vals[layer][b][:len(vals[layer][b]) - dropped]
        run(cache, 1, keys, vals)
        if batch == 3:
            cache.reorder([2, 2, 0])  # beam search: rows become forks of others
            for layer in range(layers):
                keys[layer] = [keys[layer][2], keys[layer][2].copy(), keys[layer][0]]
                vals[layer] = [vals[layer][2], vals[layer][2].copy(), vals[layer][0]]
            run(cache, 1, keys, vals)
    assert cache.sessions == []


def test_remote_attention_layouts_and_errors(client):
    cache = at.RemoteKVCache(client, 1, 1, 64)
    q = torch.randn(1, 2, 5, 64, dtype=torch.float16)  # [b, h, s, d]
    k = torch.randn(1, 1, 5, 64, dtype=torch.float16)
    o = at.RemoteAttention(0, layout="bhsd")(q, k, k, cache)
    assert o.shape == q.shape
    q64 = q[0].transpose(0, 1).double().numpy()
    k64 = k[0].transpose(0, 1).double().numpy()
    o_ref, _ = reference(q64, k64, k64, causal=True)
    assert relative_error(o[0].transpose(0, 1).double().numpy(), o_ref) <= TOLERANCE["fp16"]
    with pytest.raises(attnd.InvalidArgument, match=r"\[batch, tokens, heads, head_dim\]"):
        cache.step(0, q[0], k[0], k[0])
    with pytest.raises(attnd.InvalidArgument, match="holds 1 sequences; the step has 2"):
        cache.step(0, q.repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1))
    with pytest.raises(attnd.InvalidArgument, match="cannot drop 9 tokens"):
        cache.truncate(9)
    with pytest.raises(attnd.InvalidArgument, match="transport"):
        at.RemoteKVCache(client, 1, 1, 64, transport="carrier-pigeon")
    cache.close()


@pytest.mark.skipif(BACKEND != "cuda" or not torch.cuda.is_available(),
                    reason="CUDA IPC regions need a GPU and attnd's CUDA backend "
                           "(client/python/gpu_check.sh runs these on the GPU host)")
class TestCudaIpc:
    def test_attend_and_steps_in_a_gpu_region(self, server, client):
        gen = torch.Generator().manual_seed(53)
        region = attnd.CudaRegion(64 << 20, 0)
        client.register_region(region)
        try:
            for n_q in (8, 1024):  # small (gathered) and large (in place)
                q = region.tensor((n_q, 8, 128), torch.bfloat16)
                k = region.tensor((n_q, 2, 128), torch.bfloat16)
                v = region.tensor((n_q, 2, 128), torch.bfloat16)
                o = region.tensor((n_q, 8, 128), torch.bfloat16)
                lse = region.tensor((8, n_q), torch.float32)
                src = [torch.randn(*x.shape, generator=gen).bfloat16() for x in (q, k, v)]
                for x, s in zip((q, k, v), src):
                    x.copy_(s)
                o.fill_(float("nan"))
                lse.fill_(float("nan"))
                before = server.metrics()
                r = client.attend(q, k, v, causal=True, return_lse=True, out=o, lse_out=lse)
                assert r.o is o
                o_ref, lse_ref = reference(*(s.double().numpy() for s in src), causal=True)
                assert relative_error(values(o, "bf16"), o_ref) <= TOLERANCE["bf16"]
                check_lse(lse, lse_ref)
                assert "attn_shared_memory_tensor_bytes_total" in before
                region.reset()
            cache = at.RemoteKVCache(client, 2, 2, 128, transport="cuda-ipc")
            ref_cache = at.RemoteKVCache(client, 2, 2, 128, transport="grpc")
            for n in (300, 1, 1):
                for layer in range(2):
                    q = torch.randn(4, n, 8, 128, generator=gen).bfloat16().cuda()
                    k = torch.randn(4, n, 2, 128, generator=gen).bfloat16().cuda()
                    v = torch.randn(4, n, 2, 128, generator=gen).bfloat16().cuda()
                    a = cache.step(layer, q, k, v)
                    b = ref_cache.step(layer, q, k, v)
                    assert a.is_cuda
                    assert relative_error(a.double().cpu().numpy(), b.double().cpu().numpy()) <= \
                        TOLERANCE["bf16"]
            cache.close()
            ref_cache.close()
        finally:
            client.unregister_region(region)
            region.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grpc_host_arrays_are_the_tensors_rows(dtype):
    """The grpc transport's host copies: numpy views [batch, ...] of q, k, v in the session's
    dtype (bfloat16 as its bits), each row contiguous; CUDA tensors go joined, in one copy (here
    the same layout from CPU tensors, unpinned)."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, 2, h, 16, generator=gen) for h in (4, 2, 2)]
    xs[1] = xs[1].transpose(1, 2).contiguous().transpose(1, 2)  # strided, as a model's views are
    for got in (at._host_arrays(xs, dtype), at._joined_to_host(xs, dtype, pin=False)):
        for h, x in zip(got, xs):
            want = x.to(dtype).contiguous()
            want = want.view(torch.int16).numpy() if dtype == torch.bfloat16 else want.numpy()
            assert h.shape == tuple(x.shape) and np.array_equal(h.view(want.dtype), want)
            assert all(h[b].flags.c_contiguous for b in range(3))
