"""A worker's metrics as the autoscaler reads them: a WorkerMetrics on an in-memory reader, and one step of it."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from services.engine.engine import EngineLoad
from services.worker.core import StepOutput
from services.worker.metrics import WorkerMetrics


def worker(role: str, worker_id: str, pool: str = ""):
    reader = InMemoryMetricReader()
    attrs = {"service.name": role, **({"meshserve.pool": pool} if pool else {})}
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create(attrs))
    return WorkerMetrics(role, worker_id, provider.get_meter("t")), reader


def load(queued=0, kv_used=0):
    return EngineLoad(running=1, waiting=0, receiving=0, blocks_used=kv_used, blocks_cached=0, blocks_total=100,
                      block_size=16, outstanding_tokens=0, queued_prefill_tokens=queued, max_num_seqs=8)


def step(m: WorkerMetrics, req: str, n_out: int, prompt: int, arrival: float, now: float, finished=False, **kw):
    m.on_step([StepOutput(req, [7], None, finished, "length" if finished else None, prompt, 0, n_out, arrival)],
              load(**kw), now)
