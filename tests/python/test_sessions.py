"""KV-cache sessions through the Python client: chunked prefill, decode, fork, truncate, batch steps
across sessions, and SessionClient placement and routing over two replicas; every step against
the float64 reference over the cache the test sent."""

from __future__ import annotations

import time

import numpy as np
import pytest

import attnd
from conftest import TOLERANCE, Server, check_lse, make, reference, relative_error, values


class Model:
    """What a session should hold: per layer, the exact keys and values sent so far."""

    def __init__(self, layers, kv_heads, d):
        self.k = [np.zeros((0, kv_heads, d)) for _ in range(layers)]
        self.v = [np.zeros((0, kv_heads, d)) for _ in range(layers)]

    def copy(self):
        m = Model(0, 0, 0)
        m.k, m.v = list(self.k), list(self.v)
        return m

    def truncate(self, n):
        self.k = [k[:len(k) - n] for k in self.k]
        self.v = [v[:len(v) - n] for v in self.v]


def step_and_check(rng, session, model, layer, n, heads, dtype, **opts):
    kv_heads, d = model.k[layer].shape[1], model.k[layer].shape[2]
    q, q64 = make(rng, (n, heads, d), dtype)
    k, k64 = make(rng, (n, kv_heads, d), dtype)
    v, v64 = make(rng, (n, kv_heads, d), dtype)
    r = session.step(layer, q, k, v, return_lse=True, **opts)
    model.k[layer] = np.concatenate([model.k[layer], k64])
    model.v[layer] = np.concatenate([model.v[layer], v64])
    assert r.cached_tokens == len(model.k[layer])
    o_ref, lse_ref = reference(q64, model.k[layer], model.v[layer], causal=True,
                               window=opts.get("window"), scale=opts.get("scale", 0.0))
    assert r.o.shape == (n, heads, d)
    assert relative_error(values(r.o, dtype), o_ref) <= TOLERANCE[dtype]
    check_lse(r.lse, lse_ref)
    return r


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_prefill_decode_fork_truncate(client, dtype):
    rng = np.random.default_rng(21)
    layers, heads, kv_heads, d = 2, 8, 2, 64
    with client.create_session(layers, kv_heads, d, dtype) as s:
        assert s.info.page_tokens > 0 and s.info.ttl_seconds > 0 and s.info.max_tokens > 0
        m = Model(layers, kv_heads, d)
        for chunk in (17, 32, 5):  # chunked prefill
            for layer in range(layers):
                step_and_check(rng, s, m, layer, chunk, heads, dtype)
        for _ in range(4):  # decode
            for layer in range(layers):
                step_and_check(rng, s, m, layer, 1, heads, dtype)
        t = s.truncate(3)  # three rejected draft tokens
        m.truncate(3)
        assert t.cached_tokens == [len(k) for k in m.k] == [55, 55]
        for layer in range(layers):
            step_and_check(rng, s, m, layer, 1, heads, dtype)
        with s.fork() as child:
            assert child.id != s.id and child.info.replica_id == s.info.replica_id
            cm = m.copy()
            for _ in range(3):  # different continuations on the two
                for layer in range(layers):
                    step_and_check(rng, child, cm, layer, 1, heads, dtype)
                    step_and_check(rng, s, m, layer, 1, heads, dtype)
            child.truncate(2)
            cm.truncate(2)
            step_and_check(rng, child, cm, 0, 2, heads, dtype)
        # The child's close freed only its own pages: the parent is whole.
        step_and_check(rng, s, m, 1, 1, heads, dtype, window=(10, 0), scale=0.2)
    assert s.closed
    with pytest.raises(attnd.NotFound):
        s.client.truncate_session(s.id, 0)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_speculative_rounds_at_every_head_dim(client, d):
    """What assisted generation sends: a prefill, a decode step, then rounds of a verification step
    of a few tokens and a truncate of the rejected ones, at each head dim the server serves."""
    if d not in client.info().head_dims:
        pytest.skip(f"head dim {d} is not served here")
    rng = np.random.default_rng(1000 + d)
    heads, kv_heads, dtype = 4, 2, "fp16"
    with client.create_session(1, kv_heads, d, dtype) as s:
        m = Model(1, kv_heads, d)
        step_and_check(rng, s, m, 0, 27, heads, dtype)  # the prompt and the first drafts at once
        for verify, rejected in ((0, 3), (4, 2), (4, 0), (3, 3), (2, 1), (16, 9), (5, 4), (4, 3)):
            if verify:
                step_and_check(rng, s, m, 0, verify, heads, dtype)
            if rejected:
                s.truncate(rejected)
                m.truncate(rejected)
        step_and_check(rng, s, m, 0, 1, heads, dtype)


