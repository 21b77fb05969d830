"""The autoscaler's service: the OTLP metrics receiver that turns workers' metrics into pool samples (signals.py),
asks the scaling policy (services/policy/scaling.py) every interval and tells the actuator
(services/mesh/actuators.py). `python -m services.autoscaler` (__main__.py) runs it."""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import metrics
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.autoscaler.signals import PoolSignals
from services.config.sections import AutoscalerSection, PoolSection
from services.policy.scaling import POLICIES, SignalWindow

log = logging.getLogger("meshserve.autoscaler")


class Autoscaler(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, section: AutoscalerSection, actuator, pools: list[str], clock=time.monotonic, meter=None,
                 roles: dict | None = None):
        """roles: pool -> role for pools that are not a role (MeshConfig.pool_role)."""
        self.section, self.actuator, self.pools, self.clock = section, actuator, pools, clock
        self.roles = {p: (roles or {}).get(p, p) for p in pools}
        self.signals = PoolSignals()
        self.windows: dict[str, SignalWindow] = {p: SignalWindow() for p in pools}
        self.desired: dict[str, int] = {}
        meter = meter or metrics.get_meter("meshserve.autoscaler")
        self.decisions = meter.create_counter("meshserve.autoscaler.decisions",
                                              description="scaling decisions that changed a pool, by kind")
        meter.create_observable_gauge("meshserve.autoscaler.desired_replicas", [self._observe_desired],
                                      description="replicas the signals ask for, before hysteresis and bounds")

    def _observe_desired(self, options):
        for pool, n in self.desired.items():
            yield metrics.Observation(n, {"pool": pool})

    async def Export(self, request, context):
        self.signals.ingest(request, self.clock())
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def policy(self, pool: str, startup_s: float):
        section = self.section.pools.get(pool) or PoolSection()
        config = section.to_pool_config(self.roles[pool], startup_s or None)
        name = self.section.policy
        if name == "cpu-utilisation":
            return POLICIES[name](config, self.section.target_cpu)
        if name == "request-rate":
            return POLICIES[name](config, self.section.requests_per_s_per_replica)
        return POLICIES[name](config)

    async def tick(self) -> list:
        """One round: sample, decide and act for every pool; returns [(pool, Decision)]."""
        out = []
        for pool in self.pools:
            now = self.clock()
            status = await self.actuator.state(pool)
            sample = self.signals.sample(pool, now, starting=status.starting, ready=status.ready)
            policy = self.policy(pool, status.startup_s)
            d = self.windows[pool].decide(policy, sample)
            self.desired[pool] = d.desired
            if d.kind != "hold":
                log.info("%s: %s to %d (%s; ready %d, starting %d)", pool, d.kind, d.target, d.reason, status.ready,
                         status.starting)
                self.decisions.add(1, {"pool": pool, "kind": d.kind, "policy": policy.name})
                await self.actuator.scale(pool, d.target, f"{policy.name}: {d.reason}")
            out.append((pool, d))
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.section.interval_s)
            try:
                await self.tick()
            except Exception as e:  # an actuator away: try again next round
                log.warning("scaling round failed: %s", e)


class DroppedTraces(trace_service_pb2_grpc.TraceServiceServicer):
    """Traces sent here (one OTLP endpoint for everything) are accepted and dropped."""

    async def Export(self, request, context):
        return trace_service_pb2.ExportTraceServiceResponse()
