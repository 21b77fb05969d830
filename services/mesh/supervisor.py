"""The Supervisor service of `meshserve up`: scale a pool of workers at run time (the autoscaler's local actuator,
and `meshserve scale POOL N`).

It runs in the `up` process beside the process supervisor (services/launcher.Mesh), on loopback, on its own
thread pool; every call takes the mesh's lock, as the supervision loop does. With the mesh's mutual TLS on (the
default of `meshserve up`) it speaks it too, like every internal port: a caller must present a certificate of the
mesh's CA naming an operator (`client`: `meshserve scale --tls-dir`) or the `autoscaler`; any other local process is
refused, since a pool scaled to 0 is an outage and one scaled to 64 takes the machine.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from services.common import rpc
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.mesh.launcher import NoRoom

MAX_REPLICAS = 64  # per pool: a typo (1000) must not fork a thousand engines on one machine
DEFAULT_PORT = 50055
CALLERS = ("client", "autoscaler")  # the certificate names that may scale a pool


class SupervisorServicer(pb_grpc.SupervisorServicer):
    def __init__(self, mesh, lock: threading.Lock, pools: tuple, say=print, tls: bool = False):
        """pools: the roles of the mesh's mode and its named groups of workers (Mesh.pools()); tls: callers come over
        mutual TLS, and their certificate must name one of CALLERS."""
        self.mesh, self.lock, self.pools, self.say, self.tls = mesh, lock, pools, say, tls

    def _check_caller(self, context) -> None:
        if self.tls and (name := rpc.peer_name(context)) not in CALLERS:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"a {name} may not scale the mesh's pools (allowed: "
                                                             f"{', '.join(CALLERS)})")

    def Scale(self, request, context):
        self._check_caller(context)
        if request.pool not in self.pools:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pool {request.pool!r} is not one of this mesh's: "
                                                            f"{', '.join(self.pools)}")
        if not 0 <= request.replicas <= MAX_REPLICAS:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"replicas must be in [0, {MAX_REPLICAS}], got "
                                                        f"{request.replicas}")
        with self.lock:
            try:
                self.mesh.scale(request.pool, request.replicas, request.reason, say=self.say)
            except NoRoom as e:  # the replicas that fit were started; the rest have no host with the cores
                self.say(f"scale {request.pool}: {e}")
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return pb.PoolState(**self.mesh.pool_state(request.pool))

    def Pools(self, request, context):
        self._check_caller(context)
        with self.lock:
            return pb.PoolsReply(pools=[pb.PoolState(**self.mesh.pool_state(p)) for p in self.pools])


def serve(mesh, lock: threading.Lock, pools: tuple, port: int = DEFAULT_PORT, say=print,
          tls_dir: str = "") -> tuple[grpc.Server, str]:
    """Start the service on 127.0.0.1:port (0 = any free port), over mutual TLS with the certificates in tls_dir (the
    mesh's; plain without); returns (server, address)."""
    server = grpc.server(futures.ThreadPoolExecutor(2, thread_name_prefix="supervisor"))
    pb_grpc.add_SupervisorServicer_to_server(SupervisorServicer(mesh, lock, pools, say, tls=bool(tls_dir)), server)
    address = f"127.0.0.1:{port}"
    if tls_dir:
        ca, key, cert = rpc.read_tls(tls_dir, "supervisor")
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                                            require_client_auth=True))
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"the supervisor's port {port} is taken")
    server.start()
    return server, f"127.0.0.1:{bound}"
