"""Every bad-input path raises the right exception, carrying the gRPC code and attnd's message (which
names the field); a good call still works after each. Also limits, deadlines, retries of
UNAVAILABLE (only for calls that change nothing), and errors made in the client itself."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

import attnd
from attnd import _proto
from conftest import TOLERANCE, Server, make, reference, relative_error, values


def f16(*shape):
    return np.zeros(shape, np.float16)


def check_still_serving(client):
    rng = np.random.default_rng(11)
    q, q64 = make(rng, (9, 2, 64), "fp16")
    r = client.attend(q, q, q, causal=True)
    assert relative_error(values(r.o, "fp16"), reference(q64, q64, q64, causal=True)[0]) <= \
        TOLERANCE["fp16"]


ATTEND_CASES = [
    ("q-2d", lambda: (f16(4, 64), f16(4, 2, 64), f16(4, 2, 64)), {},
     "q.shape must have 3 dimensions"),
    ("k-head-dim", lambda: (f16(4, 2, 64), f16(4, 2, 32), f16(4, 2, 32)), {},
     "k.shape[2] (head_dim) must equal q.shape[2]"),
    ("unsupported-head-dim", lambda: (f16(4, 2, 48), f16(4, 2, 48), f16(4, 2, 48)), {},
     "head_dim 48 (q.shape[2]) is not supported"),
    ("dtype-mismatch", lambda: (f16(4, 2, 64), np.zeros((4, 2, 64), np.float32), f16(4, 2, 64)), {},
     "k.dtype and v.dtype must equal q.dtype"),
    ("heads-not-multiple", lambda: (f16(4, 6, 64), f16(4, 4, 64), f16(4, 4, 64)), {},
     "num_heads (q.shape[1] = 6) must be a multiple of num_kv_heads"),
    ("cu-seqlens-end", lambda: (f16(4, 2, 64), f16(4, 2, 64), f16(4, 2, 64)),
     {"cu_seqlens_q": [0, 3], "cu_seqlens_k": [0, 4]}, "cu_seqlens_q must end at the token count 4"),
    ("cu-seqlens-alone", lambda: (f16(4, 2, 64), f16(4, 2, 64), f16(4, 2, 64)),
     {"cu_seqlens_q": [0, 4]}, "cu_seqlens_q and cu_seqlens_k must be given together"),
    ("cu-seqlens-decreasing", lambda: (f16(4, 2, 64), f16(4, 2, 64), f16(4, 2, 64)),
     {"cu_seqlens_q": [0, 3, 2, 4], "cu_seqlens_k": [0, 1, 2, 4]},
     "cu_seqlens_q must not decrease"),
    ("v-shape", lambda: (f16(4, 2, 64), f16(4, 2, 64), f16(5, 2, 64)), {},
     "v.shape must equal k.shape"),
    ("empty-q", lambda: (f16(0, 2, 64), f16(4, 2, 64), f16(4, 2, 64)), {},
     "q.shape[0] must be > 0"),
    ("window", lambda: (f16(4, 2, 64), f16(4, 2, 64), f16(4, 2, 64)), {"window": (-5, 2)},
     "window.left and window.right must be >= -1"),
]


@pytest.mark.parametrize("case", ATTEND_CASES, ids=[c[0] for c in ATTEND_CASES])
def test_bad_attend_raises_invalid_argument_naming_the_field(client, case):
    _, tensors, opts, message = case
    with pytest.raises(attnd.InvalidArgument) as e:
        client.attend(*tensors(), **opts)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.message
    assert isinstance(e.value, ValueError)  # InvalidArgument is a ValueError too
    check_still_serving(client)


def test_bad_sessions(client):
    cases = [
        (lambda: client.create_session(0, 2, 64), attnd.InvalidArgument,
         "num_layers must be in [1, 1024], got 0"),
        (lambda: client.create_session(1, 2, 64, "fp32"), attnd.InvalidArgument,
         "dtype must be DTYPE_FLOAT16 or DTYPE_BFLOAT16"),
        (lambda: client.create_session(1, 2, 48), attnd.InvalidArgument,
         "head_dim 48 is not supported"),
    ]
    replica = client.info().replica_id
    unknown = replica + "." + "0" * 32
    step_args = (0, f16(1, 2, 64), f16(1, 2, 64), f16(1, 2, 64))
    cases += [
        (lambda: client.step(unknown, *step_args), attnd.NotFound, f"no session {unknown}"),
        (lambda: client.step("rdeadbeef." + "0" * 32, *step_args), attnd.FailedPrecondition,
         f"belongs to replica rdeadbeef, but this is replica {replica}"),
        (lambda: client.truncate_session(unknown, 1), attnd.NotFound, f"no session {unknown}"),
        (lambda: client.fork_session(unknown), attnd.NotFound, f"no session {unknown}"),
    ]
    s = client.create_session(2, 2, 64, "fp16")
    cases += [
        (lambda: s.step(2, f16(1, 4, 64), f16(1, 2, 64), f16(1, 2, 64)), attnd.InvalidArgument,
         f"layer 2 is out of range: session {s.id} has 2 layers"),
        (lambda: s.step(0, *(np.zeros((1, h, 64), np.uint16) for h in (4, 2, 2))),
         attnd.InvalidArgument, "q.dtype must be the session's dtype DTYPE_FLOAT16"),
        (lambda: s.step(0, f16(1, 4, 64), f16(1, 4, 64), f16(1, 4, 64)), attnd.InvalidArgument,
         "k_new.shape[1] (num_kv_heads) must be the session's 2, got 4"),
        (lambda: s.step(0, f16(2, 4, 64), f16(1, 2, 64), f16(1, 2, 64)), attnd.InvalidArgument,
         "k_new.shape[0] (new tokens) must equal q.shape[0] = 2"),
        (lambda: s.truncate(5), attnd.InvalidArgument,
         "tokens (5) is more than layer 0 of session"),
        (lambda: s.truncate(-1), attnd.InvalidArgument, "tokens must be >= 0"),
    ]
    for call, cls, message in cases:
        with pytest.raises(cls) as e:
            call()
        assert message in e.value.message, e.value.message
        assert e.value.code == cls.code
    # A failed step changed nothing: the cache is still empty, and a good step sees only itself.
    rng = np.random.default_rng(12)
    q, q64 = make(rng, (3, 4, 64), "fp16")
    k, k64 = make(rng, (3, 2, 64), "fp16")
    r = s.step(1, q, k, k)
    assert r.cached_tokens == 3
    assert relative_error(values(r.o, "fp16"), reference(q64, k64, k64, causal=True)[0]) <= \
        TOLERANCE["fp16"]
    s.close()
    with pytest.raises(attnd.NotFound, match=f"session {s.id} was closed"):
        client.close_session(s.id)
    with pytest.raises(attnd.NotFound, match="was closed"):
        s.step(0, q, k, k)
    assert s.close() == 0  # closing a closed Session object again is a no-op
    check_still_serving(client)


def test_errors_made_in_the_client(client):
    with pytest.raises(attnd.InvalidArgument, match="q: dtype int32 is not supported"):
        client.attend(np.zeros((2, 2, 64), np.int32), f16(2, 2, 64), f16(2, 2, 64))
    with pytest.raises(TypeError, match="k: expected a numpy array or a torch tensor"):
        client.attend(f16(2, 2, 64), [[0.0]], f16(2, 2, 64))
    with pytest.raises(attnd.InvalidArgument, match="window must be"):
        client.attend(f16(2, 2, 64), f16(2, 2, 64), f16(2, 2, 64), window=(1,))
    with pytest.raises(attnd.InvalidArgument, match="unknown dtype"):
        client.create_session(1, 1, 64, "int8")
    with pytest.raises(attnd.InvalidArgument, match="depth must be >= 1"):
        list(client.attend_stream([], depth=0))
    with pytest.raises(attnd.InvalidArgument, match="tls_cert and tls_key must be given together"):
        attnd.Client("127.0.0.1:1", tls_cert=b"x")
    with pytest.raises(attnd.InvalidArgument, match="connections must be >= 1"):
        attnd.Client("127.0.0.1:1", connections=0)
    with pytest.raises(attnd.InvalidArgument, match="lb_policy"):
        attnd.Client("127.0.0.1:1", lb_policy="Round Robin")
    out = np.zeros((4, 2, 64), np.float16)[:, :1]
    with pytest.raises(attnd.InvalidArgument, match="out must be contiguous"):
        client.attend(f16(4, 1, 64), f16(4, 1, 64), f16(4, 1, 64), out=out)


@pytest.fixture(scope="module")
def small_server():
    s = Server("--max_tensor_elements=20000", "--max_message_bytes=300000", "--max_sessions=2",
               "--max_session_tokens=64")
    yield s
    s.stop()


def test_limits_raise_resource_exhausted(small_server):
    with attnd.Client(small_server.target) as c:
        with pytest.raises(attnd.ResourceExhausted, match=r"q has more than max_tensor_elements \(20000\)") as e:
            c.attend(f16(200, 2, 64), f16(200, 2, 64), f16(200, 2, 64))  # 25600 elements
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        big = np.zeros(400_000, np.uint8)
        with pytest.raises(attnd.ResourceExhausted, match=r"Received message larger than max \(400004 vs. 300000\)"):
            c.echo(big)
        sessions = [c.create_session(1, 2, 64, "fp16") for _ in range(2)]
        with pytest.raises(attnd.ResourceExhausted, match=r"has 2 open sessions, its limit \(--max_sessions 2\)"):
            c.create_session(1, 2, 64, "fp16")
        with pytest.raises(attnd.InvalidArgument, match=r"max_tokens must be in \[0, 64\]"):
            c.create_session(1, 2, 64, "fp16", max_tokens=65)
        s = sessions[0]
        s.step(0, f16(60, 2, 64), f16(60, 2, 64), f16(60, 2, 64))
        with pytest.raises(attnd.ResourceExhausted, match="64"):
            s.step(0, f16(5, 2, 64), f16(5, 2, 64), f16(5, 2, 64))
        for x in sessions:
            x.close()
        # Without --allow_shared_memory the region calls are refused.
        with pytest.raises(attnd.FailedPrecondition, match="allow_shared_memory"):
            c.list_regions()
        check_still_serving(c)


def test_deadline_and_unavailable(client):
    rng = np.random.default_rng(13)
    q, _ = make(rng, (2048, 8, 128), "fp32")
    with pytest.raises(attnd.DeadlineExceeded) as e:
        client.attend(q, q, q, timeout=0.001)
    assert isinstance(e.value, TimeoutError)
    start = time.monotonic()
    with attnd.Client("127.0.0.1:1", retries=2, retry_backoff=0.01) as dead:
        with pytest.raises(attnd.Unavailable) as e:
            dead.info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and isinstance(e.value, ConnectionError)
    assert time.monotonic() - start < 5
    check_still_serving(client)


class _FlakyAttention:
    """A fake attn.v1 server: Attend answers UNAVAILABLE `failures` times, then a real answer;
    Step always UNAVAILABLE; both count their calls. Attend can also be made to sleep."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = {"Attend": 0, "Step": 0}
        self.sleep = 0.0
        self.lock = threading.Lock()

    def attend(self, request: bytes, context):
        with self.lock:
            self.calls["Attend"] += 1
            n = self.calls["Attend"]
        if self.sleep:
            time.sleep(self.sleep)
        if n <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        req = _proto.AttendRequest.FromString(request)
        resp = _proto.AttendResponse()
        resp.o.CopyFrom(req.q)  # o = q, enough for the client to read
        return resp.SerializeToString()

    def step(self, request: bytes, context):
        with self.lock:
            self.calls["Step"] += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    def handler(self):
        methods = {
            "Attend": grpc.unary_unary_rpc_method_handler(self.attend),
            "Step": grpc.unary_unary_rpc_method_handler(self.step),
        }
        return grpc.method_handlers_generic_handler("attn.v1.Attention", methods)


