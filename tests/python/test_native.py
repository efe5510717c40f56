"""The blocking Client's native transport (attnd._native: the C++ client library through its C
interface): chosen where its library loads, the same answers and the same errors as grpcio's,
its settings, and a library that is missing or refuses the settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import attnd
from attnd import _core, _native
from conftest import TOLERANCE, make, reference, relative_error, values

NATIVE_REQUIRED = os.environ.get("ATTND_REQUIRE_NATIVE") == "1"


def step_inputs(rng, tokens: int, dtype: str, d: int = 64):
    """Fresh q [tokens, 4, d], k_new and v_new [tokens, 2, d] in dtype."""
    return (make(rng, (tokens, 4, d), dtype)[0], make(rng, (tokens, 2, d), dtype)[0],
            make(rng, (tokens, 2, d), dtype)[0])


@pytest.fixture(scope="module")
def pair(server):
    """A native client and a grpcio client of the same attnd."""
    if os.environ.get("ATTND_TRANSPORT", "auto") == "grpcio":
        pytest.skip("ATTND_TRANSPORT=grpcio: this run tests the grpcio transport only")
    native = attnd.Client(server.target, timeout=120)
    if native.transport != "native":
        native.close()
        if NATIVE_REQUIRED:
            pytest.fail(f"the native transport did not load: {native.transport_note}")
        pytest.skip(f"no native transport: {native.transport_note}")
    grpcio = attnd.Client(server.target, timeout=120, transport="grpcio")
    assert grpcio.transport == "grpcio" and grpcio.transport_note == "asked for"
    yield native, grpcio
    native.close()
    grpcio.close()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_attend_answers_are_the_same_bytes(pair, dtype):
    native, grpcio = pair
    rng = np.random.default_rng()
    q, q64 = make(rng, (37, 4, 64), dtype)
    k, k64 = make(rng, (53, 2, 64), dtype)
    v, v64 = make(rng, (53, 2, 64), dtype)
    a = native.attend(q, k, v, causal=True, return_lse=True)
    b = grpcio.attend(q, k, v, causal=True, return_lse=True)
    assert a.o.dtype == b.o.dtype and a.o.shape == b.o.shape
    assert a.o.tobytes() == b.o.tobytes() and a.lse.tobytes() == b.lse.tobytes()
    o64, _ = reference(q64, k64, v64, causal=True)
    assert relative_error(values(a.o, dtype), o64) <= TOLERANCE[dtype]
    payload = rng.integers(0, 256, 70000, dtype=np.uint8).tobytes()
    assert bytes(native.echo(payload)) == payload


def test_attend_sends_the_callers_arrays_as_they_lie(pair, monkeypatch):
    """On the native transport a large Attend's message goes out in its parts (the caller's
    arrays, not joined; a small one is joined, which costs less): read-only arrays (a previous
    answer), strided ones (made contiguous first) and torch CPU tensors give grpcio's bytes."""
    native, grpcio = pair
    parts_calls = []
    real = _native.NativeChannel.call_parts
    monkeypatch.setattr(_native.NativeChannel, "call_parts",
                        lambda self, *a: parts_calls.append(len(a[1])) or real(self, *a))
    rng = np.random.default_rng()
    q, _ = make(rng, (1100, 2, 64), "fp16")  # 275 KiB: above PARTS_MIN_BYTES with k and v
    k, _ = make(rng, (300, 1, 64), "fp16")
    assert q.nbytes + 2 * k.nbytes > _core.PARTS_MIN_BYTES
    first = native.attend(q, k, k)
    assert not first.o.flags.writeable  # a view of the answer
    wide, _ = make(rng, (300, 2, 64), "fp16")
    for args in [(first.o, k, k), (q, wide[:, ::2], k)]:
        assert native.attend(*args).o.tobytes() == grpcio.attend(*args).o.tobytes()
    assert len(parts_calls) == 3 and all(n >= 4 for n in parts_calls)
    small, _ = make(rng, (8, 2, 64), "fp16")
    assert native.attend(small, small, small).o.tobytes() == \
        grpcio.attend(small, small, small).o.tobytes()
    assert parts_calls[-1] == 1  # joined
    try:
        import torch
    except ImportError:
        return
    t = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, k)]
    assert native.attend(*t).o.numpy().tobytes() == grpcio.attend(q, k, k).o.tobytes()
    assert parts_calls[-1] >= 4


