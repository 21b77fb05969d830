"""Every environment variable meshserve reads, in one typed registry.

Settings are config keys (services/config/: the mesh file, `MESHSERVE_<SECTION>__<KEY>`, the flags). The variables
here are the deliberate exceptions: wiring that differs per process or container (ports, peers' addresses, the
interface, identities, secrets, where telemetry goes), switches of the engine's kernels, and hooks for benchmarks
and tests. Code reads them through this module (`envs.MODEL.get()`), never `os.environ` directly: a name read
anywhere else, or a name here missing from docs/OPERATIONS.md's table, fails tests/unit/test_envs.py.

The five legacy aliases of config keys (`ROUTER_MODE`, `KV_TRANSPORT`, `KV_POOL`, `KVSTORE_TRANSPORT`,
`KVSTORE_BUDGET_GB`) still work and log one warning per process naming the key to use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

CONFIG_PREFIX = "MESHSERVE_"  # MESHSERVE_<SECTION>__<KEY>: one config key (services/config/loader.py)
_warned: set[str] = set()


@dataclass(frozen=True)
class Var:
    """One variable: its name, its type (str, int, float or bool) and default, who reads it and what it sets.

    `alias_of` names the config key a legacy variable stands for (reading it warns once).
    """

    name: str
    kind: type
    default: object
    read_by: str
    what: str
    alias_of: str = ""

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value as set, or None when unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name)
        if value and self.alias_of and self.name not in _warned:
            _warned.add(self.name)
            key = self.alias_of
            log.warning("%s is a legacy alias of the config key %s; set %s%s or the key in the mesh file instead",
                        self.name, key, CONFIG_PREFIX, key.upper().replace(".", "__"))
        return value or None

    def get(self, environ: Mapping[str, str] | None = None, default: object = None):
        """The value parsed as the variable's type; its default (or the one given here) when unset."""
        value = self.raw(environ)
        if value is None:
            return self.default if default is None else default
        try:
            if self.kind is bool:
                return value.strip().lower() in ("1", "true", "yes", "on")
            return self.kind(value)
        except ValueError:
            raise ValueError(f"environment variable {self.name}={value!r}: not a valid {self.kind.__name__}") from None

    def is_off(self, environ: Mapping[str, str] | None = None) -> bool:
        """A switch that is on unless set to 0 (`MESHSERVE_KERNELS=0`)."""
        return (self.raw(environ) or "1").strip() == "0"


REGISTRY: dict[str, Var] = {}


def _var(name: str, kind: type, default: object, read_by: str, what: str, alias_of: str = "") -> Var:
    if name in REGISTRY:
        raise ValueError(f"environment variable {name} registered twice")
    REGISTRY[name] = v = Var(name, kind, default, read_by, what, alias_of)
    return v


# Where the mesh's config comes from
CONFIG = _var("MESHSERVE_CONFIG", str, None, "every service", "the mesh file")

# Wiring: the interface, the ports, the peers
HOST = _var("MESHSERVE_HOST", str, "127.0.0.1", "every service", "the interface to bind (`0.0.0.0` in containers)")
ADVERTISE_HOST = _var("MESHSERVE_ADVERTISE_HOST", str, None, "every service on 0.0.0.0",
                      "the address to register under (default: the hostname)")
GATEWAY_PORT = _var("GATEWAY_PORT", int, None, "gateway", "`--port`'s default")
ROUTER_PORT = _var("ROUTER_PORT", int, None, "router", "`--port`'s default")
KVSTORE_PORT = _var("KVSTORE_PORT", int, None, "kvstore", "`--port`'s default")
WORKER_PORT = _var("WORKER_PORT", int, None, "workers", "`--port`'s default")
AUTOSCALER_PORT = _var("AUTOSCALER_PORT", int, None, "autoscaler", "`--port`'s default")
GATEWAY_HTTP_PORT = _var("GATEWAY_HTTP_PORT", int, None, "gateway", "`--http-port`")
METRICS_PORT = _var("MESHSERVE_METRICS_PORT", int, -1, "every service",
                    "`--metrics-port`'s default (9464 in the Compose file)")
ROUTER_ADDR = _var("ROUTER_ADDR", str, None, "gateway, workers", "the router's address (`--router`)")
KVSTORE_ADDR = _var("KVSTORE_ADDR", str, None, "gateway", "the kvstore's address (`--kvstore`)")
REDIS_URL = _var("REDIS_URL", str, None, "router, workers, kvstore", "the prefix index (`--redis-url`)")
MODEL = _var("MESHSERVE_MODEL", str, None, "gateway, workers",
             "`--model`'s default (`mesh.model` when neither is given)")

# Identity and placement
TOPOLOGY = _var("MESHSERVE_TOPOLOGY", str, None, "workers",
                "`rack/node/domain`, for the router's tie-break and placement")
HOST_ID = _var("MESHSERVE_HOST_ID", str, None, "workers, kvstore", "the host identity for shared-memory KV transfer")
POOL = _var("MESHSERVE_POOL", str, "", "workers", "the pool it belongs to, for the autoscaler")
KVSTORE_INSTANCE = _var("KVSTORE_INSTANCE", str, None, "kvstore",
                        "names its shared-memory segments (a restart reclaims its predecessor's)")

# Secrets and certificates
TLS_DIR = _var("MESHSERVE_TLS_DIR", str, None, "every service", "the folder of the mesh's certificates (mutual TLS)")
TLS_NAME = _var("MESHSERVE_TLS_NAME", str, "client", "every service",
                "which certificate of that folder a client presents (default `client`)")
