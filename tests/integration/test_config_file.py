"""Every service reads its own sections of the one config file: the kvstore, the router, the gateway and a worker,
each started with only `--config FILE` (ports and peers' addresses come from the environment, as Compose and
Kubernetes give them), print the config they run with, and it is the file's, every key of every section they own
(values away from the defaults, so that a section ignored shows)."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from services.config.flags import owned
from services.config.sections import MeshConfig
from services.mesh.launcher import free_port, signal_group
from services.policy.tenants import new_key
from tests.support.wait import wait_for


def mesh_file(model: str) -> dict:
    return {
        "mesh": {"mode": "unified", "model": model, "served_model_name": ["house", "tiny-alias"]},
        "engine": {"max_num_seqs": 5, "kv_cache_gb": 0.03, "max_num_batched_tokens": 96, "block_size": 8,
                   "threads": 1, "prefix_caching": False, "slot_policy": "fcfs", "seed": 7},
        "routing": {"policy": "round-robin", "lora_placement": False, "heartbeat_ms": 700,
                    "worker_ttl_s": 4.5, "guard": {"abs": 0.5, "rel": 3.0}},
        "admission": {"policy": "fcfs", "starvation_s": 12.0, "queue_bursts": False, "no_worker_grace_s": 7.0,
                      "max_prompt_bytes": 12345},
        "kv": {"transport": "grpc", "pool": True, "budget_gb": 0.25, "transfer_ttl_s": 17.0},
        "tenants": [{"name": "acme", "api_key_hashes": [new_key()[1]], "weight": 2}],
    }


# service -> (module and arguments, the port's variable, what it owns of the file)
SERVICES = {
    "kvstore": (["services.kvstore"], "KVSTORE_PORT", ["kv"]),
    "router": (["services.router"], "ROUTER_PORT", ["routing", "mesh.mode"]),
    "unified worker": (["services.worker", "--role", "unified"], "WORKER_PORT",
                       ["engine", "kv.transport", "kv.pool", "mesh.model"]),
    "gateway": (["services.gateway"], "GATEWAY_PORT",
                ["admission", "tenants", "mesh.mode", "mesh.model", "mesh.served_model_name"]),
}


@pytest.fixture
def config_file(tiny_model, tmp_path):
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(mesh_file(str(tiny_model))))
    return path


def test_each_service_runs_with_the_sections_of_the_file_it_is_given(config_file, tmp_path):
    cfg = MeshConfig.model_validate(yaml.safe_load(config_file.read_text()))
    defaults = MeshConfig()
    for section in ("engine", "routing", "admission", "kv"):  # the test means something only away from defaults
        given = yaml.safe_load(config_file.read_text())[section]
        same = [k for k in given if getattr(getattr(defaults, section), k) == getattr(getattr(cfg, section), k)]
        assert not same, f"{section}: {same} equal their defaults"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    ports = {name: free_port() for name in SERVICES}
    env |= {"ROUTER_ADDR": f"127.0.0.1:{ports['router']}", "KVSTORE_ADDR": f"127.0.0.1:{ports['kvstore']}",
            "KVSTORE_INSTANCE": f"cfgtest{ports['kvstore']}"}
    procs = {}
    try:
        for name, (module, port_env, _) in SERVICES.items():
            log = tmp_path / f"{name.replace(' ', '-')}.log"
            procs[name] = (subprocess.Popen([sys.executable, "-m", *module, "--config", str(config_file)],
                                            env={**env, port_env: str(ports[name])}, stdout=open(log, "wb"),
                                            stderr=subprocess.STDOUT, start_new_session=True), log)
        for name, (_, _, owns) in SERVICES.items():
            proc, log = procs[name]

            def announced(log=log, name=name):
                m = re.search(rf"^{name} config: (\{{.*\}})$", log.read_text(errors="replace"), re.M)
                return m and json.loads(m.group(1))
            got = wait_for(announced, 180, f"{name}'s config line", alive=lambda p=proc: p.poll() is None)
            assert got == owned(cfg, *owns), name  # cfg: the file's, validated here
    finally:
        for proc, _ in procs.values():
            signal_group(proc, 15)
        for proc, _ in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                signal_group(proc, 9)
                proc.wait()
