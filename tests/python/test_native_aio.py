"""The asyncio Client's native transport (attnd._native.AsyncNativeChannel: calls started on the
C++ client library's completion queue, read when the event loop sees its file descriptor): the
same answers and errors as grpc.aio's, coalesced steps coded and read by the library with each
item's own outcome, many calls in flight, cancellation, deadlines, and closing under calls."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import attnd
import attnd.aio
from attnd import _core, _native
from conftest import TOLERANCE, make, reference, relative_error, values

NATIVE_REQUIRED = os.environ.get("ATTND_REQUIRE_NATIVE") == "1"


def run(coro):
    return asyncio.run(coro)


def clients(server, **kw):
    """A native asyncio client and a grpc.aio one of the same attnd (inside a running loop)."""
    native = attnd.aio.Client(server.target, timeout=120, **kw)
    grpcio = attnd.aio.Client(server.target, timeout=120, transport="grpcio", **kw)
    assert grpcio.transport == "grpcio"
    return native, grpcio


@pytest.fixture(scope="module", autouse=True)
def native_or_skip(server):
    if os.environ.get("ATTND_TRANSPORT", "auto") == "grpcio":
        pytest.skip("ATTND_TRANSPORT=grpcio: this run tests grpc.aio only")
    async def probe():  # grpc.aio channels belong to a running loop
        c = attnd.aio.Client(server.target)
        try:
            return c.transport, c.transport_note
        finally:
            await c.close()
    transport, note = run(probe())
    if transport != "native":
        if NATIVE_REQUIRED:
            pytest.fail(f"the native transport did not load: {note}")
        pytest.skip(f"no native transport: {note}")


def record_library_steps(monkeypatch):
    """A list that gets (steps, single) for each call of steps the library codes."""
    calls = []
    real = _native.AsyncNativeChannel.start_steps

    def counted(self, specs, timeout, single, done):
        calls.append((len(specs), single))
        return real(self, specs, timeout, single, done)

    monkeypatch.setattr(_native.AsyncNativeChannel, "start_steps", counted)
    return calls


def step_inputs(rng, tokens, d=64, dtype="bf16"):
    return (make(rng, (tokens, 4, d), dtype), make(rng, (tokens, 2, d), dtype),
            make(rng, (tokens, 2, d), dtype))


def test_attend_and_echo_are_grpc_aios_bytes(server):
    async def main():
        native, grpcio = clients(server)
        rng = np.random.default_rng()
        try:
            for tokens in (37, 1500):  # 1500: above PARTS_MIN_BYTES, sent in its parts
                (q, q64), (k, k64), (v, v64) = (make(rng, (tokens, 4, 64), "fp16"),
                                                make(rng, (tokens + 9, 2, 64), "fp16"),
                                                make(rng, (tokens + 9, 2, 64), "fp16"))
                a, b = await asyncio.gather(native.attend(q, k, v, causal=True, return_lse=True),
                                            grpcio.attend(q, k, v, causal=True, return_lse=True))
                assert a.o.tobytes() == b.o.tobytes() and a.lse.tobytes() == b.lse.tobytes()
                o64, _ = reference(q64, k64, v64, causal=True)
                assert relative_error(values(a.o, "fp16"), o64) <= TOLERANCE["fp16"]
            payload = rng.integers(0, 256, 300000, dtype=np.uint8).tobytes()
            assert bytes(await native.echo(payload)) == payload
            assert native._native is not None  # the calls went native
        finally:
            await native.close()
            await grpcio.close()
    run(main())


def test_coalesced_steps_are_coded_by_the_library_each_with_its_outcome(server, monkeypatch):
    """64 sessions' steps of one loop turn go as BatchSteps of 16 (the default
    max_coalesced_steps) coded and read by the library;
    their outputs equal grpc.aio's and the float64 reference; a step of a closed session fails
    alone with attnd's NOT_FOUND while the others succeed."""
    if _native._fast is None:
        pytest.skip("attnd._fast is not loaded: coalesced steps are coded in Python")
    calls = record_library_steps(monkeypatch)

    async def main():
        native, grpcio = clients(server)
        rng = np.random.default_rng()
        n = 64
        ours = [await native.create_session(1, 2, 64, "bf16") for _ in range(n)]
        theirs = [await grpcio.create_session(1, 2, 64, "bf16") for _ in range(n)]
        history = [([], [], []) for _ in range(n)]
        try:
            for t in range(3):
                inputs = [step_inputs(rng, 5 if t == 0 else 1) for _ in range(n)]
                opts = [{"return_lse": i % 2 == 0, "window": (3, 0) if i % 3 == 0 else None}
                        for i in range(n)]
                a = await asyncio.gather(*(s.step(0, q[0], k[0], v[0], **o) for s, (q, k, v), o
                                           in zip(ours, inputs, opts)))
                b = await asyncio.gather(*(s.step(0, q[0], k[0], v[0], **o) for s, (q, k, v), o
                                           in zip(theirs, inputs, opts)))
                for i in range(n):
                    assert a[i].o.tobytes() == b[i].o.tobytes(), i
                    assert a[i].cached_tokens == b[i].cached_tokens
                    assert (a[i].lse is None) == (b[i].lse is None)
                    if a[i].lse is not None:
                        assert a[i].lse.tobytes() == b[i].lse.tobytes()
                    assert a[i].timing.batch_requests >= 1
                for i in (0, 17):  # against the float64 reference over the whole cache
                    (q, q64), (k, k64), (v, v64) = inputs[i]
                    history[i][0].append(k64)
                    history[i][1].append(v64)
                for i in (0, 17):
                    if t == 2:
                        (q, q64), _, _ = inputs[i]
                        ks, vs = np.concatenate(history[i][0]), np.concatenate(history[i][1])
                        o64, _ = reference(q64, ks, vs, causal=True,
                                           window=(3, 0) if i % 3 == 0 else None)
                        assert relative_error(values(a[i].o, "bf16"), o64) <= TOLERANCE["bf16"]
            assert [c for c, _ in calls[-(n // 16):]] == [16] * (n // 16), calls[-8:]
            # One step of a closed session among good ones.
            await ours[5].close()
            inputs = [step_inputs(rng, 1) for _ in range(n)]
            got = await asyncio.gather(*(s.step(0, q[0], k[0], v[0]) for s, (q, k, v)
                                         in zip(ours, inputs)), return_exceptions=True)
            assert isinstance(got[5], attnd.NotFound), got[5]
            assert ours[5].id in str(got[5])
            assert all(not isinstance(r, Exception) for i, r in enumerate(got) if i != 5)
            assert got[6].cached_tokens == 8
            # A step the client refuses (float64 q) among good ones fails alone, before sending.
            inputs = [step_inputs(rng, 1) for _ in range(4)]
            qs = [q[0] for q, _, _ in inputs]
            qs[2] = qs[2].astype(np.float64)
            got = await asyncio.gather(*(ours[i].step(0, qs[i], k[0], v[0]) for i, (_, k, v)
                                         in enumerate(inputs)), return_exceptions=True)
            assert isinstance(got[2], attnd.InvalidArgument), got[2]
            assert [r.cached_tokens for i, r in enumerate(got) if i != 2] == [9, 9, 9]
            # A client with a wider cap carries a whole turn's steps in one call.
            wide = attnd.aio.Client(server.target, timeout=120, max_coalesced_steps=n)
            try:
                live = ours[:5] + ours[6:]
                inputs = [step_inputs(rng, 1) for _ in live]
                got = await asyncio.gather(*(wide.step(s.id, 0, q[0], k[0], v[0]) for s, (q, k, v)
                                             in zip(live, inputs)))
                assert calls[-1][0] == len(live), calls[-4:]
                assert [r.cached_tokens for r in got[:5]] == [10, 10, 9, 10, 9]
            finally:
                await wide.close()
        finally:
            for s in ours[:5] + ours[6:] + theirs:
                await s.close()
            await native.close()
            await grpcio.close()
    run(main())


def test_steps_one_call_each_are_coded_by_the_library(server, monkeypatch):
    """Without coalescing, a step of numpy arrays is one Step call coded and read by the library
    (attn_c_step_start): its outputs equal grpc.aio's and the float64 reference, with and without
    lse and windows; a step of a closed session fails with attnd's NOT_FOUND naming it."""
    if not _native._fast_single:
        pytest.skip("attnd._fast does not start single steps: they are coded in Python")
    calls = record_library_steps(monkeypatch)

    async def main():
        native, grpcio = clients(server, coalesce_steps=False)
        rng = np.random.default_rng()
        ours = [await native.create_session(1, 2, 64, "bf16") for _ in range(3)]
        theirs = [await grpcio.create_session(1, 2, 64, "bf16") for _ in range(3)]
        keys = [[] for _ in ours]
        try:
            for t in range(4):
                for i, (a_s, b_s) in enumerate(zip(ours, theirs)):
                    (q, q64), (k, k64), (v, v64) = step_inputs(rng, 6 if t == 0 else 1)
                    keys[i].append((k64, v64))
                    o = {"return_lse": (i + t) % 2 == 0, "window": (2, 0) if i == 1 else None}
                    a, b = await asyncio.gather(a_s.step(0, q, k, v, **o),
                                                b_s.step(0, q, k, v, **o))
                    assert a.o.tobytes() == b.o.tobytes(), (t, i)
                    assert a.cached_tokens == b.cached_tokens == 6 + t
                    assert (a.lse is None) == (b.lse is None) == (not o["return_lse"])
                    if a.lse is not None:
                        assert a.lse.tobytes() == b.lse.tobytes()
                    ks = np.concatenate([kv[0] for kv in keys[i]])
                    vs = np.concatenate([kv[1] for kv in keys[i]])
                    o64, _ = reference(q64, ks, vs, causal=True, window=o["window"])
                    assert relative_error(values(a.o, "bf16"), o64) <= TOLERANCE["bf16"]
            assert calls and all(c == (1, True) for c in calls)
            await ours[1].close()
            (q, _), (k, _), (v, _) = step_inputs(rng, 1)
            with pytest.raises(attnd.NotFound) as e:
                await ours[1].step(0, q, k, v)
            assert ours[1].id in str(e.value)
        finally:
            for s in [ours[0], ours[2]] + theirs:
                await s.close()
            await native.close()
            await grpcio.close()
    run(main())


def test_steps_the_library_does_not_take_are_coded_here(server, monkeypatch):
    """A strided q, an out array, or one step alone: coded in Python, sent natively, the same
    answers as grpc.aio's."""
    async def main():
        native, grpcio = clients(server)
        rng = np.random.default_rng()
        a = [await native.create_session(1, 2, 64, "fp16") for _ in range(2)]
        b = [await grpcio.create_session(1, 2, 64, "fp16") for _ in range(2)]
        try:
            wide = make(rng, (1, 8, 64), "fp16")[0]
            k, v = make(rng, (1, 2, 64), "fp16")[0], make(rng, (1, 2, 64), "fp16")[0]
            out = np.empty((1, 4, 64), np.float16)
            x = await asyncio.gather(a[0].step(0, wide[:, ::2], k, v),
                                     a[1].step(0, wide[:, 1::2], k, v, out=out))
            y = await asyncio.gather(b[0].step(0, np.ascontiguousarray(wide[:, ::2]), k, v),
                                     b[1].step(0, np.ascontiguousarray(wide[:, 1::2]), k, v))
            assert x[0].o.tobytes() == y[0].o.tobytes()
            assert x[1].o is out and out.tobytes() == y[1].o.tobytes()
            lone = await a[0].step(0, wide[:, 4:], k, v)
            assert lone.o.tobytes() == (await b[0].step(0, wide[:, 4:], k, v)).o.tobytes()
        finally:
            for s in a + b:
                await s.close()
            await native.close()
            await grpcio.close()
    run(main())


def test_coalesced_steps_cancelled_failed_as_a_call_and_drained_by_close(server, monkeypatch):
    """Coalesced steps whose call the library codes (settled by its completion, no task): a
    step cancelled before its turn ends is left out of the call; one cancelled while the call
    runs ends cancelled while the others get their results; a call that fails as a whole (its
    deadline) fails each of its steps with its own error; close() waits for the calls in flight,
    whose steps complete."""
    if _native._fast is None:
        pytest.skip("attnd._fast is not loaded: coalesced steps are coded in Python")
    calls = record_library_steps(monkeypatch)

    async def main():
        native = attnd.aio.Client(server.target, timeout=120)
        rng = np.random.default_rng()
        sessions = [await native.create_session(1, 2, 64, "bf16") for _ in range(4)]
        try:
            inputs = [step_inputs(rng, 1) for _ in sessions]
            tasks = [asyncio.ensure_future(s.step(0, q[0], k[0], v[0]))
                     for s, (q, k, v) in zip(sessions, inputs)]
            await asyncio.sleep(0)  # each task waits on its step's future; the turn is not over
            tasks[1].cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            assert isinstance(got[1], asyncio.CancelledError), got[1]
            assert [r.cached_tokens for i, r in enumerate(got) if i != 1] == [1, 1, 1]
            assert calls[-1] == (3, False), calls[-4:]
            # Cancelled while the call runs: the others' results come all the same.
            tasks = [asyncio.ensure_future(s.step(0, q[0], k[0], v[0]))
                     for s, (q, k, v) in zip(sessions, inputs)]
            for _ in range(3):  # the turn ends and the call starts
                await asyncio.sleep(0)
            assert calls[-1] == (4, False), calls[-4:]
            tasks[2].cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            assert isinstance(got[2], asyncio.CancelledError), got[2]
            assert [r.cached_tokens for i, r in enumerate(got) if i != 2] == [2, 1, 2]
            # A call that fails as a whole: each step gets its own DeadlineExceeded.
            big = [step_inputs(rng, 20000, d=64) for _ in range(2)]
            got = await asyncio.gather(*(s.step(0, q[0], k[0], v[0], timeout=0.001)
                                         for s, (q, k, v) in zip(sessions[:2], big)),
                                       return_exceptions=True)
            assert all(isinstance(r, attnd.DeadlineExceeded) for r in got), got
            assert got[0] is not got[1]
            # close() under steps in flight: it waits for their call, and they complete.
            fresh = [await native.create_session(1, 2, 64, "bf16") for _ in range(4)]
            sessions += fresh
            running = [asyncio.ensure_future(s.step(0, q[0], k[0], v[0]))
                       for s, (q, k, v) in zip(fresh, inputs)]
            for _ in range(3):
                await asyncio.sleep(0)
            closing = asyncio.ensure_future(native.close())
            got = await asyncio.gather(*running)
            await closing
            assert [r.cached_tokens for r in got] == [1, 1, 1, 1]
            assert native._native._calls == {}
        finally:
            other = attnd.aio.Client(server.target, timeout=120)
            for s in sessions:
                await other.close_session(s.id)
            await other.close()
    run(main())


def test_errors_deadlines_and_cancellation(server):
    async def main():
        native, grpcio = clients(server)
        rng = np.random.default_rng()
        try:
            bad = np.zeros((4, 2, 48), np.float16)
            with pytest.raises(attnd.InvalidArgument) as e1:
                await native.attend(bad, bad, bad)
            with pytest.raises(attnd.InvalidArgument) as e2:
                await grpcio.attend(bad, bad, bad)
            assert str(e1.value) == str(e2.value)
            real = await native.create_session(1, 2, 64, "bf16")
            await real.close()
            x = make(rng, (1, 2, 64), "bf16")[0]
            with pytest.raises(attnd.NotFound, match=real.id):
                await native.session(real.id).step(0, x, x, x)
            big = bytes(64 << 20)
            with pytest.raises(attnd.DeadlineExceeded):
                await native.echo(big, timeout=0.001)
            # Cancelled while in flight: the task ends cancelled; the library still completes the
            # call, and the client goes on working.
            task = asyncio.ensure_future(native.echo(big))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert bytes(await native.echo(b"after")) == b"after"
            assert native._native._calls == {} or await _settled(native)
        finally:
            await native.close()
            await grpcio.close()
    run(main())


async def _settled(client) -> bool:
    for _ in range(200):
        if not client._native._calls:
            return True
        await asyncio.sleep(0.01)
    return False


def test_many_calls_in_flight_and_closing_under_them(server):
    async def main():
        native = attnd.aio.Client(server.target, timeout=120, connections=2)
        rng = np.random.default_rng()
        payloads = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
                    for n in rng.integers(1, 200000, 128)]
        got = await asyncio.gather(*(native.echo(p) for p in payloads))
        assert [bytes(g) for g in got] == payloads
        # Closing while calls run: they end (answered or CANCELLED), close() returns, later
        # calls fail.
        running = [asyncio.ensure_future(native.echo(bytes(8 << 20))) for _ in range(4)]
        await asyncio.sleep(0.005)
        await native.close()
        for r in await asyncio.gather(*running, return_exceptions=True):
            assert not isinstance(r, Exception) or isinstance(r, attnd.AttndError), r
        with pytest.raises(attnd.AttndError):
            await native.echo(b"x")
    run(main())