GATEWAY_TLS_CERT = _var("GATEWAY_TLS_CERT", str, None, "gateway", "the public ports' PEM certificate (`--tls-cert`)")
GATEWAY_TLS_KEY = _var("GATEWAY_TLS_KEY", str, None, "gateway", "... and its private key (`--tls-key`)")
CACHE_SECRET = _var("MESHSERVE_CACHE_SECRET", str, None, "gateway",
                    "the key of tenants' cache salts (`meshserve up` makes one per run)")

# Telemetry (the OpenTelemetry SDK's own names)
OTLP_ENDPOINT = _var("OTEL_EXPORTER_OTLP_ENDPOINT", str, None, "every service",
                     "where traces and metrics go (the collector)")
OTLP_METRICS_ENDPOINT = _var("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", str, None, "every service", "metrics alone")
METRIC_EXPORT_INTERVAL = _var("OTEL_METRIC_EXPORT_INTERVAL", int, 5000, "every service",
                              "how often metrics are exported (ms)")

# The engine's switches
KERNELS = _var("MESHSERVE_KERNELS", str, "1", "workers", "`0`: no compiled kernels")
ISA = _var("MESHSERVE_ISA", str, None, "workers",
           "the kernels' ISA level (amx, avx512_bf16, avx512, avx2, generic; default the widest this CPU runs, "
           "`docs/ENGINE.md`)")
ONEDNN = _var("MESHSERVE_ONEDNN", str, "1", "workers", "`0`: torch's own linear instead of oneDNN's")
PROMPT_KERNEL = _var("MESHSERVE_PROMPT_KERNEL", str, "1", "workers",
                     "`0`: prompts through torch's SDPA instead of the prompt kernel")
MALLOPT = _var("MESHSERVE_MALLOPT", str, "1", "workers",
               "`0`: leave glibc's malloc thresholds as they are (the engine raises them; docs/ENGINE.md)")
TORCH_EXTENSIONS_DIR = _var("TORCH_EXTENSIONS_DIR", str, None, "workers",
                            "where the compiled kernels are built and cached (torch's own variable)")
CACHE_DIR = _var("MESHSERVE_CACHE_DIR", str, None, "`meshserve model`, workers",
                 "where fetched models live (default `$XDG_CACHE_HOME/meshserve`)")
XDG_CACHE_HOME = _var("XDG_CACHE_HOME", str, None, "`meshserve model`, workers",
                      "the user's cache folder (default `~/.cache`)")
HF_HUB_OFFLINE = _var("HF_HUB_OFFLINE", str, None, "everything",
                      "`1`: no model hub (models come from the package registry or a folder); "
                      "`meshserve` and the services it starts set it")

# Benchmark and test hooks
RECORD_TRACE = _var("GATEWAY_RECORD_TRACE", str, None, "gateway", "`--record-trace`: the replay trace it appends")
STEP_LOG = _var("MESHSERVE_STEP_LOG", str, None, "workers", "a folder for step logs (`sim calibrate`)")
STARTUP_DELAY_S = _var("MESHSERVE_STARTUP_DELAY_S", float, 0.0, "workers",
                       "wait this long after the model loads (a slow start, for the autoscaler's benchmarks)")
STEP_FLOOR_S = _var("MESHSERVE_STEP_FLOOR_S", float, 0.0, "workers",
                    "no engine step shorter than this (the real model's step times on a tiny model, fault tests)")
KVSTORE_HOLD_META_S = _var("KVSTORE_HOLD_META_S", float, 0.0, "kvstore",
                           "delay the metadata of each KV transfer read this long (fault timing in tests)")

# Legacy aliases of config keys
ROUTER_MODE = _var("ROUTER_MODE", str, None, "router, gateway", "legacy alias of `mesh.mode`", alias_of="mesh.mode")
KV_TRANSPORT = _var("KV_TRANSPORT", str, None, "workers", "legacy alias of `kv.transport`", alias_of="kv.transport")
KV_POOL = _var("KV_POOL", bool, None, "workers", "legacy alias of `kv.pool`", alias_of="kv.pool")
KVSTORE_TRANSPORT = _var("KVSTORE_TRANSPORT", str, None, "kvstore", "legacy alias of `kv.transport`",
                         alias_of="kv.transport")
KVSTORE_BUDGET_GB = _var("KVSTORE_BUDGET_GB", float, None, "kvstore", "legacy alias of `kv.budget_gb`",
                         alias_of="kv.budget_gb")


def config_keys(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `MESHSERVE_<SECTION>__<KEY>` variables set: {"section__key" lower-cased: raw value}."""
    found = {}
    for name, value in (os.environ if environ is None else environ).items():
        if name.startswith(CONFIG_PREFIX) and "__" in name:
            found[name[len(CONFIG_PREFIX):].lower()] = value
    return found


def table() -> str:
    """docs/OPERATIONS.md's table of variables, from this registry (tests/unit/test_envs.py checks the docs hold it)."""
    rows = ["| variable | read by | what |", "|---|---|---|",
            f"| `{CONFIG_PREFIX}<SECTION>__<KEY>` | every service | one config key, over the file "
            f"(`{CONFIG_PREFIX}ENGINE__THREADS=4`) |"]
    rows += [f"| `{v.name}` | {v.read_by} | {v.what} |" for v in REGISTRY.values()]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m services.common.envs: the table for docs/OPERATIONS.md
    print(table())