def test_batch_step_across_sessions(client):
    rng = np.random.default_rng(22)
    heads, kv_heads, d = 4, 2, 64
    sessions = [client.create_session(2, kv_heads, d, "bf16") for _ in range(3)]
    models = [Model(2, kv_heads, d) for _ in sessions]
    try:
        for round_ in range(3):
            items, expected = [], []
            for s, m in zip(sessions, models):
                for layer in range(2):
                    n = 7 if round_ == 0 else 1
                    q, q64 = make(rng, (n, heads, d), "bf16")
                    k, k64 = make(rng, (n, kv_heads, d), "bf16")
                    v, v64 = make(rng, (n, kv_heads, d), "bf16")
                    items.append(attnd.StepItem(s, layer, q, k, v, return_lse=True))
                    m.k[layer] = np.concatenate([m.k[layer], k64])
                    m.v[layer] = np.concatenate([m.v[layer], v64])
                    expected.append((q64, m.k[layer], m.v[layer]))
            results = client.batch_step(items)
            for r, (q64, k64, v64) in zip(results, expected):
                o_ref, lse_ref = reference(q64, k64, v64, causal=True)
                assert r.cached_tokens == len(k64)
                assert relative_error(values(r.o, "bf16"), o_ref) <= TOLERANCE["bf16"]
                check_lse(r.lse, lse_ref)
        # One bad item (wrong layer) fails alone; the others are applied.
        q, _ = make(rng, (1, heads, d), "bf16")
        k, _ = make(rng, (1, kv_heads, d), "bf16")
        with pytest.raises(attnd.BatchStepError) as e:
            client.batch_step([(sessions[0], 0, q, k, k), (sessions[1], 5, q, k, k),
                               (sessions[2].id, 1, q, k, k)])
        results = e.value.results
        assert isinstance(results[1], attnd.InvalidArgument) and "layer 5" in results[1].message
        assert results[0].cached_tokens == 10 and results[2].cached_tokens == 10
        assert e.value.code.name == "INVALID_ARGUMENT"
        mixed = client.batch_step([(sessions[0], 1, q, k, k), (sessions[1], 9, q, k, k)],
                                  return_exceptions=True)
        assert mixed[0].cached_tokens == 10 and isinstance(mixed[1], attnd.InvalidArgument)
    finally:
        for s in sessions:
            s.close()


@pytest.fixture(scope="module")
def replicas():
    a = Server("--replica_id=alpha", "--kv_cache_bytes=33554432")
    b = Server("--replica_id=beta", "--kv_cache_bytes=33554432")
    yield a, b
    a.stop()
    b.stop()


