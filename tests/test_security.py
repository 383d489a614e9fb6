"""Shared-secret token, TLS and mutual TLS: the wrong callers are refused, the right ones work."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_cli import Serve
from test_fanin import make_clients, run_threads

import pjrt_rendezvous.client as pr
from pjrt_rendezvous.client._session import SocketSession
from pjrt_rendezvous.coordinator import Coordinator, Limits
from pjrt_rendezvous.coordinator._server import max_message_bytes
from pjrt_rendezvous.protos.v1 import coordinator_pb2 as pb
from pjrt_rendezvous.protos.v1 import coordinator_pb2_grpc as pb_grpc

SECRET = "s3cr3t-token-value"


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def issue(cwd, name, ca, *, san=None, days=1):
    """A key and a certificate for ``name`` signed by ``ca`` (files NAME.key / NAME.pem),
    valid for ``days`` (0: it expires at once)."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", f"/CN={name}",
            "-out", f"{name}.csr", cwd=cwd)
    ext = cwd / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", str(days), "-extfile", str(ext), "-out", f"{name}.pem", cwd=cwd)


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
            with pytest.raises(grpc.RpcError) as refused:  # a stream held open (memory) does
                next(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any("no token" in m for m in refusals) and any("a wrong token" in m for m in refusals)
    assert not any(SECRET in r.getMessage() or "guess-xyz" in r.getMessage() for r in caplog.records)


def test_refusals_are_logged_at_most_once_a_minute_each(caplog, monkeypatch):
    """Anyone who reaches the port may call without the token as often as they like: each
    reason is logged once per LOGGED_EVERY, the next line counting those not logged (every
    refusal was a line: a flood of calls filled the log)."""
    from pjrt_rendezvous.coordinator import _server

    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.coordinator")
    with Coordinator(port=0, token=SECRET) as c:
        for _ in range(4):
            assert outcome(client_for(c.address)) == "AuthenticationError"
        assert outcome(client_for(c.address, token="guess-xyz")) == "AuthenticationError"
        lines = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "refused"]  # (not a client's)
        assert [("no token" in m, "a wrong token" in m) for m in lines] == [(True, False), (False, True)], lines
        monkeypatch.setattr(_server._Token, "LOGGED_EVERY", 0.0)  # (as if a minute had passed)
        assert outcome(client_for(c.address)) == "AuthenticationError"
    again = [r.getMessage() for r in caplog.records if "no token" in r.getMessage()][-1]
    assert re.search(r"\(\d+ more such refusals since the last line, not logged\)", again), again


def test_token_error_message_says_how_to_fix(tmp_path):
    """The refusal names the variables that carry the token, and a wrong token's where this
    client's came from (a file, a variable, an argument)."""
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token\n")
    with Coordinator(port=0, token=SECRET) as c:
        client = client_for(c.address)
        with pytest.raises(pr.AuthenticationError, match="PJRT_RENDEZVOUS_TOKEN"):
            client.count()
        client.close()
        for env, given, source in (
            ({"PJRT_RENDEZVOUS_TOKEN_FILE": str(wrong)}, {}, f"the file {wrong} (PJRT_RENDEZVOUS_TOKEN_FILE)"),
            ({"PJRT_RENDEZVOUS_TOKEN": "other"}, {}, "PJRT_RENDEZVOUS_TOKEN"),
            ({}, {"token": "another"}, "init(token=)"),
        ):
            client = pr.Client(pr.Settings.resolve(env, address=c.address, connect_timeout=1.0, **given), pr.detect_topology({}, address=c.address))
            with pytest.raises(pr.AuthenticationError, match=re.escape(f"a wrong token; set PJRT_RENDEZVOUS_TOKEN or PJRT_RENDEZVOUS_TOKEN_FILE (this client's token came from {source})")):
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


