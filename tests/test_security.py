"""Shared-secret token, TLS and mutual TLS: the wrong callers are refused, the right ones work."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.coordinator import Coordinator

SECRET = "s3cr3t-token-value"


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def issue(cwd, name, ca, *, san=None):
    """A key and a certificate for ``name`` signed by ``ca`` (files NAME.key / NAME.pem)."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", f"/CN={name}",
            "-out", f"{name}.csr", cwd=cwd)
    ext = cwd / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", f"{name}.pem", cwd=cwd)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a rogue CA's client."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "1", "-subj", f"/CN={ca}", cwd=d)
    issue(d, "server", "ca", san="IP:127.0.0.1,DNS:localhost")
    issue(d, "client", "ca")
    issue(d, "rogue", "rogue-ca")
    return d


def client_for(address, **settings):
    return pr.Client(pr.Settings(address=address, connect_timeout=1.0, **settings), pr.detect_topology({}, address=address))


def outcome(client):
    try:
        client.set("k", b"v")
        return "ok" if client.get("k") == b"v" else "wrong"
    except pr.RendezvousError as exc:
        return type(exc).__name__
    finally:
        client.close()


def test_token_is_required_and_compared(caplog):
    """No token or a wrong one is UNAUTHENTICATED (logged without the secret); the right one works."""
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.coordinator")
    with Coordinator(port=0, token=SECRET) as c:
        assert outcome(client_for(c.address)) == "AuthenticationError"
        assert outcome(client_for(c.address, token="guess-xyz")) == "AuthenticationError"
        assert outcome(client_for(c.address, token=SECRET)) == "ok"
        with grpc.insecure_channel(c.address) as channel:  # probes need no token
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any("no token" in m for m in refusals) and any("a wrong token" in m for m in refusals)
    assert not any(SECRET in r.getMessage() or "guess-xyz" in r.getMessage() for r in caplog.records)


def test_token_error_message_says_how_to_fix():
    """The refusal names the variables that carry the token."""
    with Coordinator(port=0, token=SECRET) as c:
        client = client_for(c.address)
        with pytest.raises(pr.AuthenticationError, match="PJRT_RENDEZVOUS_TOKEN"):
            client.count()
        client.close()


def test_token_from_file_and_environment(tmp_path):
    """PJRT_RENDEZVOUS_TOKEN_FILE supplies the token; a token file the server reads works end to end."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    with Coordinator(port=0, token=SECRET) as c:
        settings = pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN_FILE": str(token_file)}, address=c.address)
        assert "s3cr3t" not in repr(settings)
        assert outcome(pr.Client(settings, pr.detect_topology({}, address=c.address))) == "ok"


def test_a_token_and_a_token_file_that_disagree_are_refused_by_serve_and_clients(tmp_path):
    """Both variables set with different tokens (an old PJRT_RENDEZVOUS_TOKEN left beside a
    new token file): serve and the clients refuse alike, instead of each picking another one;
    the same token in both is fine, an argument wins over a variable, and two arguments that
    disagree are refused too."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    both = {"PJRT_RENDEZVOUS_TOKEN": "old", "PJRT_RENDEZVOUS_TOKEN_FILE": str(token_file)}
    with pytest.raises(pr.UsageError, match="PJRT_RENDEZVOUS_TOKEN and PJRT_RENDEZVOUS_TOKEN_FILE are both set"):
        pr.Settings.resolve(both, address="127.0.0.1:1")
    assert pr.Settings.resolve({**both, "PJRT_RENDEZVOUS_TOKEN": SECRET}, address="127.0.0.1:1").token == SECRET
    assert pr.Settings.resolve(both, address="127.0.0.1:1", token="given").token == "given"
    assert pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN": "old"}, address="127.0.0.1:1", token_file=str(token_file)).token == SECRET
    with pytest.raises(pr.UsageError, match=r"init\(token=\) and init\(token_file=\) are both set"):
        pr.Settings.resolve({}, address="127.0.0.1:1", token="old", token_file=str(token_file))
    assert pr.Settings.resolve({}, address="127.0.0.1:1", token=SECRET, token_file=str(token_file)).token == SECRET
    # None is no argument (argparse defaults passed along): the other one counts.
    assert pr.Settings.resolve({}, address="127.0.0.1:1", token=None, token_file=str(token_file)).token == SECRET
    assert pr.Settings.resolve(both, address="127.0.0.1:1", token="given", token_file=None).token == "given"
    out = subprocess.run(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0"],
        env={**os.environ, **both}, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1 and "PJRT_RENDEZVOUS_TOKEN and the token file (--token-file) are both set" in out.stderr


def test_tls_server_refuses_plaintext_and_accepts_its_ca(pki):
    """Against a TLS server a plaintext client fails; a client trusting the CA works."""
    cert, key = (pki / "server.pem").read_bytes(), (pki / "server.key").read_bytes()
    with Coordinator(port=0, tls_cert=cert, tls_key=key) as c:
        assert c.session_port is None  # plain TCP: not next to TLS
        assert outcome(client_for(c.address)) == "CoordinatorUnavailableError"
        assert outcome(client_for(c.address, tls_ca=str(pki / "ca.pem"))) == "ok"
        assert outcome(client_for(c.address, tls_ca=str(pki / "rogue-ca.pem"))) == "CoordinatorUnavailableError"


def test_mutual_tls_needs_a_client_certificate_from_the_ca(pki):
    """With --tls-ca the server refuses clients without a certificate or with one from another CA."""
    cert, key, ca = (pki / "server.pem").read_bytes(), (pki / "server.key").read_bytes(), (pki / "ca.pem").read_bytes()
    with Coordinator(port=0, tls_cert=cert, tls_key=key, tls_ca=ca, token=SECRET) as c:
        common = dict(tls_ca=str(pki / "ca.pem"), token=SECRET)
        assert outcome(client_for(c.address, **common)) == "CoordinatorUnavailableError"
        rogue = dict(tls_cert=str(pki / "rogue.pem"), tls_key=str(pki / "rogue.key"))
        assert outcome(client_for(c.address, **common, **rogue)) == "CoordinatorUnavailableError"
        good = dict(tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"))
        assert outcome(client_for(c.address, **common, **good)) == "ok"
        assert outcome(client_for(c.address, tls_ca=str(pki / "ca.pem"), **good)) == "AuthenticationError"


def test_serve_cli_with_token_file_and_tls(pki, tmp_path):
    """`serve --token-file --tls-cert --tls-key --tls-ca` starts, and `status` with the client variables reads it."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET)
    server = subprocess.Popen(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0", "--world-size", "2",
         "--token-file", str(token_file), "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
         "--tls-ca", str(pki / "ca.pem")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        port = re.search(r":(\d+)$", server.stdout.readline().strip()).group(1)
        env = {
            "PATH": "/usr/bin:/bin",
            "PJRT_RENDEZVOUS_TOKEN_FILE": str(token_file),
            "PJRT_RENDEZVOUS_TLS_CA": str(pki / "ca.pem"),
            "PJRT_RENDEZVOUS_TLS_CERT": str(pki / "client.pem"),
            "PJRT_RENDEZVOUS_TLS_KEY": str(pki / "client.key"),
        }
        status = subprocess.run(
            [sys.executable, "-m", "pjrt_rendezvous.coordinator", "status", "--address", f"127.0.0.1:{port}"],
            env=env, capture_output=True, text=True, timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert "0/2 ordinals registered" in status.stdout
    finally:
        server.terminate()
        server.wait(10)
