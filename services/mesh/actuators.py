"""Actuators: where a decision becomes processes, behind one interface (state(pool), scale(pool, n, reason)).

- LocalActuator: the Supervisor service of `meshserve up` (services/mesh/supervisor.py): starts workers, drains them.
- ComposeActuator: `docker compose up -d --scale SERVICE=N --no-recreate SERVICE` (or the standalone
  `docker-compose` v2 binary where there is no docker CLI: the autoscaler's image has only that) (Compose stops surplus
  containers with SIGTERM and its stop grace: the worker drains in it); state from `docker compose ps`.
- KubernetesActuator: the scale subresource of the pool's Deployment or StatefulSet (Kubernetes sends SIGTERM
  and waits terminationGracePeriodSeconds: the same drain).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from dataclasses import dataclass

import grpc

from services.common import rpc
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class PoolStatus:
    ready: int
    starting: int = 0
    draining: int = 0
    startup_s: float = 0.0  # measured start-up of the latest replica (0 = not measured)


class LocalActuator:
    name = "local"

    def __init__(self, supervisor: str, tls_dir: str = ""):
        """tls_dir: the mesh's certificates, when its Supervisor speaks mutual TLS (we present `autoscaler`)."""
        self.address = supervisor
        self.channel = grpc.aio.secure_channel(
            supervisor, rpc.channel_credentials(rpc.read_tls(tls_dir, "autoscaler"))) if tls_dir \
            else grpc.aio.insecure_channel(supervisor)
        self.stub = pb_grpc.SupervisorStub(self.channel)

    async def state(self, pool: str) -> PoolStatus:
        reply = await self.stub.Pools(pb.PoolsRequest(), timeout=5)
        for p in reply.pools:
            if p.pool == pool:
                return PoolStatus(p.ready, p.starting, p.draining, p.startup_s)
        raise ValueError(f"the supervisor at {self.address} has no pool {pool!r}")

    async def scale(self, pool: str, replicas: int, reason: str) -> None:
        await self.stub.Scale(pb.ScaleRequest(pool=pool, replicas=replicas, reason=reason), timeout=30)


class ComposeActuator:
    name = "compose"

    def __init__(self, compose_file: str, project: str, services: dict, run=subprocess.run):
        """compose_file: one file, or several separated by ':' (an override after the main file, as COMPOSE_FILE
        lists them); services: pool -> Compose service name; run: subprocess.run (a fake in tests)."""
        compose = ["docker", "compose"] if shutil.which("docker") or not shutil.which("docker-compose") \
            else ["docker-compose"]
        files = [arg for f in compose_file.split(":") if f for arg in ("-f", f)]
        self.base = [*compose, *files, "-p", project]
        self.services, self.run = services, run

    def _call(self, *args) -> str:
        done = self.run([*self.base, *args], capture_output=True, text=True, check=True, timeout=120)
        return done.stdout

    async def state(self, pool: str) -> PoolStatus:
        out = await asyncio.to_thread(self._call, "ps", "--format", "json", self.services[pool])
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        ready = sum(1 for r in rows if r.get("State") == "running" and r.get("Health", "healthy") in ("healthy", ""))
        starting = sum(1 for r in rows if r.get("State") in ("created", "restarting")
                       or (r.get("State") == "running" and r.get("Health") == "starting"))
        return PoolStatus(ready, starting)

    async def scale(self, pool: str, replicas: int, reason: str) -> None:
        service = self.services[pool]
        await asyncio.to_thread(self._call, "up", "-d", "--scale", f"{service}={replicas}", "--no-recreate", service)


class KubernetesActuator:
    """The scale subresource of each pool's Deployment (or StatefulSet) through the official `kubernetes` client;
    state from its status (ready vs desired replicas). In the cluster: the pod's ServiceAccount (RBAC: get and
    patch deployments/scale and statefulsets/scale of the worker workloads only); elsewhere: ~/.kube/config."""

    name = "kubernetes"

    def __init__(self, namespace: str, workloads: dict, api_client=None):
        """workloads: pool -> (kind, name), kind Deployment or StatefulSet."""
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.apps = client.AppsV1Api(api_client)
        self.namespace, self.workloads = namespace, workloads

    def _calls(self, kind: str):
        if kind == "Deployment":
            return self.apps.read_namespaced_deployment_status, self.apps.patch_namespaced_deployment_scale
        if kind == "StatefulSet":
            return self.apps.read_namespaced_stateful_set_status, self.apps.patch_namespaced_stateful_set_scale
        raise ValueError(f"unknown workload kind {kind!r} (Deployment or StatefulSet)")

    async def state(self, pool: str) -> PoolStatus:
        kind, name = self.workloads[pool]
        read, _ = self._calls(kind)
        obj = await asyncio.to_thread(read, name, self.namespace)
        want, ready = obj.spec.replicas or 0, obj.status.ready_replicas or 0
        return PoolStatus(ready, max(want - ready, 0))

    async def scale(self, pool: str, replicas: int, reason: str) -> None:
        kind, name = self.workloads[pool]
        _, patch = self._calls(kind)
        await asyncio.to_thread(patch, name, self.namespace, {"spec": {"replicas": replicas}})