def test_session_client_places_and_routes(replicas):
    a, b = replicas
    rng = np.random.default_rng(23)
    target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
    with attnd.SessionClient(target) as sc:
        assert sorted(r.replica_id for r in sc.replicas()) == ["alpha", "beta"]
        first = sc.create_session(1, 2, 64, "fp16")
        m1 = Model(1, 2, 64)
        step_and_check(rng, first, m1, 0, 200, 4, "fp16")  # takes pages on its replica
        second = sc.create_session(1, 2, 64, "fp16")  # goes where more pages are free
        assert {first.info.replica_id, second.info.replica_id} == {"alpha", "beta"}
        assert first.id.startswith(first.info.replica_id + ".")
        m2 = Model(1, 2, 64)
        step_and_check(rng, second, m2, 0, 3, 4, "fp16")
        # Calls by id alone route by the id's prefix, from this or another client.
        q, q64 = make(rng, (1, 4, 64), "fp16")
        k, k64 = make(rng, (1, 2, 64), "fp16")
        r = sc.step(second.id, 0, q, k, k)
        assert r.cached_tokens == 4
        with attnd.SessionClient([f"127.0.0.1:{b.port}", f"127.0.0.1:{a.port}"]) as other:
            moved = other.session(first.id)
            assert moved.client.options.target.endswith(
                str(a.port if first.info.replica_id == "alpha" else b.port))
            assert other.truncate_session(first.id, 100).cached_tokens == [100]
        results = sc.batch_step([(first, 0, q, k, k), (second.id, 0, q, k, k)])
        assert [x.cached_tokens for x in results] == [101, 5]
        with pytest.raises(attnd.NotFound, match="held by replica 'gamma'"):
            sc.step("gamma.0123", 0, q, k, k)
        with pytest.raises(attnd.BatchStepError) as e:
            sc.batch_step([(first, 0, q, k, k), ("gamma.0123", 0, q, k, k)])
        assert e.value.results[0].cached_tokens == 102
        assert isinstance(e.value.results[1], attnd.NotFound)
        child = sc.fork_session(first.id)
        assert child.info.replica_id == first.info.replica_id
        assert sc.close_session(child.id) >= 0
        first.close()
        second.close()


def test_session_placement_passes_over_full_replicas_and_names_every_refusal():
    """Two replicas that hold one session each: the second session passes over the replica that
    refuses it (RESOURCE_EXHAUSTED) to the other; a third is refused by both, and the error names
    each refusal. The same through the asyncio client."""
    import asyncio

    a = Server("--replica_id=one-a", "--max_sessions=1")
    b = Server("--replica_id=one-b", "--max_sessions=1")
    try:
        with attnd.SessionClient([a.target, b.target]) as sc:
            s1 = sc.create_session(1, 2, 64, "fp16")
            s2 = sc.create_session(1, 2, 64, "fp16")
            assert {s1.info.replica_id, s2.info.replica_id} == {"one-a", "one-b"}
            with pytest.raises(attnd.ResourceExhausted) as e:
                sc.create_session(1, 2, 64, "fp16")
            assert "failed on every replica" in e.value.message
            assert "one-a" in e.value.message and "one-b" in e.value.message
            s1.close()

            async def from_async_client():
                ac = await attnd.AsyncSessionClient.create([a.target, b.target])
                try:
                    s3 = await ac.create_session(1, 2, 64, "fp16")  # where s1 was
                    assert s3.info.replica_id == s1.info.replica_id
                    with pytest.raises(attnd.ResourceExhausted, match="failed on every replica"):
                        await ac.create_session(1, 2, 64, "fp16")
                    await s3.close()
                finally:
                    await ac.close()
            asyncio.run(from_async_client())
            s2.close()
    finally:
        a.stop()
        b.stop()


def test_session_client_reports_unreachable_targets():
    with pytest.raises(attnd.Unavailable, match="no attnd answered GetServerInfo"):
        attnd.SessionClient("ipv4:127.0.0.1:1", info_timeout=0.5, retries=0)
    with pytest.raises(attnd.Unavailable, match="'localhost' has no port"):
        attnd.SessionClient("localhost")


def _e4m3_values(x: np.ndarray) -> np.ndarray:
    """The values an FP8 (E4M3FN) cache holds for x (already divided by its scale): the nearest
    finite E4M3 value, which saturates at +-448."""
    codes = np.arange(256)
    e, m = (codes >> 3) & 0xF, codes & 0x7
    table = np.where(codes & 0x80, -1.0, 1.0) * np.where(e == 0, m / 8 * 2.0 ** -6,
                                                         (1 + m / 8) * 2.0 ** (e - 7.0))
    table = table[(codes & 0x7F) != 0x7F]
    return table[np.abs(x.reshape(-1, 1) - table.reshape(1, -1)).argmin(axis=1)].reshape(x.shape)


