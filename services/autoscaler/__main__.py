"""python -m services.autoscaler: receives the workers' metrics over OTLP and scales their pools.

It implements the OTLP MetricsService Export RPC itself (a Collector may sit in front and fan out to it,
Prometheus and Jaeger; traces sent to it are accepted and dropped), turns the metrics into one sample per
pool every --interval-s (signals.py), asks the policy (services/policy/scaling.py) and tells the actuator
(services/mesh/actuators.py).
Each decision that changes a pool is a log line with its reason and the metric
meshserve.autoscaler.decisions{pool, kind, policy}; meshserve.autoscaler.desired_replicas{pool} is what
the signals alone ask for. Its port speaks plain gRPC (exporters send to it without mesh certificates).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from services.autoscaler.server import Autoscaler, DroppedTraces
from services.common import envs, rpc
from services.common.telemetry import add_metrics_flag, setup_telemetry
from services.config.flags import add_config_flag, add_section_flags, announce, config_from_args
from services.config.sections import AutoscalerSection, service_pairs, workload_pairs
from services.mesh.actuators import ComposeActuator, KubernetesActuator, LocalActuator

log = logging.getLogger("meshserve.autoscaler")
DEFAULT_PORT = 50054  # docs/INTERFACES.md


def make_actuator(section: AutoscalerSection):
    if section.actuator == "local":
        return LocalActuator(section.supervisor, section.supervisor_tls_dir)
    if section.actuator == "compose":
        return ComposeActuator(section.compose_file, section.compose_project, service_pairs(section.compose_services))
    return KubernetesActuator(section.k8s_namespace, workload_pairs(section.k8s_workloads))


def parse_workloads(text: str) -> dict:
    """`decode=Deployment/meshserve-decode,sql=StatefulSet/sql` -> {pool: (kind, name)}; SystemExit naming a bad
    pair."""
    try:
        return workload_pairs(text)
    except ValueError as e:
        raise SystemExit(f"--k8s-workloads: {e}") from None


async def serve(args, section: AutoscalerSection, roles: dict) -> None:
    server = rpc.Server([], args.port, args.host, public=True)
    autoscaler = Autoscaler(section, make_actuator(section), section.scaled_pools.split(","), roles=roles)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(autoscaler, server.server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(DroppedTraces(), server.server)
    await server.set_serving(True)
    loop = asyncio.create_task(autoscaler.run())
    print(f"autoscaler listening on {server.address} (OTLP metrics; policy {section.policy}, "
          f"pools {section.scaled_pools}, actuator {section.actuator}, every {section.interval_s:g} s)", flush=True)
    await server.run(grace_s=args.grace_s)
    loop.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.autoscaler", description=__doc__)
    rpc.add_server_flags(ap, envs.AUTOSCALER_PORT, grace_s=1.0, default_port=DEFAULT_PORT)
    add_config_flag(ap)
    add_section_flags(ap, "autoscaler")
    add_metrics_flag(ap)
    args = ap.parse_args()
    cfg = config_from_args(ap, args, "autoscaler")
    section = cfg.autoscaler
    try:
        roles = {pool: cfg.pool_role(pool) for pool in section.scaled_pools.split(",")}
    except ValueError as e:
        raise SystemExit(f"autoscaler: {e}") from None
    if (envs.OTLP_METRICS_ENDPOINT.get() or "").endswith(f":{args.port}"):
        # the mesh's services export here; the autoscaler itself does not
        del os.environ[envs.OTLP_METRICS_ENDPOINT.name]
    setup_telemetry("autoscaler", args.metrics_port, args.host)
    announce("autoscaler", cfg, "autoscaler")
    asyncio.run(serve(args, section, roles))


if __name__ == "__main__":
    main()
