"""The Supervisor service of `meshserve up`: scale a pool of workers at run time (the autoscaler's local actuator,
and `meshserve scale POOL N`).

It runs in the `up` process beside the process supervisor (services/launcher.Mesh), on loopback, on its own
thread pool; every call takes the mesh's lock, as the supervision loop does.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc

MAX_REPLICAS = 64  # per pool: a typo (1000) must not fork a thousand engines on one machine
DEFAULT_PORT = 50055


class SupervisorServicer(pb_grpc.SupervisorServicer):
    def __init__(self, mesh, lock: threading.Lock, pools: tuple, say=print):
        """pools: the roles of the mesh's mode and its named groups of workers (Mesh.pools())."""
        self.mesh, self.lock, self.pools, self.say = mesh, lock, pools, say

    def Scale(self, request, context):
        if request.pool not in self.pools:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pool {request.pool!r} is not one of this mesh's: "
                                                            f"{', '.join(self.pools)}")
        if not 0 <= request.replicas <= MAX_REPLICAS:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"replicas must be in [0, {MAX_REPLICAS}], got "
                                                        f"{request.replicas}")
        with self.lock:
            self.mesh.scale(request.pool, request.replicas, request.reason, say=self.say)
            return pb.PoolState(**self.mesh.pool_state(request.pool))

    def Pools(self, request, context):
        with self.lock:
            return pb.PoolsReply(pools=[pb.PoolState(**self.mesh.pool_state(p)) for p in self.pools])


def serve(mesh, lock: threading.Lock, pools: tuple, port: int = DEFAULT_PORT, say=print) -> tuple[grpc.Server, str]:
    """Start the service on 127.0.0.1:port (0 = any free port); returns (server, address)."""
    server = grpc.server(futures.ThreadPoolExecutor(2, thread_name_prefix="supervisor"))
    pb_grpc.add_SupervisorServicer_to_server(SupervisorServicer(mesh, lock, pools, say), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if not bound:
        raise RuntimeError(f"the supervisor's port {port} is taken")
    server.start()
    return server, f"127.0.0.1:{bound}"