def test_fp8_cache_session_matches_the_reference_of_its_quantized_cache(client):
    if not client.info().fp8.session_fp8_cache:
        pytest.skip("this server's backend has no FP8 session caches (GetServerInfo fp8)")
    rng = np.random.default_rng()
    layers, heads, kv_heads, d, dtype = 2, 8, 2, 64, "bf16"
    # Inputs are N(0, 1): scales of 2.5/448 and 4/448 saturate the tail beyond 2.5 (head 0).
    k_scales = np.array([2.5 / 448, 4.0 / 448], dtype=np.float32)
    v_scales = np.array([4.0 / 448, 3.0 / 448], dtype=np.float32)
    with client.create_session(layers, kv_heads, d, dtype, cache_dtype="fp8_e4m3",
                               k_scales=k_scales, v_scales=v_scales) as s, \
            client.create_session(layers, kv_heads, d, dtype) as plain:
        assert s.info.cache_dtype == attnd._tensors.FLOAT8_E4M3
        assert s.info.page_tokens == 2 * plain.info.page_tokens
        cached = [[np.zeros((0, kv_heads, d)), np.zeros((0, kv_heads, d))] for _ in range(layers)]
        for n in (9, 1, 1, 4, 1):
            for layer in range(layers):
                q, q64 = make(rng, (n, heads, d), dtype)
                k, k64 = make(rng, (n, kv_heads, d), dtype)
                v, v64 = make(rng, (n, kv_heads, d), dtype)
                r = s.step(layer, q, k, v, return_lse=True)
                kq = _e4m3_values((k64 / k_scales[None, :, None]).astype(np.float32)) * \
                    k_scales[None, :, None]
                vq = _e4m3_values((v64 / v_scales[None, :, None]).astype(np.float32)) * \
                    v_scales[None, :, None]
                cached[layer][0] = np.concatenate([cached[layer][0], kq])
                cached[layer][1] = np.concatenate([cached[layer][1], vq])
                assert r.cached_tokens == len(cached[layer][0])
                o_ref, lse_ref = reference(q64, cached[layer][0], cached[layer][1], causal=True)
                assert relative_error(values(r.o, dtype), o_ref) <= TOLERANCE[dtype]
                check_lse(r.lse, lse_ref)
        s.truncate(3)
        assert s.step(0, *(make(rng, (1, h, d), dtype)[0] for h in (heads, kv_heads, kv_heads))
                      ).cached_tokens == len(cached[0][0]) - 2


def test_fp8_cache_steps_with_codes(client):
    """k_new and v_new sent as E4M3 codes with the session's scales (Step and BatchStep) are
    stored as they are: the answers match the reference over the dequantized codes, and a step
    whose scales differ from the session's is refused naming the field, the cache unchanged."""
    if not client.info().fp8.session_fp8_cache:
        pytest.skip("this server's backend has no FP8 session caches (GetServerInfo fp8)")
    from test_attend import _quantize
    rng = np.random.default_rng(41)
    heads, kv_heads, d, dtype = 4, 2, 64, "bf16"
    k_scales = np.array([3.0 / 448, 2.0 / 448], dtype=np.float32)
    v_scales = np.array([2.5 / 448, 3.5 / 448], dtype=np.float32)

    def codes_of(x, scales):
        codes = np.empty(x.shape, dtype=np.uint8)
        deq = np.empty(x.shape)
        for g in range(kv_heads):
            codes[:, g], deq[:, g] = _quantize(x[:, g], float(scales[g]))
        return codes, deq

    with client.create_session(1, kv_heads, d, dtype, cache_dtype="fp8_e4m3",
                               k_scales=k_scales, v_scales=v_scales) as s:
        ks, vs = np.zeros((0, kv_heads, d)), np.zeros((0, kv_heads, d))
        for n in (7, 1, 3):
            q, q64 = make(rng, (n, heads, d), dtype)
            k8, k64 = codes_of(rng.standard_normal((n, kv_heads, d)), k_scales)
            v8, v64 = codes_of(rng.standard_normal((n, kv_heads, d)), v_scales)
            if n == 3:
                r, = client.batch_step([attnd.StepItem(s, 0, q, k8, v8, k_new_scales=k_scales,
                                                       v_new_scales=v_scales)])
            else:
                r = s.step(0, q, k8, v8, k_new_scales=k_scales, v_new_scales=v_scales)
            ks, vs = np.concatenate([ks, k64]), np.concatenate([vs, v64])
            assert r.cached_tokens == len(ks)
            o_ref, _ = reference(q64, ks, vs, causal=True)
            assert relative_error(values(r.o, dtype), o_ref) <= TOLERANCE[dtype]
        q, _ = make(rng, (1, heads, d), dtype)
        k8, _ = codes_of(rng.standard_normal((1, kv_heads, d)), k_scales)
        with pytest.raises(attnd.InvalidArgument, match="k_new_scales"):
            s.step(0, q, k8, k8, k_new_scales=k_scales * 2, v_new_scales=v_scales)
        assert s.step(0, q, k8, k8, k_new_scales=k_scales, v_new_scales=v_scales).cached_tokens == \
            len(ks) + 1


