"""The mesh config file: YAML and TOML, one model per section, errors naming file, section and key."""

import json
import subprocess
import sys

import pytest

from services.config.loader import ConfigError, load_mesh_config


def test_yaml_and_toml(tmp_path):
    y = tmp_path / "mesh.yaml"
    y.write_text("mesh: {mode: unified, unified: 2}\nengine: {kv_cache_gb: 0.1, block_size: 8}\n")
    t = tmp_path / "mesh.toml"
    t.write_text("[mesh]\nmode = 'unified'\nunified = 2\n[engine]\nkv_cache_gb = 0.1\nblock_size = 8\n")
    assert load_mesh_config(str(y), env={}) == load_mesh_config(str(t), env={})
    cfg = load_mesh_config(str(y), env={})
    assert (cfg.mesh.mode, cfg.mesh.unified, cfg.engine.kv_cache_gb, cfg.engine.block_size) == ("unified", 2, 0.1, 8)
    assert cfg.engine.max_num_seqs == 256 and cfg.routing.policy == "least-outstanding"


@pytest.mark.parametrize("text,fragment", [
    # unknown key or section
    ("autoscaler2: {}\n", "autoscaler2: unknown section"),
    ("mesh: {workers: 3}\n",
     "mesh.workers: unknown key (known: model, served_model_name, mode, prefill, decode, unified, router, tls, "
     "public_tls, worker_pools, hosts, control_address)"),
    ("engine: {blocksize: 8}\n", "engine.blocksize: unknown key"),
    ("routing: {guard: {absolute: 1}}\n", "routing.guard.absolute: unknown key (known: abs, rel)"),
    # wrong type
    ("engine: {max_num_seqs: many}\n", "engine.max_num_seqs: input should be a valid integer"),
    ("mesh: [1, 2]\n", "mesh: input should be a valid dictionary"),
    ("tenants: {}\n", "tenants must be a list"),
    # bad value
    ("engine: {max_num_seqs: -1}\n", "engine.max_num_seqs: input should be greater than 0 (got -1)"),
    ("mesh: {mode: sideways}\n", "mesh.mode: input should be 'disaggregated' or 'unified'"),
    ("mesh: {tls: false, public_tls: true}\n", "public_tls needs tls"),
    ("admission: {policy: lottery}\n", "admission.policy: unknown arbitration policy"),
    ("engine: {slot_policy: lottery}\n", "engine.slot_policy: unknown arbitration policy"),
    ("routing: {policy: prefix-aware, weights: {cache: 1}}\n", "routing.weights: unknown scorer"),
    ("tenants: [{name: a}]\n", "api_key_hashes is required"),
    ("tenants: [{name: a, api_key_hashes: [x]}]\n", "is not sha256$"),
    ("tenants: [{name: a, api_key_hashes: ['sha256$00$00'], wieght: 2}]\n",
     "tenants.0.wieght: unknown key (known: name, api_key_hashes, weight, limits,"),
    ("tenants: [{name: a, api_key_hashes: ['sha256$00$00'], limits: {max_concurrent: 0}}]\n",
     "tenants.0.limits.max_concurrent: input should be greater than 0"),
    ("tenants: [{name: a, api_key_hashes: ['sha256$00$00'], weight: true}]\n",
     "tenants.0.weight: must be a number > 0"),
    ("tenants: [{name: a, api_key_hashes: ['sha256$00$00']}, {name: a, api_key_hashes: ['sha256$11$11']}]\n",
     "tenant 'a' is defined twice"),
    # renamed keys say where they went; a file that does not parse says so
    ("mesh: {policy: prefix-aware}\n", "mesh.policy is now routing.policy"),
    ("engine: {policy: fcfs}\n", "engine.policy is now engine.slot_policy"),
    ("mesh: {mode: [\n", "cannot parse"),
    # named pools of workers (an adapter group's): a name, a role that fits the mode, a role the autoscaler knows
    ("mesh: {worker_pools: {Lora_A: {role: decode}}}\n", "worker pool 'Lora_A': a pool is a role"),
    ("mesh: {worker_pools: {lora-a: {role: unified}}}\n", "a unified pool in disaggregated mode"),
    ("mesh: {worker_pools: {decode: {role: decode}}}\n", "the role's own pool is sized by mesh.decode"),
    ("autoscaler: {pools: {lora-a: {}}}\n", "give autoscaler.pools.lora-a.role"),
    ("mesh: {worker_pools: {lora-a: {role: decode}}}\nautoscaler: {pools: {lora-a: {role: prefill}}}\n",
     "autoscaler.pools.lora-a.role prefill but its workers are decode"),
])
def test_errors_name_the_file_section_and_key(tmp_path, text, fragment):
    f = tmp_path / "mesh.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_mesh_config(str(f), env={})
    assert fragment in str(exc.value) and "mesh.yaml" in str(exc.value), str(exc.value)


