"""gRPC plumbing shared by every service: server set-up, health, reflection, error mapping, shutdown.

Identity: with MESHSERVE_TLS_DIR set (a folder of services.common.certs) every internal server asks
for and checks a client certificate of the mesh's CA and every channel presents this process's
(MESHSERVE_TLS_NAME: gateway, router, kvstore, worker or client); servicers check the peer's name
per RPC (require_peer). The gateway's public port stays plain (public=True). Unset: plaintext.

Errors map once, here: a MeshError becomes its status (RESOURCE_EXHAUSTED carries trailing
metadata retry-after-ms); a call to another service that failed keeps its status (a dead kvstore is
UNAVAILABLE to the caller, not INTERNAL); anything else is INTERNAL, logged with the request id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import envs
from services.common.errors import MeshError, NoWorker, PermissionDenied, Unavailable, bounded_message
from services.common.pb import meshserve_pb2

log = logging.getLogger("meshserve.rpc")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   # A restarted service is reconnected to within a second: gRPC's default backoff (1 s growing to
                   # 120 s) would keep a channel failing calls for many seconds after its peer is back.
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]




def read_tls(folder: str, identity: str) -> tuple[bytes, bytes, bytes]:
    """(CA, the identity's key, its certificate) from a certificate folder (services.common.certs)."""
    read = lambda f: open(os.path.join(folder, f), "rb").read()  # noqa: E731
    return read("ca.pem"), read(f"{identity}-key.pem"), read(f"{identity}.pem")


def channel_credentials(files: tuple[bytes, bytes, bytes]) -> grpc.ChannelCredentials:
    ca, key, cert = files
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


@functools.cache
def tls_files() -> tuple[bytes, bytes, bytes] | None:
    """This process's (CA, key, certificate) from the environment, or None when TLS is off."""
    folder = envs.TLS_DIR.get()
    return read_tls(folder, envs.TLS_NAME.get()) if folder else None


def peer_name(context) -> str | None:
    """The common name of the caller's certificate (None on a plaintext connection)."""
    names = (context.auth_context() or {}).get("x509_common_name")
    return names[0].decode() if names else None


def require_peer(context, *allowed: str) -> None:
    """With TLS on, the caller's certificate must name one of `allowed` (PermissionDenied otherwise)."""
    if tls_files() is None:
        return
    name = peer_name(context)
    if name not in allowed:
        raise PermissionDenied(f"a {name or 'caller without a mesh certificate'} may not call this "
                               f"(allowed: {', '.join(allowed)})")


def status_of(err: MeshError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.code, grpc.StatusCode.INTERNAL)


SERVER_MS_KEY = "meshserve-server-ms"  # an error's trailing metadata: milliseconds the server took to decide it


async def abort(context: grpc.aio.ServicerContext, err: MeshError, started_s: float | None = None) -> None:
    """Fail the call with err's status; with started_s (time.perf_counter() when the handler began), the time to
    the answer travels as SERVER_MS_KEY (a rejection at arrival answers within milliseconds: clients can tell)."""
    metadata = (("retry-after-ms", str(err.retry_after_ms)),) if err.retry_after_ms is not None else ()
    if started_s is not None:
        metadata += ((SERVER_MS_KEY, f"{(time.perf_counter() - started_s) * 1e3:.3f}"),)
    if isinstance(err, NoWorker):
        metadata += ((NoWorker.REASON_KEY, NoWorker.NO_WORKER),) + (((NoWorker.ROLE_KEY, err.empty_role),)
                                                                     if err.empty_role else ())
    if metadata:
        context.set_trailing_metadata(metadata)
    await context.abort(status_of(err), bounded_message(str(err)))


async def _fail(method, request, context, error: Exception, started_s: float) -> None:
    """Turn an exception escaping a servicer into its status (an abort already under way passes through)."""
    if isinstance(error, grpc.aio.AbortError):
        raise error
    if isinstance(error, grpc.aio.AioRpcError):
        error = forward_rpc_error(error)
    if isinstance(error, MeshError):
        await abort(context, error, started_s)
    log.error("bug in %s (request %s)", method.__name__, getattr(request, "request_id", "?"), exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")


def mapped(method):
    """Servicer decorator (unary and server-streaming): typed errors -> statuses, bugs -> INTERNAL."""
    if asyncio.iscoroutinefunction(method):
        @functools.wraps(method)
        async def unary(self, request, context):
            started = time.perf_counter()
            try:
                return await method(self, request, context)
            except Exception as e:  # CancelledError is a BaseException: it passes through
                await _fail(method, request, context, e, started)
        return unary

    @functools.wraps(method)
    async def streaming(self, request, context):
        started = time.perf_counter()
        try:
            async for item in method(self, request, context):
                yield item
        except Exception as e:  # CancelledError is a BaseException: it passes through
            await _fail(method, request, context, e, started)
    return streaming


def forward_rpc_error(e: grpc.aio.AioRpcError, peer: str = "") -> MeshError:
    """A downstream failure (of the service at `peer`) as a MeshError with the same status, for the caller to see."""
    trailing = tuple(e.trailing_metadata() or ())
    no_worker = (NoWorker.REASON_KEY, NoWorker.NO_WORKER) in trailing
    empty = next((v for k, v in trailing if k == NoWorker.ROLE_KEY), "")
    details = bounded_message(e.details() or e.code().name)
    err = NoWorker(details, empty) if no_worker else MeshError(details)
    err.code, err.peer = e.code().name, peer
    retry = next((v for k, v in trailing if k == "retry-after-ms"), None)
    err.retry_after_ms = int(retry) if retry is not None and retry.isdigit() else None
    if err.code == "RESOURCE_EXHAUSTED" and err.retry_after_ms is None:
        # not one of the mesh's limits (those always carry their retry advice) but gRPC's own refusal of an
        # oversize message or metadata: retrying cannot help, so it is no rate limit (429) but an internal error
        err.code = "INTERNAL"
    return err


# What an asyncio client of a client-streaming call reports when one of its writes fails as the call ends
# (grpc/grpc#36066): the real status (the server's, or UNAVAILABLE for a dead peer) is replaced by this.
WRITE_RACE_DETAILS = "Internal error from Core"


async def finish_client_stream(call, peer: str):
    """The reply of a client-streaming call; a peer that died mid-stream is UNAVAILABLE (a MeshError), even when
    gRPC masked it as INTERNAL WRITE_RACE_DETAILS. Our servers read a stream to its end before failing it
    (services/kvstore), so only a broken connection leaves a write racing the end of the call."""
    try:
        return await call
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INTERNAL and e.details() == WRITE_RACE_DETAILS:
            raise Unavailable(f"the stream to {peer} broke mid-call (its connection failed)") from None
        raise


ANY_HOST = ("0.0.0.0", "::", "[::]", "")


def advertised_host(host: str) -> str:
    """The host others reach a server on: the bound one, or for a server on every interface (containers)
    MESHSERVE_ADVERTISE_HOST, else this machine's hostname (a Compose service's container, a pod)."""
    if host not in ANY_HOST:
        return host
    return envs.ADVERTISE_HOST.get() or socket.gethostname()


class Server:
    """A grpc.aio server with health, reflection, explicit message sizes and graceful SIGTERM. Its address is
    what it advertises (advertised_host): a worker registers with the router under it."""

    def __init__(self, service_names: list[str], port: int, host: str = "127.0.0.1", public: bool = False,
                 public_tls: tuple[bytes, bytes] | None = None):
        """public: the gateway's port, never mutual TLS; public_tls: its (key, certificate chain) PEMs to serve TLS
        to any client (no client certificate), else it is plain."""
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [meshserve_pb2.DESCRIPTOR.services_by_name[n].full_name for n in service_names]
        reflection.enable_server_reflection(names + [reflection.SERVICE_NAME, health.SERVICE_NAME], self.server)
        files = None if public else tls_files()
        if public_tls is not None:
            self.port = self.server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([public_tls]))
        elif files is None:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        else:
            ca, key, cert = files
            self.port = self.server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=True))
        self.address = f"{advertised_host(host)}:{self.port}"
        self.stopping = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)

    async def run(self, grace_s: float = 10.0, on_stop=None) -> None:
        """Serve until SIGTERM/SIGINT; then stop taking work and give in-flight calls grace_s to finish."""
        await self.server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        await self.stopping.wait()
        await self.set_serving(False)
        if on_stop:
            await on_stop()
        await self.server.stop(grace_s)


def channel(address: str) -> grpc.aio.Channel:
    """A channel to another service of the mesh (mutual TLS when it is on)."""
    files = tls_files()
    if files is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, channel_credentials(files), options=CHANNEL_OPTIONS)


class ChannelPool:
    """One long-lived channel per peer address (a channel per call would be slow, and closes when collected)."""

    def __init__(self):
        self.channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = channel(address)
        return self.channels[address]


DEFAULT_PORTS = {"gateway": 50051, "router": 50052, "kvstore": 50053}  # docs/INTERFACES.md; workers: any


def add_server_flags(ap, port_var: envs.Var, grace_s: float, default_port: int = 0) -> None:
    """--host, --port (0 = any free port) and --grace-s, every service alike."""
    ap.add_argument("--host", default=envs.HOST.get())
    ap.add_argument("--port", type=int, default=port_var.get(default=default_port),
                    help=f"gRPC port (0 = any free port; default {default_port}; env {port_var.name})")
    ap.add_argument("--grace-s", type=float, default=grace_s, help="time in-flight calls get on SIGTERM")

