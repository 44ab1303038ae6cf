"""The cluster's shared secret on the workers' gRPC: only callers holding it may call a worker.

Every process of a cluster (the router, the workers, a prefill worker pushing KV to a decode
worker) reads the token from ``PDSERVE_CLUSTER_TOKEN``. ``pdserve serve`` makes one per cluster
when the environment has none and hands it to what it starts (child processes inherit it; Ray
replicas get it in their runtime environment); on Kubernetes it comes from a Secret. A worker
holding a token answers any call whose ``authorization`` metadata is not ``Bearer TOKEN`` with
UNAUTHENTICATED, whatever the method (Generate, Abort, Drain, Reserve, PushKV, ...). Clients send
it on every call through ``channel``. Without a token the workers' gRPC is open, as before, and a
worker listening beyond loopback says so at start.

This protects the control and data plane from callers on the network that do not hold the
secret; it does not encrypt. TLS does, when certificates are given (PEM file paths in the
environment, like the token): a worker with ``PDSERVE_TLS_CERT`` and ``PDSERVE_TLS_KEY`` serves
TLS only; a client with ``PDSERVE_TLS_CA`` connects with TLS, checking the worker's certificate
against that CA (its host, an IP address or a name, must be in the certificate; or name it in
``PDSERVE_TLS_SERVER_NAME``); a worker that also has ``PDSERVE_TLS_CA`` asks every caller for a
certificate of that CA (mutual TLS), which clients present from their own ``PDSERVE_TLS_CERT`` /
``PDSERVE_TLS_KEY``.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Mapping, Sequence

import grpc

log = logging.getLogger(__name__)

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = "PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA"
TLS_NAME_ENV = "PDSERVE_TLS_SERVER_NAME"
_HEADER = "authorization"


def _read(env: str) -> bytes | None:
    path = os.environ.get(env)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{env}: cannot read {path}: {e.strerror}") from e


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS for a worker's server when it has a certificate and key (mutual TLS when it has a CA too)."""
    cert, key, ca = _read(TLS_CERT_ENV), _read(TLS_KEY_ENV), _read(TLS_CA_ENV)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError(f"TLS for the workers' gRPC needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def token(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's cluster token; None when the cluster runs without one."""
    return (os.environ if environ is None else environ).get(TOKEN_ENV) or None


def rendezvous_namespace(environ: Mapping[str, str] | None = None) -> str:
    """A name only holders of the token can know, for keys in a store without authentication (the
    torch backend's TCPStore): a digest of the token, never the token; "open" without one."""
    secret = token(environ)
    if secret is None:
        return "open"
    return hmac.new(secret.encode(), b"pdserve torch rendezvous", "sha256").hexdigest()[:32]


def forwarded_env() -> dict[str, str]:
    """This process's token and TLS settings, for processes it starts elsewhere (Ray replicas)."""
    return {k: os.environ[k] for k in (TOKEN_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV, TLS_NAME_ENV)
            if os.environ.get(k)}


def ensure_token() -> str:
    """The cluster token, made (and put in this process's environment, for what it starts) when absent."""
    if not token():
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return os.environ[TOKEN_ENV]


class TokenCheck(grpc.aio.ServerInterceptor):
    """Server side: a call without the token ends UNAUTHENTICATED before reaching the servicer."""

    def __init__(self, expected: str):
        self._expected = f"Bearer {expected}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        presented = next((v for k, v in handler_call_details.invocation_metadata or () if k == _HEADER), "")
        if hmac.compare_digest(presented.encode() if isinstance(presented, str) else presented, self._expected):
            return handler
        return _refusing(handler, handler_call_details.method)


def _refusing(handler, method: str):
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""
    message = f"{method}: this worker wants the cluster token ({TOKEN_ENV}) in the call's authorization metadata"

    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - a generator, as a streaming handler must be

    if handler is None:
        return None
    return same_kind(handler, refuse_stream if handler.response_streaming else refuse, handler.request_deserializer)


_MAKE = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
         (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def same_kind(handler: grpc.RpcMethodHandler, behavior, request_deserializer) -> grpc.RpcMethodHandler:
    """A method handler of ``handler``'s kind (unary or streaming, each way) and response
    serializer, calling ``behavior`` with requests parsed by ``request_deserializer`` (None: bytes)."""
    return _MAKE[handler.request_streaming, handler.response_streaming](
        behavior, request_deserializer=request_deserializer, response_serializer=handler.response_serializer)


def _with_token(details: grpc.aio.ClientCallDetails, pair: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), pair)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


# One class per kind of call: a channel files each interceptor under the first kind it is an
# instance of, so one class of all four would see unary calls only.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, pair):
        self.pair = pair

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.pair), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, pair):
        self.pair = pair

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.pair), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, pair):
        self.pair = pair

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.pair), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, pair):
        self.pair = pair

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.pair), request_iterator)


def channel(address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A channel to a worker that sends this process's cluster token (if any) with every call, over
    TLS when this process has a CA to check workers against."""
    value = token()
    pair = (_HEADER, f"Bearer {value}")
    senders = [kind(pair) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if value else None
    ca = _read(TLS_CA_ENV)
    if ca is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=senders)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=_read(TLS_KEY_ENV),
                                               certificate_chain=_read(TLS_CERT_ENV))
    name = os.environ.get(TLS_NAME_ENV)
    extra = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.aio.secure_channel(address, credentials, options=[*options, *extra], interceptors=senders)


def server_interceptors(host: str) -> list[grpc.aio.ServerInterceptor]:
    """A worker server's interceptors: the token check when the cluster has a token; without one,
    a word at start about who can call it."""
    value = token()
    if value:
        return [TokenCheck(value)]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        log.warning("no cluster token (%s): this worker's gRPC on %s takes calls from anyone who can reach it "
                    "(generate, abort, drain, KV pushes)", TOKEN_ENV, host)
    return []