def test_steps_and_batch_steps_match_grpcio(pair):
    native, grpcio = pair
    rng = np.random.default_rng()
    sessions = [c.create_session(2, 2, 64, "fp16") for c in (native, grpcio, native, grpcio)]
    try:
        for t in range(6):
            q, k, v = step_inputs(rng, 9 if t == 0 else 1, "fp16")
            for layer in range(2):
                a = native.step(sessions[0], layer, q, k, v, return_lse=True)
                b = grpcio.step(sessions[1], layer, q, k, v, return_lse=True)
                assert a.o.tobytes() == b.o.tobytes() and a.lse.tobytes() == b.lse.tobytes()
                assert a.cached_tokens == b.cached_tokens
            items = [(sessions[2], 0, q, k, v), (sessions[2], 1, q, k, v)]
            c = native.batch_step(items)
            d = grpcio.batch_step([(sessions[3],) + it[1:] for it in items])
            assert [r.o.tobytes() for r in c] == [r.o.tobytes() for r in d]
            assert c[0].o.tobytes() == a.o.tobytes()  # the same cache, stepped either way
    finally:
        for s in sessions:
            s.close()


def test_the_compiled_step_is_there_where_it_was_built(pair):
    built = (Path(attnd.__file__).parent / "_fast.abi3.so").is_file()
    if os.environ.get("ATTND_REQUIRE_FAST") == "1":
        assert built, "the build made attnd._fast, but the package has none"
    if not built:
        pytest.skip("no attnd._fast in this package (Python < 3.11 or no Python.h)")
    assert _native._fast is not None, "attnd._fast is in the package but did not load"


@pytest.mark.parametrize("compiled", [True, False], ids=["attnd._fast", "python-coding"])
def test_steps_take_the_librarys_path_where_they_can(pair, monkeypatch, compiled):
    """Client.step of numpy arrays is coded and read by the library (attn_c_step, called by
    attnd._fast), without attnd._fast by the package (sent in parts); either way its options,
    lse, timing and errors are grpcio's; other steps take the Python coding."""
    native, grpcio = pair
    if compiled and _native._fast is None:
        pytest.skip("attnd._fast is not loaded")
    if not compiled:
        monkeypatch.setattr(_native, "_fast", None)
    taken = []
    real = _native.NativeChannel.step

    def counted(self, *args):
        r = real(self, *args)
        taken.append(r is not None)
        return r

    monkeypatch.setattr(_native.NativeChannel, "step", counted)
    rng = np.random.default_rng()
    a, b = native.create_session(1, 2, 128, "bf16"), grpcio.create_session(1, 2, 128, "bf16")
    try:
        for t, opts in enumerate([{}, {"return_lse": True}, {"window": (5, 0), "scale": 0.3},
                                  {"return_lse": True, "window": (-1, 0)}]):
            q, k, v = step_inputs(rng, 17 if t == 0 else 2, "bf16", d=128)
            x = native.step(a, 0, q, k, v, **opts)
            y = grpcio.step(b, 0, q, k, v, **opts)
            assert x.o.tobytes() == y.o.tobytes() and x.cached_tokens == y.cached_tokens
            assert (x.lse is None) == (y.lse is None)
            if x.lse is not None:
                assert x.lse.shape == y.lse.shape and x.lse.tobytes() == y.lse.tobytes()
            assert x.timing.total_us > 0 and x.timing.batch_requests >= 1
        assert taken == [compiled] * 4
        out = np.empty((1, 4, 128), np.uint16)  # an out array: the Python coding
        q, _ = make(rng, (1, 4, 128), "bf16")
        k, _ = make(rng, (1, 2, 128), "bf16")
        x = native.step(a, 0, q, k, k, out=out)
        assert x.o is out and out.tobytes() == grpcio.step(b, 0, q, k, k).o.tobytes()
        assert taken == [compiled] * 4
        bad = [(q[0], k, k), (q, k.astype(np.float32), k), (q, k, k[:, :1]),
               (q.astype(np.float64), k, k), (q, k, k.astype(np.int16))]
        for args in bad:  # each refused by attnd with grpcio's message; the cache unchanged
            with pytest.raises(attnd.AttndError) as e1:
                native.step(a, 0, *args)
            with pytest.raises(attnd.AttndError) as e2:
                grpcio.step(b, 0, *args)
            assert str(e1.value) == str(e2.value)
        with pytest.raises(attnd.InvalidArgument, match="layer"):
            native.step(a, 7, q, k, k)
        # A strided q (not C-contiguous) takes the Python path, which makes it contiguous.
        wide, _ = make(rng, (1, 8, 128), "bf16")
        x = native.step(a, 0, wide[:, ::2], k, k)
        assert x.o.tobytes() == grpcio.step(b, 0, np.ascontiguousarray(wide[:, ::2]), k, k).o.tobytes()
        assert native.step(a, 0, q, k, k).cached_tokens == grpcio.step(b, 0, q, k, k).cached_tokens
    finally:
        a.close()
        b.close()