def test_unavailable_is_retried_only_for_calls_that_change_nothing():
    from concurrent import futures

    fake = _FlakyAttention(failures=2)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((fake.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        q = np.arange(2 * 2 * 64, dtype=np.float32).reshape(2, 2, 64)
        with attnd.Client(f"127.0.0.1:{port}", retries=3, retry_backoff=0.01) as c:
            r = c.attend(q, q, q)
            assert np.array_equal(r.o, q) and fake.calls["Attend"] == 3
            with pytest.raises(attnd.Unavailable, match="draining"):
                c.step("r1.x", 0, q, q, q)
            assert fake.calls["Step"] == 1  # a step appends: never resent
        fake.calls["Attend"], fake.failures = 0, 10
        with attnd.Client(f"127.0.0.1:{port}", retries=2, retry_backoff=0.01) as c:
            with pytest.raises(attnd.Unavailable):
                c.attend(q, q, q)
            assert fake.calls["Attend"] == 3  # the first try and two retries
        fake.calls["Attend"], fake.failures, fake.sleep = 0, 0, 2.0
        with attnd.Client(f"127.0.0.1:{port}") as c:
            start = time.monotonic()
            with pytest.raises(attnd.DeadlineExceeded):
                c.attend(q, q, q, timeout=0.2)
            assert time.monotonic() - start < 1.5
    finally:
        server.stop(0)


def test_errors_pickle_with_their_code():
    import pickle

    e = pickle.loads(pickle.dumps(attnd.errors.error_for(grpc.StatusCode.NOT_FOUND, "gone")))
    assert isinstance(e, attnd.NotFound) and e.message == "gone" and str(e) == "NOT_FOUND: gone"