def test_a_secret_file_open_to_other_users_is_taken_with_a_warning(tmp_path, caplog, pki):
    """As ssh and libpq warn of such secrets: mode 0644 is named with the chmod to run; 0600
    says nothing. serve logs the same warning, as the coordinator. So for a TLS key (it was
    taken without a word, by clients and serve)."""
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    token_file.chmod(0o644)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    assert pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN_FILE": str(token_file)}, address="127.0.0.1:1").token == SECRET
    (warning,) = [r.getMessage() for r in caplog.records if "token file" in r.getMessage()]
    assert "is open to other users (mode 644)" in warning and f"chmod 600 {token_file}" in warning
    from test_cli import Serve

    key = tmp_path / "server.key"
    key.write_bytes((pki / "server.key").read_bytes())
    key.chmod(0o644)
    with Serve("--token-file", str(token_file), "--tls-cert", str(pki / "server.pem"), "--tls-key", str(key), "--log-format", "json") as server:
        for what, option in (("token file", "--token-file"), ("TLS key", "--tls-key")):
            line = server.wait_for_line(rf"the {what} \S+ \({option}\) is open to other users \(mode 644\)")
            assert '"logger": "pjrt_rendezvous.coordinator"' in line, line
        assert server.stop() == 0
    caplog.clear()
    pr.Client(
        pr.Settings.resolve({}, address="127.0.0.1:1", tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "server.pem"), tls_key=str(key)),
        pr.detect_topology({}),
    ).close()
    (warning,) = [r.getMessage() for r in caplog.records if "TLS key" in r.getMessage()]
    assert f"the TLS key {key} (tls_key, PJRT_RENDEZVOUS_TLS_KEY) is open to other users (mode 644): `chmod 600 {key}`" == warning
    token_file.chmod(0o600)
    caplog.clear()
    assert pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN_FILE": str(token_file)}, address="127.0.0.1:1").token == SECRET
    assert not [r for r in caplog.records if "token file" in r.getMessage()]


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
    assert out.returncode == 2 and "PJRT_RENDEZVOUS_TOKEN and the token file (PJRT_RENDEZVOUS_TOKEN_FILE) are both set" in out.stderr


def test_a_token_grpc_cannot_carry_is_refused_where_it_is_read(tmp_path):
    """A token with a line break inside (a wrapped `openssl rand -base64 64` in a file), a tab
    or a non-ASCII character was taken, then every call failed as "Invalid metadata"; a token
    file that is not text raised a bare UnicodeDecodeError. Each is a UsageError naming
    where the token came from, never the token."""
    wrapped = tmp_path / "wrapped"
    wrapped.write_text("abcdefgh\nijklmnop\n")
    binary = tmp_path / "binary"
    binary.write_bytes(b"ab\x88\x00cd")
    with pytest.raises(pr.UsageError, match=rf"the file {wrapped} \(PJRT_RENDEZVOUS_TOKEN_FILE\) holds character 0xa at position 8 \(a line break: the token must be the only line, no comment line\)") as caught:
        pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN_FILE": str(wrapped)}, address="127.0.0.1:1")
    assert "ijkl" not in str(caught.value)
    with pytest.raises(pr.UsageError, match=r"character 0x9 at position 3"):
        pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN": "abc\tdef"}, address="127.0.0.1:1")
    with pytest.raises(pr.UsageError, match=r"character 0xe9"):
        pr.Settings(address="127.0.0.1:1", token="caf\u00e9")
    with pytest.raises(pr.UsageError, match=rf"token file {binary} \(PJRT_RENDEZVOUS_TOKEN_FILE\) is not ASCII text"):
        pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN_FILE": str(binary)}, address="127.0.0.1:1")
    assert pr.Settings(address="127.0.0.1:1", token="with inner space").token == "with inner space"
    # Stripped as from the variable or a file (init(token=' x') was refused by a coordinator given ' x').
    assert pr.Settings(address="127.0.0.1:1", token=" x\n").token == "x"
    # Past what a gRPC header carries: every call failed, "metadata size exceeds hard limit".
    huge = tmp_path / "huge"
    huge.write_text("a" * 133_343)
    with pytest.raises(pr.UsageError, match=rf"the token from the file {huge} \(PJRT_RENDEZVOUS_TOKEN_FILE\) is 133343 characters, over the 4096"):
        pr.Settings.resolve({"PJRT_RENDEZVOUS_TOKEN_FILE": str(huge)}, address="127.0.0.1:1")
    served = subprocess.run(
        [sys.executable, "-m", "pjrt_rendezvous.coordinator", "serve", "--port", "0", "--token-file", str(huge)],
        capture_output=True, text=True, timeout=60,
    )
    assert served.returncode == 2 and "is 133343 characters, over the 4096" in served.stderr, served


