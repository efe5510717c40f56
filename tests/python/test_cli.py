"""python3 -m attnd info | health | attend --check | session --check, and the package installed
with pip (its descriptors generated at build time) working from outside the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnd

from conftest import ROOT


def attnd_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    env = env or dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-m", "attnd", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_info_and_health(server):
    r = attnd_cli("--target", server.target, "info")
    assert r.returncode == 0, r.stderr
    assert 'backend: "cpu"' in r.stdout or 'backend: "cuda"' in r.stdout
    assert "replica_id" in r.stdout
    assert "# client transport: native" in r.stdout or "# client transport: grpcio" in r.stdout
    r = attnd_cli("--target", server.target, "--transport", "grpcio", "info")
    assert r.returncode == 0 and "# client transport: grpcio (asked for)" in r.stdout
    r = attnd_cli("--target", server.target, "health")
    assert r.returncode == 0 and r.stdout.strip() == "SERVING"


def test_health_of_nothing_fails():
    r = attnd_cli("--target", "127.0.0.1:1", "--timeout", "2", "health")
    assert r.returncode == 2 and "UNAVAILABLE" in r.stderr


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_attend_check_passes(server, dtype):
    r = attnd_cli("--target", server.target, "attend", "--check", "--causal", "--dtype", dtype,
                  "--seq", "70", "--count", "2", "--head-dim", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout


@pytest.mark.parametrize("flags", [["--dtype", "fp8", "--o-dtype", "fp16"],
                                   ["--dtype", "fp8"], ["--dtype", "bf16", "--kv-dtype", "fp8"],
                                   ["--dtype", "fp32", "--kv-dtype", "fp8"]],
                         ids=["all-fp8-o-fp16", "all-fp8-o-bf16", "fp8-kv-bf16-q", "fp8-kv-fp32-q"])
def test_attend_check_passes_with_fp8(server, flags):
    r = attnd_cli("--target", server.target, "attend", "--check", "--causal", *flags,
                  "--seq", "40", "--count", "2", "--head-dim", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout
    # The check is not vacuous: the same answers fail a tolerance below their rounding.
    r = attnd_cli("--target", server.target, "attend", "--check", *flags, "--seq", "40",
                  "--count", "1", "--head-dim", "64", "--check-tolerance", "1e-9")
    assert r.returncode == 3 and "check: FAIL" in r.stdout, r.stdout + r.stderr


def test_quantize_e4m3_rounds_to_the_nearest_code():
    from attnd import _reference
    table = _reference.e4m3_values()
    codes = np.arange(127)  # every finite non-negative code
    got, values = _reference.quantize_e4m3(table[codes], 1.0)
    assert (got == codes).all() and np.array_equal(values, table[codes])
    mid = (table[codes[:-1]] + table[codes[1:]]) / 2  # ties go to the even code
    got, _ = _reference.quantize_e4m3(-mid, 1.0)
    assert (got == np.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:]) | 0x80).all()
    got, values = _reference.quantize_e4m3(np.array([1e6, -1e6, 0.3]), 2.0)
    assert list(got[:2]) == [0x7E, 0xFE] and values[2] == table[got[2]] * 2.0


def test_attend_check_fails_with_exit_3_when_out_of_tolerance(server):
    r = attnd_cli("--target", server.target, "attend", "--check", "--dtype", "bf16", "--seq", "40",
                  "--count", "1", "--check-tolerance", "1e-9")
    assert r.returncode == 3 and "check: FAIL" in r.stdout


def test_session_check_passes(server):
    r = attnd_cli("--target", server.target, "session", "--check", "--heads", "4", "--kv-heads",
                  "2", "--head-dim", "64", "--prefill", "50", "--decode", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout and "forked" in r.stdout


def test_pip_install_builds_the_descriptors(server, tmp_path):
    target = tmp_path / "site"
    # With the native transport's library when this run has one (the build tree's package).
    native = Path(attnd.__file__).parent / "libattn_client_c.so"
    pip_env = dict(os.environ)
    pip_env.pop("ATTND_NATIVE_LIB", None)
    if native.is_file():
        pip_env["ATTND_NATIVE_LIB"] = str(native)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--no-cache-dir", "--target", str(target),
                        str(ROOT / "client" / "python")], capture_output=True, text=True,
                       timeout=300, env=pip_env)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip is not installed (Debian: python3-pip)")
    assert r.returncode == 0, r.stderr
    assert (target / "attnd" / "_proto" / "_descriptor_set.py").is_file()
    env = dict(os.environ, PYTHONPATH=str(target), ATTND_PROTO_DIR="/nonexistent")
    env.pop("ATTND_NATIVE_LIB", None)
    env.pop("ATTND_TRANSPORT", None)
    r = subprocess.run([sys.executable, "-c", "import attnd, sys; c = attnd.Client(sys.argv[1]); "
                        "print(attnd.__file__, c.transport, bytes(c.echo(b'e')), c.health())",
                        server.target],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert str(target) in r.stdout and r.stdout.strip().endswith("True")
    assert (" native " in r.stdout) == native.is_file(), r.stdout
    # With the library, the compiled decode step is built too where this build made one.
    fast = (Path(attnd.__file__).parent / "_fast.abi3.so").is_file()
    assert (target / "attnd" / "_fast.abi3.so").is_file() == (fast and native.is_file())
    # No module of the package shadows grpc: the real grpc is still the one imported.
    r = subprocess.run([sys.executable, "-c", "import attnd, grpc; print(grpc.__file__)"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and str(target) not in r.stdout
    assert not (target / "grpc").exists() and not (target / "attn").exists()


def test_session_refuses_fp8_as_the_steps_dtype(server):
    r = attnd_cli("--target", server.target, "session", "--dtype", "fp8")
    assert r.returncode == 64 and "--dtype is the steps' q and o type" in r.stderr