def test_fp8_cache_session_refuses_bad_scales(client):
    if not client.info().fp8.session_fp8_cache:
        pytest.skip("this server's backend has no FP8 session caches (GetServerInfo fp8)")
    with pytest.raises(attnd.InvalidArgument, match=r"k_scales\[1\] must be finite and > 0"):
        client.create_session(1, 2, 64, "bf16", cache_dtype="fp8_e4m3", k_scales=[0.01, 0.0],
                              v_scales=[0.01, 0.01])
    with pytest.raises(attnd.InvalidArgument, match=r"v_scales must have num_kv_heads \(2\)"):
        client.create_session(1, 2, 64, "bf16", cache_dtype="fp8_e4m3", k_scales=[0.01, 0.01],
                              v_scales=[0.01])


def drain_until_handed_off(server, sessions=1):
    """SIGTERM to server (started with --handoff_peers), then waits until its log says it moved
    `sessions` sessions to a peer."""
    server.proc.terminate()
    deadline = time.monotonic() + 30
    while f"hand-off: {sessions} sessions moved" not in server.tail(50):
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.02)


def test_session_client_follows_a_session_handed_off_on_drain():
    b = Server("--replica_id=py-b", "--kv_cache_bytes=16777216")
    a = Server("--replica_id=py-a", "--kv_cache_bytes=16777216", f"--handoff_peers={b.target}",
               "--drain_quiet_ms=3000")
    try:
        rng = np.random.default_rng(31)
        with attnd.SessionClient(a.target) as sc:  # knows A only; learns B from A's answer
            s = sc.create_session(2, 2, 64, "bf16")
            m = Model(2, 2, 64)

            def step(layer, n):
                q, q64 = make(rng, (n, 4, 64), "bf16")
                k, k64 = make(rng, (n, 2, 64), "bf16")
                v, v64 = make(rng, (n, 2, 64), "bf16")
                # The Session object and the id it was created with, whatever replica holds it.
                r = s.step(layer, q, k, v) if n > 1 else sc.step(s.id, layer, q, k, v)
                m.k[layer] = np.concatenate([m.k[layer], k64])
                m.v[layer] = np.concatenate([m.v[layer], v64])
                assert r.cached_tokens == len(m.k[layer])
                o_ref, _ = reference(q64, m.k[layer], m.v[layer], causal=True)
                assert relative_error(values(r.o, "bf16"), o_ref) <= TOLERANCE["bf16"]

            for layer in (0, 1):
                step(layer, 40)
            drain_until_handed_off(a)
            for _ in range(3):
                for layer in (0, 1):
                    step(layer, 1)
            for layer in (0, 1):
                step(layer, 2)
            assert sc.current_session_id(s.id).startswith("py-b.")
            assert a.proc.wait(timeout=30) == 0
            q, _ = make(rng, (1, 4, 64), "bf16")
            k, _ = make(rng, (1, 2, 64), "bf16")
            got = sc.batch_step([(s.id, 0, q, k, k), (s.id, 1, q, k, k)])
            assert [r.cached_tokens for r in got] == [46, 46]
            assert s.truncate(1).cached_tokens == [45, 45]
            assert sc.close_session(s.id) >= 0
        with attnd.Client(b.target) as c:
            info = c.info()
            assert info.kv_cache.sessions == 0
            assert info.kv_cache.free_pages == info.kv_cache.total_pages
    finally:
        a.stop()
        b.stop()