def test_environment_and_flags_override_the_file_in_that_order(tmp_path):
    f = tmp_path / "mesh.yaml"
    f.write_text("engine: {max_num_seqs: 8, block_size: 8}\n")
    env = {"MESHSERVE_ENGINE__MAX_NUM_SEQS": "16", "MESHSERVE_ENGINE__BLOCK_SIZE": "32", "OTHER": "x"}
    cfg = load_mesh_config(str(f), {"engine": {"max_num_seqs": 64}}, env=env)
    assert (cfg.engine.max_num_seqs, cfg.engine.block_size) == (64, 32)
    with pytest.raises(ConfigError, match="environment: engine.block_size: input should be greater than 0"):
        load_mesh_config(str(f), env={"MESHSERVE_ENGINE__BLOCK_SIZE": "0"})
    with pytest.raises(ConfigError, match="flags: engine.max_num_seqs"):
        load_mesh_config(str(f), {"engine": {"max_num_seqs": 0}}, env={})


SERVICES = ["services.gateway", "services.router", "services.kvstore", "services.worker", "services.prefill",
            "services.decode"]
SECTIONS = {"services.gateway": "admission", "services.router": "routing", "services.worker": "engine",
            "services.prefill": "engine", "services.decode": "engine"}


@pytest.mark.parametrize("module", SERVICES)
def test_every_service_takes_the_config_file_and_its_sections_flags(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if module != "services.kvstore":
        assert "--config" in out.stdout
    if module in SECTIONS:
        assert f"the mesh file's {SECTIONS[module]} section" in out.stdout


def test_services_refuse_a_bad_config_file_at_startup_naming_the_key(tmp_path):
    f = tmp_path / "mesh.yaml"
    f.write_text("engine: {max_num_seqs: 0}\nrouting: {policy: nearest}\nadmission: {starvation_s: -1}\n")
    for module, key, extra in (("services.router", "routing.policy", []),
                               ("services.gateway", "admission.starvation_s", ["--model", str(tmp_path)]),
                               ("services.worker", "engine.max_num_seqs", ["--model", str(tmp_path), "--role",
                                                                           "unified"])):
        out = subprocess.run([sys.executable, "-m", module, "--config", str(f), *extra],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "mesh.yaml" in out.stderr and key in out.stderr, (module, out.stderr)


def test_up_gives_each_worker_a_small_pool_unless_the_config_sizes_it(tmp_path):
    from argparse import Namespace

    from services.mesh.up import mesh_spec

    args = Namespace(port=0, http_port=0, router_port=0, kvstore_port=0, config=None, served_model_name=None)
    assert mesh_spec(load_mesh_config(None, env={}), tmp_path, args).engine_args == ["--kv-cache-gb", "0.25"]
    sized = load_mesh_config(None, {"engine": {"kv_cache_gb": 1.5, "threads": 2}}, env={})
    spec = mesh_spec(sized, tmp_path, args)
    assert spec.engine_args == [] and spec.threads == 2
    routed = load_mesh_config(None, {"routing": {"policy": "prefix-aware", "weights": {"prefix": 2.0}}}, env={})
    spec = mesh_spec(routed, tmp_path, args)
    assert spec.policy == "prefix-aware" and spec.routing["weights"] == {"prefix": 2.0}
    (tmp_path / "config.json").write_text(json.dumps({  # SmolLM2-135M: its 8,192-token context needs 0.36 GB
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "max_position_embeddings": 8192}))
    assert mesh_spec(load_mesh_config(None, env={}), tmp_path, args).engine_args == ["--kv-cache-gb", "0.36"]
    named = load_mesh_config(None, {"mesh": {"served_model_name": ["smol", "gpt-x"]}}, env={})
    assert mesh_spec(named, tmp_path, args).gateway_args == ["--served-model-name", "smol", "gpt-x"]
    flagged = Namespace(**{**vars(args), "served_model_name": ["mine"]})
    assert mesh_spec(named, tmp_path, flagged).gateway_args == ["--served-model-name", "mine"]
    pooled = mesh_spec(load_mesh_config(None, {"kv": {"pool": True, "transport": "grpc", "budget_gb": 2}}, env={}),
                       tmp_path, args)
    assert (pooled.kv_pool, pooled.kv_transport, pooled.kvstore_budget_gb) == (True, "grpc", 2.0)
    with pytest.raises(ConfigError, match="kv.transport"):
        load_mesh_config(None, {"kv": {"transport": "rdma"}}, env={})
    grouped = load_mesh_config(None, {"mesh": {"worker_pools": {"sql": {"role": "decode", "replicas": 0, "args": [
        "--lora-modules", '{"sql": "adapters/sql"}']}}}}, env={})
    assert mesh_spec(grouped, tmp_path, args).worker_pools == {
        "sql": {"role": "decode", "replicas": 0, "args": ["--lora-modules", '{"sql": "adapters/sql"}']}}
    assert grouped.pool_role("sql") == "decode" and grouped.pool_role("prefill") == "prefill"


def test_up_places_workers_on_the_hosts_of_the_mesh_file(tmp_path):
    """mesh.hosts and engine.tensor_parallel_size reach the launcher, which counts a replica's cores as ranks x
    threads; duplicate host names are refused naming the key."""
    from argparse import Namespace

    from services.mesh.launcher import flag_value
    from services.mesh.up import mesh_spec
    from services.policy.placement import Host

    args = Namespace(port=0, http_port=0, router_port=0, kvstore_port=0, config=None, served_model_name=None)
    cfg = load_mesh_config(None, {"engine": {"tensor_parallel_size": 2, "threads": 2}, "mesh": {
        "control_address": "10.0.0.1", "hosts": [{"name": "a", "cores": 8, "address": "10.0.0.2", "netns": "nsa"},
                                                 {"name": "b", "cores": 4, "rack": "r2"}]}}, env={})
    spec = mesh_spec(cfg, tmp_path, args)
    assert spec.hosts == [Host("a", 8, address="10.0.0.2", netns="nsa"), Host("b", 4, rack="r2")]
    assert (spec.control_address, spec.tensor_parallel_size, spec.threads) == ("10.0.0.1", 2, 2)
    assert spec.hosts[1].topology == "r2/b/"
    assert flag_value(["--x", "1", "--tensor-parallel-size", "3"], "--tensor-parallel-size", 1) == 3
    assert flag_value(["--tensor-parallel-size=4"], "--tensor-parallel-size", 1) == 4
    with pytest.raises(ConfigError, match="host names must be unique"):
        load_mesh_config(None, {"mesh": {"hosts": [{"name": "a", "cores": 1}, {"name": "a", "cores": 2}]}}, env={})


def test_wire_salts_are_keyed_by_the_secret_not_the_tenant_name():
    from services.policy.tenants import wire_salt

    a, b = wire_salt(b"s1", "tenant:alice"), wire_salt(b"s2", "tenant:alice")
    assert a == wire_salt(b"s1", "tenant:alice") and a != b  # stable under one secret, unrelated under another
    assert "alice" not in a and a != "tenant:alice" and a != wire_salt(b"s1", "tenant:bob")
    assert wire_salt(b"s1", "") == ""  # the open default tenant shares one cache


def test_the_omp_wait_policies_as_libgomp_variables():
    from services.worker.core_client import set_omp_wait_policy

    env = {}
    set_omp_wait_policy("spin", env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
    env = {"GOMP_SPINCOUNT": "500"}  # the user's own count wins
    set_omp_wait_policy("spin", env)
    assert env["GOMP_SPINCOUNT"] == "500"
    env = {}
    set_omp_wait_policy("active", env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    set_omp_wait_policy("passive", env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_restart_keeps_the_metrics_port_unless_that_start_failed_too():
    from services.mesh.launcher import same_metrics_port

    args = ["python", "-m", "services.router", "--port", "5", "--metrics-port", "0", "--x"]
    url = "http://127.0.0.1:41713/metrics"
    assert same_metrics_port(args, url, failures=1) == [*args[:5], "--metrics-port", "41713", "--x"]
    again = same_metrics_port(same_metrics_port(args, url, 1), "", failures=2)  # failed again: any free port
    assert again == args
    assert same_metrics_port(args, "", failures=1) == args  # never printed one: any port, as at first
