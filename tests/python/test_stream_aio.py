"""AttendStream (sync and asyncio), the asyncio client with 64 calls in flight, asyncio sessions,
and the AttendStream item counter in /metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import attnd
import attnd.aio
from conftest import (TOLERANCE, Server, check_lse, make, metric, reference, relative_error,
                      values)


def _items(rng, n, bad_at=()):
    items, refs = [], []
    for i in range(n):
        s = 8 + 5 * i
        q, q64 = make(rng, (s, 4, 64), "bf16")
        k, k64 = make(rng, (s + 3, 2, 64), "bf16")
        v, v64 = make(rng, (s + 3, 2, 64), "bf16")
        if i in bad_at:
            k, v = k[:, :, :32].copy(), v[:, :, :32].copy()  # head_dim differs from q's
        items.append(attnd.AttendItem(q, k, v, causal=bool(i % 2)))
        refs.append(reference(q64, k64, v64, causal=bool(i % 2)))
    return items, refs


def _check(result, ref):
    assert relative_error(values(result.o, "bf16"), ref[0]) <= TOLERANCE["bf16"]
    check_lse(result.lse, ref[1])


def test_stream_answers_every_item_and_counts_them(server, client):
    rng = np.random.default_rng(31)
    items, refs = _items(rng, 20, bad_at={7})
    before = server.metrics()
    results = list(client.attend_stream(items, depth=4, return_exceptions=True, return_lse=True))
    assert len(results) == 20
    for i, (r, ref) in enumerate(zip(results, refs)):
        if i == 7:
            assert isinstance(r, attnd.InvalidArgument) and "k.shape[2] (head_dim)" in r.message
        else:
            assert r.request_id == i + 1
            _check(r, ref)
    after = server.metrics()
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)
    assert delta("attn_stream_items_total", code="OK") == 19
    assert delta("attn_stream_items_total", code="INVALID_ARGUMENT") == 1
    assert delta("attn_requests_total", rpc="AttendStream", code="OK") == 1


def test_stream_unordered_and_raising(client):
    rng = np.random.default_rng(32)
    items, refs = _items(rng, 12)
    seen = {}
    for r in client.attend_stream(items, depth=12, ordered=False, return_lse=True):
        seen[r.request_id - 1] = r
    assert sorted(seen) == list(range(12))
    for i, ref in enumerate(refs):
        _check(seen[i], ref)
    items, refs = _items(rng, 6, bad_at={3})
    got = []
    with pytest.raises(attnd.InvalidArgument, match="head_dim"):
        for r in client.attend_stream(items, return_lse=True):
            got.append(r)
    assert len(got) == 3
    # An item the client cannot code ends the stream after the earlier ones are answered.
    items, refs = _items(rng, 4)
    items.insert(2, ("not", "tensors", "here"))
    got = []
    with pytest.raises(TypeError, match="expected a numpy array"):
        for r in client.attend_stream(items, return_lse=True):
            got.append(r)
    assert len(got) == 2
    _check(got[0], refs[0])


def test_asyncio_64_calls_in_flight(server):
    rng = np.random.default_rng(33)
    cases = []
    for i in range(64):
        q, q64 = make(rng, (4 + i % 9, 4, 64), "fp16")
        k, k64 = make(rng, (6 + i % 5, 2, 64), "fp16")
        cases.append((q, k, reference(q64, k64, k64, causal=True)[0]))

    async def main():
        async with attnd.aio.Client(server.target, connections=2) as c:
            results = await asyncio.gather(*(c.attend(q, k, k, causal=True) for q, k, _ in cases))
            info = await c.info()
            healthy = await c.health()
            with pytest.raises(attnd.InvalidArgument, match="num_heads"):
                await c.attend(cases[0][0][:, :3], cases[0][1], cases[0][1])
            echoed = bytes(await c.echo(b"abc" * 1000, 5))
            return results, info, healthy, echoed

    results, info, healthy, echoed = asyncio.run(main())
    for r, (_, _, o_ref) in zip(results, cases):
        assert relative_error(values(r.o, "fp16"), o_ref) <= TOLERANCE["fp16"]
    assert info.replica_id and healthy and echoed == b"abcab"


def test_asyncio_sessions_and_stream(server):
    rng = np.random.default_rng(34)
    heads, kv_heads, d = 4, 2, 64

    async def main():
        async with attnd.aio.Client(server.target) as c:
            # 64 sessions: each round has 64 steps in flight at once.
            sessions = await asyncio.gather(*(c.create_session(1, kv_heads, d, "bf16")
                                              for _ in range(64)))
            caches = [[np.zeros((0, kv_heads, d))] * 2 for _ in sessions]
            for n in (9, 1, 1):
                steps, refs = [], []
                for s, cache in zip(sessions, caches):
                    q, q64 = make(rng, (n, heads, d), "bf16")
                    k, k64 = make(rng, (n, kv_heads, d), "bf16")
                    cache[0] = np.concatenate([cache[0], k64])
                    cache[1] = np.concatenate([cache[1], k64])
                    steps.append(s.step(0, q, k, k))
                    refs.append(reference(q64, cache[0], cache[1], causal=True)[0])
                for r, ref in zip(await asyncio.gather(*steps), refs):
                    assert relative_error(values(r.o, "bf16"), ref) <= TOLERANCE["bf16"]
            child = await sessions[0].fork()
            t = await child.truncate(2)
            assert t.cached_tokens == [9]
            q, _ = make(rng, (1, heads, d), "bf16")
            k, _ = make(rng, (1, kv_heads, d), "bf16")
            results = await c.batch_step([(child, 0, q, k, k), (sessions[1], 0, q, k, k)])
            assert [r.cached_tokens for r in results] == [10, 12]
            async with child:
                pass
            assert child.closed
            await asyncio.gather(*(s.close() for s in sessions))
            with pytest.raises(attnd.NotFound):
                await sessions[0].step(0, q, k, k)
            items, refs = _items(rng, 10, bad_at={4})

            async def source():
                for it in items:
                    yield it
            out = [r async for r in c.attend_stream(source(), depth=3, return_exceptions=True,
                                                    return_lse=True)]
            return out, refs

    out, refs = asyncio.run(main())
    for i, (r, ref) in enumerate(zip(out, refs)):
        if i == 4:
            assert isinstance(r, attnd.InvalidArgument)
        else:
            _check(r, ref)


def test_async_session_client(server):
    async def main():
        sc = await attnd.AsyncSessionClient.create(server.target)
        async with sc:
            s = await sc.create_session(1, 1, 64, "fp16")
            q = np.ones((2, 2, 64), np.float16)
            k = np.ones((2, 1, 64), np.float16)
            r = await sc.step(s.id, 0, q, k, k)
            assert r.cached_tokens == 2
            assert np.allclose(r.o.astype(np.float32), 1.0)
            assert (await sc.truncate_session(s.id, 1)).cached_tokens == [1]
            await sc.close_session(s.id)
            with pytest.raises(attnd.NotFound, match="not a session id"):
                await sc.step("nodot", 0, q, k, k)
    asyncio.run(main())


def test_asyncio_steps_of_one_turn_travel_as_one_batch_step(server):
    """Concurrent steps go as one BatchStep, each with its own result or error; a cancelled caller
    harms no other; coalesce_steps=False sends Steps."""
    rng = np.random.default_rng(35)
    heads, kv_heads, d, n = 4, 2, 64, 12

    def calls(rpc):
        return metric(server.metrics(), "attn_requests_total", rpc=rpc, code="OK")

    async def main():
        async with attnd.aio.Client(server.target) as c, \
                attnd.aio.Client(server.target, coalesce_steps=False) as plain:
            sessions = await asyncio.gather(*(c.create_session(1, kv_heads, d, "fp16")
                                              for _ in range(n)))
            caches = [[np.zeros((0, kv_heads, d))] * 2 for _ in sessions]
            for round_, who in enumerate((c, plain, c)):
                steps, refs = [], []
                for i, (s, cache) in enumerate(zip(sessions, caches)):
                    t = 5 if round_ == 0 else 1
                    q, q64 = make(rng, (t, heads, d), "fp16")
                    k, k64 = make(rng, (t, kv_heads, d), "fp16")
                    v, v64 = make(rng, (t, kv_heads, d), "fp16")
                    if round_ == 2 and i == 3:  # a bad item: head_dim of k differs from q's
                        steps.append(who.step(s, 0, q, k[:, :, :32].copy(), v[:, :, :32].copy()))
                        refs.append(None)
                        continue
                    cache[0] = np.concatenate([cache[0], k64])
                    cache[1] = np.concatenate([cache[1], v64])
                    steps.append(who.step(s, 0, q, k, v))
                    refs.append(reference(q64, cache[0], cache[1], causal=True)[0])
                before = calls("BatchStep"), calls("Step")
                results = await asyncio.gather(*steps, return_exceptions=True)
                after = calls("BatchStep"), calls("Step")
                for r, ref in zip(results, refs):
                    if ref is None:
                        assert isinstance(r, attnd.InvalidArgument) and "head_dim" in str(r)
                    else:
                        assert relative_error(values(r.o, "fp16"), ref) <= TOLERANCE["fp16"]
                if who is c:
                    assert after[0] - before[0] == 1 and after[1] == before[1]
                else:
                    assert after[0] == before[0] and after[1] - before[1] == n
            # One caller cancelled while its turn is gathered: the others' steps still land.
            q, _ = make(rng, (1, heads, d), "fp16")
            k, _ = make(rng, (1, kv_heads, d), "fp16")
            tasks = [asyncio.ensure_future(s.step(0, q, k, k)) for s in sessions[:4]]
            await asyncio.sleep(0)
            tasks[0].cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            assert isinstance(done[0], asyncio.CancelledError)
            assert [r.cached_tokens for r in done[1:]] == [8, 8, 7]  # 3 missed the bad round
            await asyncio.gather(*(s.close() for s in sessions))

    asyncio.run(main())


def test_batches_of_prefills_stay_under_the_message_limit():
    """Prefills whose steps together pass the message limit (asyncio steps of one turn, or one
    batch_step call, sync or asyncio) go in several BatchSteps, each answered right, instead of
    one call refused as too large."""
    limit = 4 << 20
    server = Server(f"--max_message_bytes={limit}")
    rng = np.random.default_rng(36)
    heads, kv_heads, d, n, t = 4, 2, 64, 8, 600  # 600 KiB of tensors a step, 4.7 MiB together

    def calls(rpc):
        return metric(server.metrics(), "attn_requests_total", rpc=rpc, code="OK")

    def prefills():
        work, refs = [], []
        for _ in range(n):
            q, q64 = make(rng, (t, heads, d), "fp16")
            k, k64 = make(rng, (t, kv_heads, d), "fp16")
            v, v64 = make(rng, (t, kv_heads, d), "fp16")
            work.append((q, k, v))
            refs.append(reference(q64, k64, v64, causal=True)[0])
        return work, refs

    def check(results, refs, before):
        after = calls("BatchStep"), calls("Step")
        for r, ref in zip(results, refs):
            assert r.cached_tokens == t
            assert relative_error(values(r.o, "fp16"), ref) <= TOLERANCE["fp16"]
        # At most half the limit (2 MiB) a call: steps 3, 3 and 2 in three BatchSteps.
        assert (after[0] - before[0], after[1] - before[1]) == (3, 0)

    async def asyncio_part():
        async with attnd.aio.Client(server.target, max_message_bytes=limit) as c:
            for one_call in (False, True):
                sessions = await asyncio.gather(*(c.create_session(1, kv_heads, d, "fp16")
                                                  for _ in range(n)))
                work, refs = prefills()
                before = calls("BatchStep"), calls("Step")
                if one_call:
                    results = await c.batch_step([attnd.StepItem(s, 0, *w)
                                                  for s, w in zip(sessions, work)])
                else:
                    results = await asyncio.gather(*(s.step(0, *w)
                                                     for s, w in zip(sessions, work)))
                check(results, refs, before)
                await asyncio.gather(*(s.close() for s in sessions))

    try:
        asyncio.run(asyncio_part())
        with attnd.Client(server.target, max_message_bytes=limit) as c:
            sessions = [c.create_session(1, kv_heads, d, "fp16") for _ in range(n)]
            work, refs = prefills()
            before = calls("BatchStep"), calls("Step")
            results = c.batch_step([attnd.StepItem(s, 0, *w) for s, w in zip(sessions, work)])
            check(results, refs, before)
            for s in sessions:
                s.close()
    finally:
        server.stop()


def test_batch_step_in_parts_fails_only_the_part_whose_call_fails():
    """A batch_step cut into several calls: a call refused as a whole (larger than attnd's
    message limit, which this client's larger limit let through) fails its own items only; the
    items of the other calls are applied and answered."""
    server = Server(f"--max_message_bytes={4 << 20}")
    rng = np.random.default_rng(37)
    heads, kv_heads, d = 2, 1, 128  # 1 KiB of tensors a token
    try:
        with attnd.Client(server.target, max_message_bytes=16 << 20) as c:  # parts of <= 8 MiB
            sessions = [c.create_session(1, kv_heads, d, "fp16") for _ in range(3)]
            work, refs = [], []
            for t in (2560, 5120, 2560):  # calls: [2.5 + 5 MiB] (refused), [2.5 MiB]
                q, q64 = make(rng, (t, heads, d), "fp16")
                k, k64 = make(rng, (t, kv_heads, d), "fp16")
                v, v64 = make(rng, (t, kv_heads, d), "fp16")
                work.append((q, k, v))
                refs.append((q64, k64, v64))
            results = c.batch_step([attnd.StepItem(s, 0, *w) for s, w in zip(sessions, work)],
                                   return_exceptions=True)
            assert isinstance(results[0], attnd.ResourceExhausted), results[0]
            assert isinstance(results[1], attnd.ResourceExhausted), results[1]
            assert results[0] is not results[1]
            ref = reference(*refs[2], causal=True)[0]
            assert results[2].cached_tokens == 2560
            assert relative_error(values(results[2].o, "fp16"), ref) <= TOLERANCE["fp16"]
            with pytest.raises(attnd.BatchStepError):
                c.batch_step([attnd.StepItem(s, 0, *w) for s, w in zip(sessions, work)])
            one = [make(rng, (1, h, d), "fp16")[0] for h in (heads, kv_heads, kv_heads)]
            # The refused part's sessions are still empty.
            assert [s.step(0, *one).cached_tokens for s in sessions[:2]] == [1, 1]
            for s in sessions:
                s.close()
    finally:
        server.stop()


class _Overlap:
    """Counts BatchStep calls in flight at once (each held a moment before it is sent)."""

    def __init__(self):
        self.now = self.most = self.calls = 0

    def enter(self, method):
        if method == "BatchStep":
            self.calls += 1
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self, method):
        if method == "BatchStep":
            self.now -= 1


def test_large_batch_step_spreads_over_connections_unless_a_session_repeats():
    """With connections=3, a batch_step of 18 MiB of prefills goes as three calls at once (sync:
    threads; asyncio: gathered), each item answered right; a batch in which one session has steps
    in two of the parts goes one call after the other, its steps applied in order."""
    server = Server()
    rng = np.random.default_rng(39)
    heads, d, t, n = 32, 128, 64, 12  # 1.5 MiB of tensors a step: parts of 5, 5 and 2 steps

    def work(sessions):
        items, refs = [], []
        for s in sessions:
            q, q64 = make(rng, (t, heads, d), "fp16")
            k, k64 = make(rng, (t, heads, d), "fp16")
            v, v64 = make(rng, (t, heads, d), "fp16")
            items.append(attnd.StepItem(s, 0, q, k, v))
            refs.append((q64, k64, v64))
        return items, refs

    def check(results, refs, repeated=None):
        for i, (r, (q64, k64, v64)) in enumerate(zip(results, refs)):
            if repeated is not None and i == repeated[1]:  # the session's second chunk
                q0, k0, v0 = refs[repeated[0]]
                full = reference(np.concatenate([q0, q64]), np.concatenate([k0, k64]),
                                 np.concatenate([v0, v64]), causal=True)[0]
                assert r.cached_tokens == 2 * t
                assert relative_error(values(r.o, "fp16"), full[t:]) <= TOLERANCE["fp16"]
                continue
            assert r.cached_tokens == t
            ref = reference(q64, k64, v64, causal=True)[0]
            assert relative_error(values(r.o, "fp16"), ref) <= TOLERANCE["fp16"]

    def repeat_first(sessions):
        # The first session's second chunk last: in the third part, after its first in the first.
        return sessions + [sessions[0]]

    async def asyncio_part():
        async with attnd.aio.Client(server.target, connections=3) as c:
            overlap = _Overlap()
            unary = c._unary

            async def counted(method, *a, **kw):
                overlap.enter(method)
                await asyncio.sleep(0.2)
                try:
                    return await unary(method, *a, **kw)
                finally:
                    overlap.leave(method)

            c._unary = counted
            sessions = [await c.create_session(1, heads, d, "fp16") for _ in range(n - 1)]
            items, refs = work(sessions + [await c.create_session(1, heads, d, "fp16")])
            check(await c.batch_step(items), refs)
            assert (overlap.calls, overlap.most) == (3, 3)
            overlap.calls = overlap.most = 0
            for s in sessions:
                await c.truncate_session(s.id, t)
            items, refs = work(repeat_first(sessions))
            check(await c.batch_step(items), refs, repeated=(0, n - 1))
            assert (overlap.calls, overlap.most) == (3, 1)

    def sync_part(connections, expect):
        with attnd.Client(server.target, connections=connections) as c:
            overlap, lock = _Overlap(), threading.Lock()
            unary = c._unary

            def counted(method, *a, **kw):
                with lock:
                    overlap.enter(method)
                time.sleep(0.2)
                try:
                    return unary(method, *a, **kw)
                finally:
                    with lock:
                        overlap.leave(method)

            c._unary = counted
            sessions = [c.create_session(1, heads, d, "fp16") for _ in range(n)]
            items, refs = work(sessions)
            check(c.batch_step(items), refs)
            assert (overlap.calls, overlap.most) == expect
            if connections > 1:
                overlap.calls = overlap.most = 0
                for s in sessions[:n - 1]:
                    c.truncate_session(s.id, t)
                items, refs = work(repeat_first(sessions[:n - 1]))
                check(c.batch_step(items), refs, repeated=(0, n - 1))
                assert (overlap.calls, overlap.most) == (3, 1)

    try:
        asyncio.run(asyncio_part())
        sync_part(3, (3, 3))
        sync_part(1, (1, 1))  # one connection: one call of up to 128 MiB
    finally:
        server.stop()


def _fp8_items(rng, n, bad_at=()):
    """All-FP8 items (e4m3 codes of q, k, v with per-tensor descales, o in fp16), the odd ones
    with their descales per item and the even ones taking the stream's defaults (descales of
    1/448 of values in [-1, 1)); bad items lack v's descale."""
    from test_attend import _quantize
    items, refs = [], []
    for i in range(n):
        s = 6 + 7 * i
        qx, kx, vx = (rng.uniform(-1, 1, (rows, heads, 64)) for rows, heads in
                      ((s, 4), (s + 5, 2), (s + 5, 2)))
        if i % 2:
            scales = [float(np.abs(x).max() / 448) for x in (qx, kx, vx)]
        else:
            scales = [1 / 448] * 3
        (q8, q64), (k8, k64), (v8, v64) = (_quantize(x, sc) for x, sc in zip((qx, kx, vx), scales))
        opts = {}
        if i % 2:
            opts = dict(q_descale=[scales[0]], k_descale=[scales[1]], v_descale=[scales[2]],
                        o_dtype="float16")
        if i in bad_at:
            opts = dict(q_descale=[scales[0]], k_descale=[scales[1]], v_descale=[], o_dtype="float16")
        items.append(attnd.AttendItem(q8, k8, v8, causal=True, **opts))
        refs.append(reference(q64, k64, v64, causal=True))
    return items, refs