def test_session_clients_idle_through_the_drain_find_their_sessions_on_the_peer():
    """A and B; the sessions are made on A (B's cache is the smaller). The callers stay idle while
    A hands them off and exits, so their next calls meet a closed port: the clients ask B, which
    answers the old ids with the new ones, and the steps go on there (sync and async clients,
    Step and BatchStep), equal to the float64 reference."""
    import asyncio

    b = Server("--replica_id=idle-py-b", "--kv_cache_bytes=8388608")
    a = Server("--replica_id=idle-py-a", "--kv_cache_bytes=16777216", f"--handoff_peers={b.target}",
               "--drain_quiet_ms=200")
    try:
        rng = np.random.default_rng(43)
        with attnd.SessionClient([a.target, b.target]) as sc:
            s = sc.create_session(1, 2, 64, "bf16")
            t = sc.create_session(1, 2, 64, "bf16")
            assert s.id.startswith("idle-py-a.") and t.id.startswith("idle-py-a.")
            models = {s.id: Model(1, 2, 64), t.id: Model(1, 2, 64)}

            def data(sid, n):
                q, q64 = make(rng, (n, 4, 64), "bf16")
                k, k64 = make(rng, (n, 2, 64), "bf16")
                v, v64 = make(rng, (n, 2, 64), "bf16")
                m = models[sid]
                m.k[0] = np.concatenate([m.k[0], k64])
                m.v[0] = np.concatenate([m.v[0], v64])
                return (q, k, v), q64

            def check(sid, r, q64):
                m = models[sid]
                assert r.cached_tokens == len(m.k[0])
                o_ref, _ = reference(q64, m.k[0], m.v[0], causal=True)
                assert relative_error(values(r.o, "bf16"), o_ref) <= TOLERANCE["bf16"]

            for sid in (s.id, t.id):
                (q, k, v), q64 = data(sid, 20)
                check(sid, sc.step(sid, 0, q, k, v), q64)
            a.proc.terminate()  # idle until A has gone
            assert a.proc.wait(timeout=30) == 0, a.tail()
            assert "hand-off: 2 sessions moved" in a.tail(50)
            (q, k, v), q64 = data(s.id, 1)
            check(s.id, sc.step(s.id, 0, q, k, v), q64)
            assert sc.current_session_id(s.id).startswith("idle-py-b.")
            (q, k, v), q64 = data(t.id, 2)
            got = sc.batch_step([(t.id, 0, q, k, v)])
            check(t.id, got[0], q64)
            assert sc.current_session_id(t.id).startswith("idle-py-b.")

            async def from_async_client():  # one that never knew A
                ac = await attnd.AsyncSessionClient.create([b.target])
                (q, k, v), q64 = data(s.id, 1)
                check(s.id, await ac.step(s.id, 0, q, k, v), q64)
                assert ac.current_session_id(s.id) == sc.current_session_id(s.id)
                await ac.close()
            asyncio.run(from_async_client())
            for sid in (s.id, t.id):
                assert sc.close_session(sid) >= 0
        with attnd.Client(b.target) as c:
            info = c.info()
            assert info.kv_cache.sessions == 0
            assert info.kv_cache.free_pages == info.kv_cache.total_pages
    finally:
        a.stop()
        b.stop()


