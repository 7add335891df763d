"""Security: mutual TLS with throw-away certificates (trustme), the bearer token from a file
or an environment variable.  (Wrong / missing token and health's exemption are in
test_service.py.)"""

from __future__ import annotations

import signal

import grpc
import numpy as np
import pytest

from duelq.client import LearnerClient, errors
from duelq.apps import cli
from duelq.server.core.errors import InvalidArgument
from duelq.server.server import LearnerServer, ServerOptions

from conftest import random_batch
from test_faults import Served, free_port

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A server CA and certificate, a client CA with one client, and an untrusted client."""
    root = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    files = {}

    def write(name: str, *blobs) -> str:
        path = root / name
        path.write_bytes(b"".join(blob.bytes() for blob in blobs))
        files[name] = path
        return str(path)

    leaf = server_ca.issue_cert("localhost", "127.0.0.1")
    write("server.pem", *leaf.cert_chain_pems)
    write("server.key", leaf.private_key_pem)
    write("server-ca.pem", server_ca.cert_pem)
    write("client-ca.pem", client_ca.cert_pem)
    for name, ca in (("actor", client_ca), ("stranger", stranger_ca)):
        cert = ca.issue_cert(f"{name}.duelq.test")
        write(f"{name}.pem", *cert.cert_chain_pems)
        write(f"{name}.key", cert.private_key_pem)
    return {name: path.read_bytes() for name, path in files.items()} | {"dir": root}


def credentials(pki, who: str | None) -> grpc.ChannelCredentials:
    if who is None:
        return grpc.ssl_channel_credentials(root_certificates=pki["server-ca.pem"])
    return grpc.ssl_channel_credentials(root_certificates=pki["server-ca.pem"],
                                        private_key=pki[f"{who}.key"],
                                        certificate_chain=pki[f"{who}.pem"])


def test_mutual_tls_admits_only_clients_the_ca_signed(make_server, pki):
    d = pki["dir"]
    server = make_server(host="127.0.0.1", tls_cert=str(d / "server.pem"),
                         tls_key=str(d / "server.key"), tls_client_ca=str(d / "client-ca.pem"))
    rng = np.random.default_rng(0)
    with LearnerClient(server.target, tls=credentials(pki, "actor")) as client:
        assert client.train_step(random_batch(rng, 4)).step == 1
    refused = {"untrusted client certificate": credentials(pki, "stranger"),
               "no client certificate": credentials(pki, None)}
    for why, creds in refused.items():
        with LearnerClient(server.target, tls=creds, retries=0, timeout=5) as client:
            with pytest.raises(errors.Unavailable):
                client.train_step(random_batch(rng, 4))
    with LearnerClient(server.target, retries=0, timeout=5) as plaintext:
        with pytest.raises(errors.Unavailable):
            plaintext.train_step(random_batch(rng, 4))
    with LearnerClient(server.target, tls=str(d / "client-ca.pem"), retries=0,
                       timeout=5) as wrong_root:   # a server the client cannot verify
        with pytest.raises(errors.Unavailable):
            wrong_root.info()
    assert server.learner.step_count == 1


def test_token_file_is_read_stripped_and_must_not_be_empty(make_server, tmp_path):
    path = tmp_path / "token"
    path.write_text("  s3cret-from-file\n")
    server = make_server(token_file=str(path))
    with LearnerClient(server.target, token="s3cret-from-file") as client:
        assert client.info().step == 0
    with LearnerClient(server.target, token="s3cret", retries=0) as client:
        with pytest.raises(errors.Unauthenticated):
            client.info()
    path.write_text("\n")
    with pytest.raises(InvalidArgument, match="token_file: .* is empty"):
        LearnerServer(ServerOptions(port=0, token_file=str(path)))
    with pytest.raises(InvalidArgument, match="token_file: cannot read"):
        LearnerServer(ServerOptions(port=0, token_file=str(tmp_path / "missing")))
    with pytest.raises(InvalidArgument, match="not both"):
        ServerOptions(token="a", token_file=str(path))


def test_serve_takes_the_token_from_the_environment_and_refuses_an_unreadable_file(
        tmp_path, monkeypatch, capsys):
    port = free_port()
    monkeypatch.setenv("DUELQ_TOKEN", "from-env")
    server = Served(port)
    try:
        server.wait_serving()
        with LearnerClient(server.target, retries=0) as anonymous:
            with pytest.raises(errors.Unauthenticated):
                anonymous.info()
        with LearnerClient(server.target, token="from-env") as client:
            assert client.info().step == 0
        assert "from-env" not in server.log
        assert server.stop(signal.SIGTERM) == 0
    finally:
        server.kill()
    monkeypatch.delenv("DUELQ_TOKEN")
    code = cli.main(["serve", "--port", "0", "--token-file", str(tmp_path / "missing")])
    assert code == cli.EXIT_USAGE
    assert "--token-file: cannot read" in capsys.readouterr().err