def test_errors_are_the_same_as_grpcios(pair):
    native, grpcio = pair
    bad = np.zeros((4, 2, 48), np.float16)
    errors = []
    for c in pair:
        with pytest.raises(attnd.InvalidArgument) as e:
            c.attend(bad, bad, bad)
        errors.append(e.value)
        with pytest.raises(attnd.FailedPrecondition) as e:
            c.step("r0.nosuchsession", 0, bad, bad, bad)
        errors.append(e.value)
    assert str(errors[0]) == str(errors[2]) and "head_dim 48" in str(errors[0])
    assert str(errors[1]) == str(errors[3]) and "replica r0" in str(errors[1])
    # Too large for the client's own limit: refused before it is sent, by either transport.
    rng = np.random.default_rng()
    q, _ = make(rng, (2048, 4, 64), "fp32")
    for transport in ("native", "grpcio"):
        with attnd.Client(native.options.target, max_message_bytes=1 << 20,
                          transport=transport) as small:
            with pytest.raises(attnd.ResourceExhausted):
                small.attend(q, q, q)


def test_concurrent_calls_keep_to_their_own_sessions(pair):
    native, grpcio = pair
    wrong = []

    def run(seed):
        rng = np.random.default_rng(seed)
        a = native.create_session(1, 2, 64, "bf16")
        b = grpcio.create_session(1, 2, 64, "bf16")
        try:
            for t in range(12):
                q, k, v = step_inputs(rng, 5 if t == 0 else 1, "bf16")
                if native.step(a, 0, q, k, v).o.tobytes() != grpcio.step(b, 0, q, k, v).o.tobytes():
                    wrong.append((seed, t))
        finally:
            a.close()
            b.close()

    threads = [threading.Thread(target=run, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_a_closed_client_refuses_calls(server, pair):
    c = attnd.Client(server.target, transport="native")
    c.close()
    with pytest.raises(attnd.AttndError, match="closed"):
        c.echo(b"x")


def test_closing_while_calls_are_in_flight(server, pair):
    """close() from one thread while others call: their calls finish or fail with CANCELLED
    ("closed"), and nothing crashes (the library's client is freed after the last call)."""
    c = attnd.Client(server.target, transport="native")
    rng = np.random.default_rng()
    sessions = [c.create_session(1, 2, 64, "fp16") for _ in range(4)]
    outcomes, started = [], threading.Barrier(5)

    def run(session):
        started.wait()
        while True:  # until the client is closed under it
            q, k, v = step_inputs(rng, 1, "fp16")
            try:
                session.step(0, q, k, v)
                c.echo(b"x" * 5000)
                outcomes.append("ok")
            except attnd.AttndError as e:
                outcomes.append("closed" if "closed" in str(e) else repr(e))
                return

    threads = [threading.Thread(target=run, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)
    c.close()
    for t in threads:
        t.join()
    assert set(outcomes) <= {"ok", "closed"} and outcomes.count("closed") == 4, outcomes[-8:]


def test_settings_that_the_native_transport_cannot_take(server, pair, monkeypatch):
    with pytest.raises(attnd.InvalidArgument, match="transport 'carrier pigeon'"):
        attnd.Client(server.target, transport="carrier pigeon")
    options = [("grpc.primary_user_agent", "test")]
    with attnd.Client(server.target, channel_options=options) as c:
        assert c.transport == "grpcio" and "integer values only" in c.transport_note
        assert bytes(c.echo(b"still works")) == b"still works"
    with pytest.raises(attnd.InvalidArgument, match="integer values only"):
        attnd.Client(server.target, channel_options=options, transport="native")
    with pytest.raises(attnd.InvalidArgument, match="connections"):
        attnd.Client(server.target, connections=0, transport="native")
    monkeypatch.setenv("ATTND_TRANSPORT", "grpcio")
    with attnd.Client(server.target) as c:
        assert c.transport == "grpcio"
    with attnd.Client(server.target, transport="native", connections=3, wait_for_ready=True,
                      channel_options=[("grpc.http2.lookahead_bytes", 1 << 16)]) as c:
        assert c.transport == "native"
        assert bytes(c.echo(b"x" * 100)) == b"x" * 100


def _run(code: str, **env: str) -> str:
    e = dict(os.environ)
    e.update(env)
    e.pop("ATTND_TRANSPORT", None)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_missing_library_falls_back_or_is_refused(server, pair, tmp_path):
    missing = str(tmp_path / "libattn_client_c.so")
    got = _run("import attnd; c = attnd.Client(%r); print(c.transport, '|', c.transport_note); "
               "print(bytes(c.echo(b'ok')).decode())" % server.target, ATTND_NATIVE_LIB=missing)
    assert got.splitlines()[0].startswith("grpcio |") and missing in got and got.endswith("ok")
    got = _run("import attnd\ntry:\n  attnd.Client(%r, transport='native')\n"
               "except attnd.InvalidArgument as e: print('refused:', e)" % server.target,
               ATTND_NATIVE_LIB=missing)
    assert got.startswith("refused:") and missing in got
    not_a_library = tmp_path / "libnot.so"
    not_a_library.write_bytes(b"not an ELF file")
    got = _run("import attnd; c = attnd.Client(%r); print(c.transport, c.transport_note)"
               % server.target, ATTND_NATIVE_LIB=str(not_a_library))
    assert got.startswith("grpcio ") and str(not_a_library) in got


def test_the_library_is_found_next_to_the_package(pair):
    path = _native.library_path()
    assert path is not None and Path(path).is_file()


def test_fast_is_found_beside_the_library_of_a_bundle(server, tmp_path):
    """A bundle: the package without attnd._fast, the module beside $ATTND_NATIVE_LIB. It codes
    BatchSteps from import on (for grpcio too), and the native transport binds that same module."""
    if _core.FAST is None:
        pytest.skip("attnd._fast is not built here")
    package = Path(attnd.__file__).parent
    shutil.copytree(package, tmp_path / "pkg" / "attnd",
                    ignore=shutil.ignore_patterns("_fast*.so", "*.so", "__pycache__"))
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(_core.FAST.__file__, lib / "_fast.abi3.so")
    native = _native.library_path()
    code = ("import attnd, attnd._core as c, attnd._native as n\n"
            "print(c.FAST.__file__ if c.FAST else None)\n"
            "x = attnd.Client(%r, transport='grpcio'); print(bytes(x.echo(b'ok')).decode())\n"
            % server.target)
    got = _run(code, PYTHONPATH=str(tmp_path / "pkg"), ATTND_NATIVE_LIB=str(lib / "libattn_client_c.so"))
    assert got.splitlines() == [str(lib / "_fast.abi3.so"), "ok"]
    got = _run("import attnd._core as c; print(c.FAST)", PYTHONPATH=str(tmp_path / "pkg"),
               ATTND_NATIVE_LIB=str(tmp_path / "nowhere" / "libattn_client_c.so"))
    assert got == "None"  # nothing beside a library that is not there: coded in Python
    if native is not None:  # the library and the module side by side: one module, bound
        shutil.copy(native, lib / "libattn_client_c.so")
        got = _run(code + "y = attnd.Client(%r); print(y.transport, n._fast is c.FAST)\n"
                   % server.target, PYTHONPATH=str(tmp_path / "pkg"),
                   ATTND_NATIVE_LIB=str(lib / "libattn_client_c.so"))
        assert got.splitlines()[-1] == "native True", got
