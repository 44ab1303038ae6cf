"""The cluster token on a worker's gRPC (pdserve/cluster_token.py): a worker holding one answers every
kind of call without it, or with another, UNAUTHENTICATED before the servicer sees it; a channel made
by ``cluster_token.channel`` in a process holding the token gets through. A real decode worker in this
process over the tiny model."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve import cluster_token
from pdserve.decode_worker.server import DecodeServicer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerServer
from tests.worker.serving import SAMPLING, generated, status_of

PROMPT = list(range(100, 140))


async def _statuses(stub) -> dict[str, grpc.StatusCode]:
    """One call of each kind: unary (Health, Drain's neighbour Stats), server streaming (Generate),
    client streaming (PushKV)."""
    async def chunks():
        yield pb.KVChunk(handle="nothing")

    generate = stub.Generate(pb.GenerateRequest(request_id="g", prompt_token_ids=PROMPT, sampling=SAMPLING))
    return {"Health": await status_of(stub.Health(pb.HealthRequest(), timeout=10)),
            "Stats": await status_of(stub.Stats(pb.StatsRequest(), timeout=10)),
            "Generate": await _drained(generate),
            "PushKV": await status_of(stub.PushKV(chunks(), timeout=10)),
            "Abort": await status_of(stub.Abort(pb.AbortRequest(request_ids=["g"]), timeout=10))}


async def _drained(call) -> grpc.StatusCode:
    """The status a server-streaming call ends with, read to its end."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _with_token_worker(engine, body):
    async def main():
        server = WorkerServer(engine, WorkerConfig(port=0), DecodeServicer)
        await server.start()
        try:
            return await body(server.address)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def test_a_worker_with_a_token_refuses_callers_without_it(make_engine, monkeypatch):
    monkeypatch.setenv(cluster_token.TOKEN_ENV, "the-right-token")

    async def body(address):
        async with grpc.aio.insecure_channel(address) as plain:
            without = await _statuses(pb_grpc.WorkerStub(plain))
        wrong = [("authorization", "Bearer another-token")]
        async with grpc.aio.insecure_channel(address) as plain:
            stub = pb_grpc.WorkerStub(plain)
            wrong_status = await status_of(stub.Health(pb.HealthRequest(), metadata=wrong, timeout=10))
            try:
                await stub.Stats(pb.StatsRequest(), timeout=10)
            except grpc.aio.AioRpcError as e:
                message = e.details()
        async with cluster_token.channel(address) as holding:
            stub = pb_grpc.WorkerStub(holding)
            tokens = await generated(stub, "ok", PROMPT)
            health = await stub.Health(pb.HealthRequest(), timeout=10)
            holding_statuses = await _statuses(stub)
        return without, wrong_status, message, tokens, health, holding_statuses

    without, wrong_status, message, tokens, health, holding = _with_token_worker(make_engine(), body)
    assert set(without.values()) == {grpc.StatusCode.UNAUTHENTICATED}, without
    assert grpc.StatusCode.UNAUTHENTICATED not in holding.values(), holding  # every kind of call gets through
    assert wrong_status == grpc.StatusCode.UNAUTHENTICATED
    assert cluster_token.TOKEN_ENV in message and "the-right-token" not in message
    assert len(tokens) == 4 and health.ok


def test_without_a_token_the_worker_is_open_and_says_so_beyond_loopback(make_engine, monkeypatch, caplog):
    monkeypatch.delenv(cluster_token.TOKEN_ENV, raising=False)

    async def body(address):
        async with grpc.aio.insecure_channel(address) as plain:
            return await generated(pb_grpc.WorkerStub(plain), "open", PROMPT)

    assert len(_with_token_worker(make_engine(), body)) == 4
    assert cluster_token.server_interceptors("127.0.0.1") == []
    with caplog.at_level("WARNING", logger="pdserve.cluster_token"):
        assert cluster_token.server_interceptors("0.0.0.0") == []
    assert "takes calls from anyone" in caplog.text


def test_ensure_token_makes_one_and_keeps_it(monkeypatch):
    monkeypatch.delenv(cluster_token.TOKEN_ENV, raising=False)
    assert cluster_token.token() is None
    made = cluster_token.ensure_token()
    assert len(made) >= 32 and cluster_token.token() == made == cluster_token.ensure_token()


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """ensure_token writes os.environ itself: monkeypatch puts it back after each test."""
    monkeypatch.setenv(cluster_token.TOKEN_ENV, "placeholder")
    monkeypatch.delenv(cluster_token.TOKEN_ENV)


def _pki(tmp_path):
    """A CA, a worker certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def make(name: str, issuer=None, issuer_key=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        for suffix, data in (("crt", cert.public_bytes(serialization.Encoding.PEM)),
                             ("key", key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))):
            (tmp_path / f"{name}.{suffix}").write_bytes(data)
        return cert, key

    ca, ca_key = make("ca", ca=True)
    make("worker", ca.subject, ca_key, san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    make("client", ca.subject, ca_key, san=[x509.DNSName("client")])
    return {name: str(tmp_path / name) for name in ("ca.crt", "worker.crt", "worker.key", "client.crt",
                                                    "client.key")}


def test_tls_and_mutual_tls_on_a_workers_grpc(make_engine, monkeypatch, tmp_path):
    """A worker with a certificate serves TLS only (a plaintext caller is refused); a client checking it
    against the CA gets through; with the CA on the worker too, only callers presenting a certificate
    of that CA do. The token is still asked for over TLS."""
    files = _pki(tmp_path)
    monkeypatch.setenv(cluster_token.TOKEN_ENV, "tls-token")
    monkeypatch.setenv(cluster_token.TLS_CERT_ENV, files["worker.crt"])
    monkeypatch.setenv(cluster_token.TLS_KEY_ENV, files["worker.key"])

    def as_client(cert: bool):
        monkeypatch.setenv(cluster_token.TLS_CA_ENV, files["ca.crt"])
        if cert:
            monkeypatch.setenv(cluster_token.TLS_CERT_ENV, files["client.crt"])
            monkeypatch.setenv(cluster_token.TLS_KEY_ENV, files["client.key"])
        else:
            monkeypatch.delenv(cluster_token.TLS_CERT_ENV)
            monkeypatch.delenv(cluster_token.TLS_KEY_ENV)

    async def health(channel) -> grpc.StatusCode:
        async with channel:
            return await status_of(pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10))

    async def one_way(address):  # the worker started with a certificate and no CA: TLS, not mutual
        plain = await health(grpc.aio.insecure_channel(address))
        as_client(cert=False)
        return plain, await health(cluster_token.channel(address))

    plain, tls = _with_token_worker(make_engine(), one_way)
    assert plain == grpc.StatusCode.UNAVAILABLE and tls == grpc.StatusCode.OK

    for env, name in ((cluster_token.TLS_CERT_ENV, "worker.crt"), (cluster_token.TLS_KEY_ENV, "worker.key"),
                      (cluster_token.TLS_CA_ENV, "ca.crt")):
        monkeypatch.setenv(env, files[name])

    async def mutual(address):  # the worker has the CA too: callers must present a certificate of it
        as_client(cert=False)
        anonymous = await health(cluster_token.channel(address))
        as_client(cert=True)
        return anonymous, await health(cluster_token.channel(address))

    anonymous, certified = _with_token_worker(make_engine(), mutual)
    assert anonymous == grpc.StatusCode.UNAVAILABLE and certified == grpc.StatusCode.OK


def test_half_a_tls_configuration_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(cluster_token.TLS_CERT_ENV, str(tmp_path / "missing.crt"))
    with pytest.raises(ValueError, match="PDSERVE_TLS_CERT: cannot read"):
        cluster_token.server_credentials()
    (tmp_path / "a.crt").write_text("x")
    monkeypatch.setenv(cluster_token.TLS_CERT_ENV, str(tmp_path / "a.crt"))
    with pytest.raises(ValueError, match="needs both PDSERVE_TLS_CERT and PDSERVE_TLS_KEY"):
        cluster_token.server_credentials()