def test_an_fp8_session_is_handed_off_with_its_cache_type_and_scales():
    b = Server("--replica_id=f8-b", "--kv_cache_bytes=16777216")
    a = Server("--replica_id=f8-a", "--kv_cache_bytes=16777216", f"--handoff_peers={b.target}",
               "--drain_quiet_ms=3000")
    try:
        with attnd.Client(a.target) as c:
            if not c.info().fp8.session_fp8_cache:
                pytest.skip("this server's backend has no FP8 session caches")
        with attnd.SessionClient(a.target) as sc:
            rng = np.random.default_rng(41)
            heads, kv_heads, d, dtype = 4, 2, 64, "bf16"
            k_scales = np.array([2.0 / 448, 5.0 / 448], dtype=np.float32)
            v_scales = np.array([4.0 / 448, 3.0 / 448], dtype=np.float32)
            s = sc.create_session(1, kv_heads, d, dtype, cache_dtype="fp8_e4m3",
                                  k_scales=k_scales, v_scales=v_scales)
            cached = [np.zeros((0, kv_heads, d)), np.zeros((0, kv_heads, d))]

            def step(n):
                q, q64 = make(rng, (n, heads, d), dtype)
                k, k64 = make(rng, (n, kv_heads, d), dtype)
                v, v64 = make(rng, (n, kv_heads, d), dtype)
                r = sc.step(s.id, 0, q, k, v)
                for i, (x64, sc_) in enumerate(((k64, k_scales), (v64, v_scales))):
                    xq = _e4m3_values((x64 / sc_[None, :, None]).astype(np.float32))
                    cached[i] = np.concatenate([cached[i], xq * sc_[None, :, None]])
                assert r.cached_tokens == len(cached[0])
                o_ref, _ = reference(q64, cached[0], cached[1], causal=True)
                assert relative_error(values(r.o, dtype), o_ref) <= TOLERANCE[dtype]

            step(16)
            step(1)
            drain_until_handed_off(a)
            for _ in range(3):  # on B now: the same quantized cache, the same scales
                step(1)
            assert sc.current_session_id(s.id).startswith("f8-b.")
            assert a.proc.wait(timeout=30) == 0
            sc.close_session(s.id)
    finally:
        a.stop()
        b.stop()


def test_async_session_client_follows_a_session_handed_off_on_drain():
    import asyncio

    b = Server("--replica_id=apy-b", "--kv_cache_bytes=16777216")
    a = Server("--replica_id=apy-a", "--kv_cache_bytes=16777216", f"--handoff_peers={b.target}",
               "--drain_quiet_ms=3000")
    rng = np.random.default_rng(37)
    m = Model(1, 2, 64)

    async def step(sc, sid, n):
        q, q64 = make(rng, (n, 4, 64), "fp16")
        k, k64 = make(rng, (n, 2, 64), "fp16")
        v, v64 = make(rng, (n, 2, 64), "fp16")
        r = await sc.step(sid, 0, q, k, v)
        m.k[0] = np.concatenate([m.k[0], k64])
        m.v[0] = np.concatenate([m.v[0], v64])
        assert r.cached_tokens == len(m.k[0])
        o_ref, _ = reference(q64, m.k[0], m.v[0], causal=True)
        assert relative_error(values(r.o, "fp16"), o_ref) <= TOLERANCE["fp16"]

    async def main():
        sc = await attnd.AsyncSessionClient.create(a.target)
        s = await sc.create_session(1, 2, 64, "fp16")
        await step(sc, s.id, 30)
        await asyncio.get_running_loop().run_in_executor(None, drain_until_handed_off, a)
        await step(sc, s.id, 1)
        assert sc.current_session_id(s.id).startswith("apy-b.")
        await step(sc, s.id, 2)
        assert (await sc.truncate_session(s.id, 3)).cached_tokens == [30]
        assert await sc.close_session(s.id) >= 0
        await sc.close()

    try:
        asyncio.run(main())
        assert a.proc.wait(timeout=30) == 0
    finally:
        a.stop()
        b.stop()