def test_tls_files_without_pem_are_refused_when_the_client_is_made(pki, tmp_path, caplog):
    """A TLS file that holds no PEM certificate or key is refused naming it and its variable,
    when the client is made (gRPC took it, then every handshake failed and the client retried
    an 'unavailable' coordinator for its connect timeout)."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(pr.UsageError, match=rf"TLS file {junk} \(tls_ca, PJRT_RENDEZVOUS_TLS_CA\) holds no PEM certificate"):
        client_for("127.0.0.1:1", tls_ca=str(junk))
    with pytest.raises(pr.UsageError, match=r"\(tls_key, PJRT_RENDEZVOUS_TLS_KEY\) holds no PEM private key"):
        client_for("127.0.0.1:1", tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.pem"))
    # Another certificate's key: every handshake failed ("Failed to create security handshaker"),
    # and the client retried an unreachable coordinator for its connect timeout.
    with pytest.raises(pr.UsageError, match=rf"the TLS key {pki / 'rogue.key'} \(tls_key, PJRT_RENDEZVOUS_TLS_KEY\) is not an unencrypted "
                       rf"private key of the certificate {pki / 'client.pem'} \(tls_cert, PJRT_RENDEZVOUS_TLS_CERT\): KEY_VALUES_MISMATCH"):
        client_for("127.0.0.1:1", tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"), tls_key=str(pki / "rogue.key"))
    # A pair gRPC (BoringSSL) takes, which the system OpenSSL's security level refuses
    # ("EE_KEY_TOO_SMALL"): taken, by clients and serve alike.
    openssl("req", "-x509", "-newkey", "rsa:1024", "-nodes", "-keyout", "small.key", "-out", "small.pem",
            "-days", "1", "-subj", "/CN=small", cwd=tmp_path)
    client_for("127.0.0.1:1", tls_ca=str(pki / "ca.pem"), tls_cert=str(tmp_path / "small.pem"), tls_key=str(tmp_path / "small.key")).close()
    from pjrt_rendezvous.client._config import tls_pair_problem

    assert tls_pair_problem(str(tmp_path / "small.pem"), str(tmp_path / "small.key")) is None
    assert tls_pair_problem(str(tmp_path / "small.pem"), str(pki / "client.key")) == "KEY_VALUES_MISMATCH"
    # An expired certificate: every coordinator with mutual TLS closes each connection as it
    # opens ("Socket closed", retried for the connect timeout), one without never asks for it.
    shutil.copy(pki / "ca.pem", tmp_path)
    shutil.copy(pki / "ca.key", tmp_path)
    issue(tmp_path, "expired", "ca", days=0)
    time.sleep(1.1)
    caplog.set_level(logging.WARNING, logger="pjrt_rendezvous.client")
    client_for("127.0.0.1:1", tls_ca=str(pki / "ca.pem"), tls_cert=str(tmp_path / "expired.pem"), tls_key=str(tmp_path / "expired.key")).close()
    assert re.search(rf"the TLS certificate {re.escape(str(tmp_path / 'expired.pem'))} \(tls_cert, PJRT_RENDEZVOUS_TLS_CERT\) cannot be "
                     r"used: it expired on .* GMT; a coordinator with mutual TLS closes each connection", caplog.text), caplog.text
    from pjrt_rendezvous.client._config import certificate_out_of_date

    assert certificate_out_of_date(str(pki / "client.pem")) is None
    assert certificate_out_of_date(str(pki / "client.pem"), now=0).startswith("it is not valid before ")
    assert certificate_out_of_date(str(tmp_path / "junk.pem")) is None  # (the PEM check's to say)


def test_tls_server_refuses_plaintext_and_accepts_its_ca(pki):
    """Against a TLS server a plaintext client fails; a client trusting the CA works."""
    cert, key = (pki / "server.pem").read_bytes(), (pki / "server.key").read_bytes()
    with Coordinator(port=0, tls_cert=cert, tls_key=key) as c:
        assert c.session_port is None  # plain TCP: not next to TLS
        plaintext = client_for(c.address)
        with pytest.raises(pr.CoordinatorUnavailableError, match="If it serves TLS, this client needs PJRT_RENDEZVOUS_TLS_CA"):
            plaintext.count()
        plaintext.close()
        assert outcome(client_for(c.address, tls_ca=str(pki / "ca.pem"))) == "ok"
        assert outcome(client_for(c.address, tls_ca=str(pki / "rogue-ca.pem"))) == "CoordinatorUnavailableError"


def test_a_connect_that_timed_out_gets_no_tls_hint():
    """gRPC's words for a TCP connect that timed out (a partitioned host, a firewall dropping
    packets) name a "handshaker": the TLS hint came with about half of them."""
    from pjrt_rendezvous.client._errors import connection_hint

    timed_out = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.44.0.1:7481: tcp handshaker shutdown"
    assert connection_hint(timed_out) == ""
    assert "PJRT_RENDEZVOUS_TLS_CA" in connection_hint(timed_out.replace("tcp handshaker shutdown", "Socket closed"))


def test_a_tls_client_of_a_plaintext_coordinator_is_told_so_soon_and_quietly(pki):
    """A client with TLS against a coordinator without: told within seconds (not its 60 s
    connect timeout) that the server does not speak TLS and which variable to unset (the hint
    said to set the one already set), without gRPC's INFO line for every handshake on stderr."""
    with Coordinator(port=0) as c:
        script = (
            "import time, pjrt_rendezvous.client as pr\n"
            f"client = pr.Client(pr.Settings(address={c.address!r}, tls_ca={str(pki / 'ca.pem')!r}), pr.detect_topology({{}}, address={c.address!r}))\n"
            "started = time.monotonic()\n"
            "try:\n    client.set('k', b'v')\n"
            "except pr.CoordinatorUnavailableError as exc:\n    print(round(time.monotonic() - started), exc)\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    seconds, message = child.stdout.split(" ", 1)
    assert int(seconds) < 30, child.stdout
    assert "The server there does not speak TLS: if it is the coordinator, it serves without TLS, and this client must not set PJRT_RENDEZVOUS_TLS_CA" in message
    assert "ssl_transport_security" not in child.stderr, child.stderr


@pytest.mark.parametrize("refused", ["another CA", "another name", "expired"])
def test_a_server_certificate_the_client_refuses_is_told_soon_with_what_to_do(pki, tmp_path, refused):
    """A TLS client that refuses the coordinator's certificate (signed by a CA it does not
    trust, naming another host, expired) gives up within seconds, not its connect_timeout
    (60 s: the torch Store's, init_process_group's timeout, 30 minutes), saying what to fix,
    and does not ask whether the coordinator runs (it answered)."""
    ca = "rogue-ca" if refused == "another CA" else "ca"
    shutil.copy(pki / f"{ca}.pem", tmp_path)
    shutil.copy(pki / f"{ca}.key", tmp_path)
    issue(tmp_path, "server", ca, san="DNS:elsewhere.example" if refused == "another name" else "IP:127.0.0.1", days=0 if refused == "expired" else 1)
    time.sleep(1.1 if refused == "expired" else 0)  # (-days 0: valid until the second it was made)
    hint = {
        "another CA": "is not signed by the CA this client trusts (PJRT_RENDEZVOUS_TLS_CA)",
        "another name": "does not name the host this client dials",
        "expired": "has expired",
    }[refused]
    cert, key = (tmp_path / "server.pem").read_bytes(), (tmp_path / "server.key").read_bytes()
    with Coordinator(port=0, tls_cert=cert, tls_key=key) as c:
        client = pr.Client(pr.Settings(address=c.address, tls_ca=str(pki / "ca.pem")), pr.detect_topology({}, address=c.address))
        started = time.monotonic()
        with pytest.raises(pr.CoordinatorUnavailableError) as failed:
            client.set("k", b"v")
        assert time.monotonic() - started < 30
        client.close()
    message = str(failed.value)
    assert f"The coordinator's TLS certificate {hint}" in message, message
    assert "this client refuses the server's TLS certificate, which waiting does not change" in message, message
    assert "Is `pjrt-rendezvous serve`" not in message, message


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


def _peak_memory_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_what_status_and_the_world_table_tell_of_a_process_cannot_act_as_it():
    """A process proves its calls by its incarnation id; status and the world table told it
    to any caller with the token, which could then end another process's replica or bring
    its contribution to a round (its peers took the forged payload). They now tell a digest
    of it, and calls made with that are refused."""
    with Coordinator(port=0) as coordinator:
        clients = make_clients(coordinator.address, fan_in="off", processes=2, hosts=2)
        try:
            run_threads(clients, lambda client, binding: client.rendezvous(binding, "warm", b"x"))
            channel = grpc.insecure_channel(coordinator.address)
            stub = pb_grpc.CoordinatorStub(channel)
            status = stub.Status(pb.StatusRequest(job="default"), timeout=10)
            world = stub.WaitWorld(pb.WaitWorldRequest(job="default"), timeout=10)
            told = {p.incarnation for p in status.jobs[0].participants} | {p.incarnation for p in world.processes}
            assert len(told) == 2 and told.isdisjoint(c.incarnation for c in clients), told
            generation = status.jobs[0].generation
            for incarnation in told:
                calls = [
                    lambda: stub.EndReplicas(pb.EndReplicasRequest(job="default", incarnation=incarnation, ordinals=[1], reason="x"), timeout=10),
                    lambda: stub.Rendezvous(pb.RendezvousRequest(
                        job="default", incarnation=incarnation, round=1, generation=generation,
                        contributions=[pb.Contribution(ordinal=o, tag="warm", payload=b"forged") for o in range(4)],
                    ), timeout=10),
                ]
                for call in calls:
                    with pytest.raises(grpc.RpcError) as refused:
                        call()
                    assert "is not registered in job 'default'" in refused.value.details(), refused.value.details()
                stub.Leave(pb.LeaveRequest(job="default", incarnation=incarnation), timeout=10)  # (of nobody: nothing)
            channel.close()
            results = run_threads(clients, lambda client, binding: client.rendezvous(binding, "after", b"%d" % binding.ordinal))
            assert results == {o: [b"0", b"1", b"2", b"3"] for o in range(4)}, results
        finally:
            for client in clients:
                client.close()


def test_a_refused_call_is_refused_before_its_request_is_read():
    """A call without the token is refused as soon as it starts: a caller that never sends
    its request (a client stream that does not yield) still gets UNAUTHENTICATED, rather
    than the server waiting to receive (and parse) a request it will not serve."""
    never = threading.Event()

    def requests():
        never.wait(30)  # the request never comes
        yield pb.KvSetRequest(job="j").SerializeToString()

    with Coordinator(port=0, token=SECRET) as c, grpc.insecure_channel(c.address) as channel:
        call = channel.stream_unary("/pjrt_rendezvous.v1.Coordinator/KvSet")
        try:
            with pytest.raises(grpc.RpcError) as refused:
                call(requests(), timeout=10)
        finally:
            never.set()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    assert "no token" in refused.value.details()


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_large_request_without_the_token_costs_the_server_no_memory():
    """A 160 MB KvSet without the token is refused without the coordinator receiving or
    parsing it: its peak memory grows by far less than the request (it grew by 770 MB for a
    400 MB request when the request was received, then parsed, then refused)."""
    with Serve(env={"PJRT_RENDEZVOUS_TOKEN": SECRET}, port_flag=True) as server:
        before = _peak_memory_mb(server.proc.pid)
        request = pb.KvSetRequest(job="j", entries=[pb.KvEntry(key="k", value=bytes(160 << 20))])
        options = [("grpc.max_send_message_length", -1)]
        with grpc.insecure_channel(server.address, options=options) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.CoordinatorStub(channel).KvSet(request, timeout=60)
        del request
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
        grown = _peak_memory_mb(server.proc.pid) - before
    assert grown < 64, f"the coordinator's peak memory grew by {grown:.0f} MB"


def test_a_request_over_the_largest_message_the_limits_allow_is_resource_exhausted():
    """A message bigger than the limits allow (max_message_bytes: 16 values of the largest
    size, plus room for the rest) is refused before it is read, on gRPC and on the session
    port alike, with RESOURCE_EXHAUSTED (LimitExceededError); below it the same call works.
    The session port answers that call alone: its connection serves the next calls. 16
    values of the largest size go (a TPU host's 16 ordinals' payloads, through its relay: of
    2 MiB, more than the cap's 16 MiB of slack)."""
    limits = Limits(max_value_bytes=2 << 20, max_payload_bytes=2 << 20)
    cap = max_message_bytes(limits)
    count = cap // (2 << 20) + 1  # values each within max_value_bytes, more than the cap in all
    keys, values = [f"k{i}" for i in range(count)], [bytes(2 << 20)] * count
    with Coordinator(port=0, token=SECRET, limits=limits) as c:
        for transport, said in (("grpc", "larger than max"), ("auto", f"over the limit of {cap} bytes")):
            clients = make_clients(c.address, fan_in="off", token=SECRET, transport=transport, processes=1, hosts=1)
            client = clients[0]
            try:
                run_threads(clients, lambda client, binding: None)  # registered: the session port is named
                client.set("first", b"1")
                session = client._current_session
                with pytest.raises(pr.LimitExceededError, match=said) as refused:
                    client.multi_set(keys, values)
                client.multi_set(keys[:16], values[:16])  # within the cap: fine
                assert client.get(keys[0], wait=False) == values[0]
                assert client.get(keys[-1], wait=False) is None
                if transport == "auto":  # the rule is named; the connection lives on
                    assert "max message size" in str(refused.value)
                    assert type(session) is SocketSession and client._current_session is session
                else:  # named too, after gRPC's own words (they named neither the rule nor the limits)
                    assert "the coordinator takes messages of at most 16 x the larger of max_payload_bytes" in str(refused.value)
                    assert "fewer keys in one multi_set" in str(refused.value)
            finally:
                client.close()


def test_calls_each_within_the_largest_message_go_together_on_grpc_without_passing_it():
    """On gRPC's Session stream the calls queued meanwhile go in one message: never more
    than the cap in all (a bigger batch failed every call on the stream), however many
    threads send calls of about half the cap at once."""
    limits = Limits(max_value_bytes=64 << 10, max_payload_bytes=64 << 10)
    cap = max_message_bytes(limits)
    values = [bytes(60 << 10)] * (cap // 2 // (60 << 10))  # one call: about half the cap
    with Coordinator(port=0, limits=limits, session_port=None) as c:
        (client,) = make_clients(c.address, fan_in="off", transport="grpc", processes=1, hosts=1)
        try:
            start, outcomes = threading.Barrier(8), {}

            def writer(n: int) -> None:
                start.wait(10)
                try:
                    client.multi_set([f"t{n}/{i}" for i in range(len(values))], values)
                    outcomes[n] = "ok"
                except pr.RendezvousError as exc:
                    outcomes[n] = str(exc)

            threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert outcomes == {n: "ok" for n in range(8)}, outcomes
        finally:
            client.close()


def test_an_embedded_coordinator_takes_its_token_as_serve_and_clients_do():
    """Coordinator(token=) strips the secret as serve and the clients do: one read from a
    file with its newline refused every client that brought the same secret ("a wrong
    token")."""
    from pjrt_rendezvous.coordinator import Coordinator

    with Coordinator(port=0, token="s3cret\n") as coordinator:
        client = pr.Client(pr.Settings(address=coordinator.address, token="s3cret\n"), pr.detect_topology({}))
        try:
            client.set("k", b"v")
            assert client.get("k") == b"v"
        finally:
            client.close()