FP8_DEFAULTS = dict(q_descale=[1 / 448], k_descale=[1 / 448], v_descale=[1 / 448], o_dtype="float16")


def test_fp8_attend_stream_and_asyncio(client, server):
    """FP8 Attend through AttendStream (descales per item or from the stream's defaults; an item
    without v's descale fails alone, naming the field) and through the asyncio client's attend
    and attend_stream, each answer against the float64 reference of its dequantized inputs."""
    if not client.info().fp8.attend_fp8_q:
        pytest.skip("this server's backend has no FP8 Attend (GetServerInfo fp8)")
    rng = np.random.default_rng(35)
    items, refs = _fp8_items(rng, 8, bad_at={5})
    results = list(client.attend_stream(items, depth=3, return_exceptions=True, **FP8_DEFAULTS))
    for i, (r, ref) in enumerate(zip(results, refs)):
        if i == 5:
            assert isinstance(r, attnd.InvalidArgument) and "fp8.v_descale" in r.message, r
        else:
            assert r.o.dtype == np.float16
            assert relative_error(r.o.astype(np.float64), ref[0]) <= TOLERANCE["fp16"], i

    items, refs = _fp8_items(rng, 6)

    async def main():
        async with attnd.aio.Client(server.target) as c:
            one = await c.attend(items[1].q, items[1].k, items[1].v, causal=True,
                                 q_descale=items[1].q_descale, k_descale=items[1].k_descale,
                                 v_descale=items[1].v_descale, o_dtype="float16")
            streamed = [r async for r in c.attend_stream(items, depth=4, **FP8_DEFAULTS)]
            return one, streamed

    one, streamed = asyncio.run(main())
    assert relative_error(one.o.astype(np.float64), refs[1][0]) <= TOLERANCE["fp16"]
    assert len(streamed) == len(refs)
    for r, ref in zip(streamed, refs):
        assert relative_error(r.o.astype(np.float64), ref[0]) <= TOLERANCE["fp16"]
