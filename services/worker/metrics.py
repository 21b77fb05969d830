"""A worker's metrics, under vLLM's names where vLLM has one (docs/METRICS.md lists them).

Recorded from each step's message of the engine core (on_step, on the servicer's loop) and read at
collection time from the latest EngineLoad snapshot (observable gauges), so a scrape never touches the engine. Times are
seconds on the engine's clock: TTFT from the request's arrival at this worker to its first token
(a decode worker's imported requests have their first token already and record none), inter-token
latency between consecutive tokens of a request seen here, e2e from arrival to finish.
"""

from __future__ import annotations

import os

from opentelemetry import metrics

# vLLM's histogram buckets (seconds), so dashboards read the same quantiles.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included), from /proc; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class WorkerMetrics:
    def __init__(self, role: str, worker_id: str, meter: metrics.Meter | None = None):
        meter = meter or metrics.get_meter("meshserve.worker")
        self.attrs = {"role": role, "worker_id": worker_id}
        self.load = None  # the latest EngineLoad (set by the engine thread after each step)
        self.last_token_s: dict[str, float] = {}  # request -> time of its latest token here
        for name, read, desc in (
                ("vllm.num_requests_running", lambda s: s.running, "requests in the running batch"),
                ("vllm.num_requests_waiting", lambda s: s.waiting, "requests waiting to be scheduled"),
                ("vllm.kv_cache_usage_perc", lambda s: s.kv_usage, "fraction of KV blocks held, 0..1"),
                ("meshserve.worker.queued_prefill_tokens", lambda s: s.queued_prefill_tokens,
                 "prompt tokens not yet computed"),
                ("meshserve.worker.outstanding_tokens", lambda s: s.outstanding_tokens,
                 "prompt tokens left + output tokens expected")):
            meter.create_observable_gauge(name, [self._observe(read)], description=desc)
        self.kv_recomputes = meter.create_counter(
            "meshserve.worker.kv_recomputes", description="decode requests that computed their prompt after the KV "
                                                          "transfer failed")
        self.ttft = meter.create_histogram("vllm.time_to_first_token_seconds", unit="s",
                                           description="time to first token",
                                           explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.itl = meter.create_histogram("vllm.inter_token_latency_seconds", unit="s",
                                          description="time between consecutive tokens of a request",
                                          explicit_bucket_boundaries_advisory=ITL_BUCKETS)
        self.e2e = meter.create_histogram("vllm.e2e_request_latency_seconds", unit="s",
                                          description="arrival to finish",
                                          explicit_bucket_boundaries_advisory=E2E_BUCKETS)
        self.prompt_tokens = meter.create_counter("vllm.prompt_tokens", description="prompt tokens of requests started")
        self.generation_tokens = meter.create_counter("vllm.generation_tokens", description="tokens sampled")
        self.prefix_queries = meter.create_counter("vllm.prefix_cache_queries", description="prompt tokens looked up")
        self.prefix_hits = meter.create_counter("vllm.prefix_cache_hits", description="prompt tokens found cached")
        # LoRA: vLLM's info gauge (its labels name the adapters running and waiting), residency per adapter and
        # tier, read times, and admissions that found their adapter in a slot (hits) or had to read it (misses).
        meter.create_observable_gauge("vllm.lora_requests_info", [self._lora_info],
                                      description="running_lora_adapters, waiting_lora_adapters, max_lora as labels")
        meter.create_observable_gauge("meshserve.worker.lora_resident", [self._lora_resident],
                                      description="1 per adapter and tier (slot, host) holding it")
        for name, read, desc in (
                ("meshserve.worker.lora_hits", lambda s: s.hits, "admissions whose adapter was in a compute slot"),
                ("meshserve.worker.lora_misses", lambda s: s.misses, "admissions that waited for their adapter's read"),
                ("meshserve.worker.lora_loads", lambda s: s.loads, "adapter reads from disk into host memory"),
                ("meshserve.worker.lora_slot_loads", lambda s: s.slot_loads, "adapter copies into a compute slot")):
            meter.create_observable_counter(name, [self._observe_lora(read)], description=desc)
        # CPU: the servicer's and the engine core's, for the CPU-utilisation autoscaling baseline (the HPA's signal)
        self.cpu_pids: list[int] = []
        self.cpu_cores = 1.0
        meter.create_observable_counter("meshserve.worker.cpu_seconds", [self._cpu_seconds], unit="s",
                                        description="CPU time of the worker's processes (servicer + engine core)")
        meter.create_observable_gauge("meshserve.worker.cpu_cores", [self._cores],
                                      description="cores the worker's engine is given (its torch threads)")
        self.lora_load = meter.create_histogram("meshserve.worker.lora_load_seconds", unit="s",
                                                description="time to read one adapter from disk",
                                                explicit_bucket_boundaries_advisory=ITL_BUCKETS)

    def _observe(self, read):
        def callback(options):
            if self.load is not None:
                yield metrics.Observation(read(self.load), self.attrs)
        return callback

    def _lora_info(self, options):
        load = self.load
        if load is not None and load.lora is not None:
            yield metrics.Observation(1, {**self.attrs, "running_lora_adapters": ",".join(load.running_adapters),
                                          "waiting_lora_adapters": ",".join(load.waiting_adapters),
                                          "max_lora": str(load.lora.max_loras)})

    def _lora_resident(self, options):
        lora = self.load.lora if self.load is not None else None
        if lora is not None:
            for tier, names in (("slot", lora.slots), ("host", lora.host)):
                for name in names:
                    yield metrics.Observation(1, {**self.attrs, "adapter": name, "tier": tier})

    def _observe_lora(self, read):
        def callback(options):
            if self.load is not None and self.load.lora is not None:
                yield metrics.Observation(read(self.load.lora), self.attrs)
        return callback

    def watch_cpu(self, pids: list[int], cores: float) -> None:
        self.cpu_pids, self.cpu_cores = list(pids), float(cores)

    def _cpu_seconds(self, options):
        if self.cpu_pids:
            yield metrics.Observation(sum(process_cpu_seconds(p) for p in self.cpu_pids), self.attrs)

    def _cores(self, options):
        if self.cpu_pids:
            yield metrics.Observation(self.cpu_cores, self.attrs)

    def on_adapter_reads(self, seconds) -> None:
        for s in seconds:
            self.lora_load.record(s, self.attrs)

    def on_step(self, outputs, load, now: float) -> None:
        """Record one step's outputs (services.worker.core.StepOutput, as the core reports them)."""
        self.load = load
        a = self.attrs
        for out in outputs:
            n = len(out.new_token_ids)
            if n:
                self.generation_tokens.add(n, a)
                if out.num_output == 1:  # the request's first token, sampled here
                    self.ttft.record(now - out.arrival_s, a)
                    self.prompt_tokens.add(out.num_prompt, a)
                    self.prefix_queries.add(out.num_prompt, a)
                    self.prefix_hits.add(out.num_cached_prompt, a)
                elif out.req_id in self.last_token_s:
                    self.itl.record(now - self.last_token_s[out.req_id], a)
                self.last_token_s[out.req_id] = now
            if out.finished:
                self.last_token_s.pop(out.req_id, None)
                self.e2e.record(now - out.arrival_s, a)

    def forget(self, req_id: str) -> None:
        self.last_token_s.pop(req_id, None)
