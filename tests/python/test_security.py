"""TLS, mutual TLS and bearer tokens from the Python client (sync and asyncio), against an attnd
that requires all three; certificates made with openssl for the test."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import numpy as np
import pytest

import attnd
import attnd.aio
from conftest import Server

MAKE_PKI = r"""set -e
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -keyout ca.key -out ca.pem -days 2 -subj /CN=attnd-py-test-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
openssl req $ec -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext 2>/dev/null
printf 'basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n' > client.ext
openssl req $ec -keyout client.key -out client.csr -subj /CN=attnd-py-client 2>/dev/null
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 -extfile client.ext 2>/dev/null
echo 'py-test-token' > tokens.txt
"""


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    subprocess.run(["sh", "-c", MAKE_PKI], cwd=d, check=True)
    s = Server(f"--tls_cert={d}/server.pem", f"--tls_key={d}/server.key",
               f"--tls_client_ca={d}/ca.pem", f"--auth_token_file={d}/tokens.txt",
               secure_client=dict(tls_ca=d / "ca.pem", tls_cert=d / "client.pem",
                                  tls_key=d / "client.key"))
    yield s, d
    s.stop()


def test_mtls_and_token(secure):
    s, d = secure
    q = np.ones((4, 2, 64), np.float16)
    pem = (d / "ca.pem").read_bytes()  # PEM bytes and paths both work
    with attnd.Client(s.target, tls_ca=pem, tls_cert=d / "client.pem", tls_key=str(d / "client.key"),
                      token="py-test-token") as c:
        assert np.allclose(c.attend(q, q, q).o.astype(np.float32), 1.0)
        assert c.health()
    with attnd.Client(s.target, tls_ca=d / "ca.pem", tls_cert=d / "client.pem",
                      tls_key=d / "client.key") as c:
        with pytest.raises(attnd.Unauthenticated):
            c.attend(q, q, q)
        assert c.health()  # health needs no token
    with attnd.Client(s.target, tls_ca=d / "ca.pem", tls_cert=d / "client.pem",
                      tls_key=d / "client.key", token="wrong") as c:
        with pytest.raises(attnd.Unauthenticated):
            c.info()
    # No client certificate: the handshake fails (UNAVAILABLE, not retried into success).
    with attnd.Client(s.target, tls_ca=d / "ca.pem", token="py-test-token", retries=0) as c:
        with pytest.raises(attnd.Unavailable):
            c.info(timeout=5)

    async def run_async():
        async with attnd.aio.Client(s.target, tls_ca=d / "ca.pem", tls_cert=d / "client.pem",
                                    tls_key=d / "client.key", token="py-test-token") as c:
            return await asyncio.gather(*(c.attend(q, q, q) for _ in range(8)))
    for r in asyncio.run(run_async()):
        assert np.allclose(r.o.astype(np.float32), 1.0)


def test_missing_certificate_file_is_a_clear_error(secure):
    s, d = secure
    with pytest.raises(attnd.InvalidArgument, match="tls_ca: cannot read"):
        attnd.Client(s.target, tls_ca=d / "no-such.pem")
