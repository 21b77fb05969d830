"""`meshserve up`'s defaults per machine (services.policy.machine): bfloat16 where the CPU has native bfloat16 dot
products, one unified worker on fewer than 4 cores; and only where the config leaves the choice open."""

import pytest

from services.config.sections import MeshConfig
from services.mesh.up import machine_defaults
from services.policy.machine import serving_defaults


@pytest.mark.parametrize("level, cores, mode, dtype, quantization", [
    ("amx", 2, "unified", "bfloat16", "none"),
    ("avx512_bf16", 2, "unified", "bfloat16", "none"),
    ("avx512_bf16", 3, "unified", "bfloat16", "none"),
    ("avx512_bf16", 4, "disaggregated", "bfloat16", "none"),
    ("avx512", 2, "unified", "float32", "auto"),  # Skylake: bfloat16 would be emulated
    ("avx2", 16, "disaggregated", "float32", "auto"),
    ("generic", 1, "unified", "float32", "auto"),
])
def test_the_defaults_follow_the_cpus_level_and_cores(level, cores, mode, dtype, quantization):
    d = serving_defaults(level, cores)
    assert (d.mode, d.dtype, d.quantization) == (mode, dtype, quantization)
    assert d.unified_threads == cores
    assert [setting for setting, _ in d.reasons] == [f"engine.dtype {dtype}", f"mesh.mode {mode}"]
    assert all(why for _, why in d.reasons)


def test_an_open_config_takes_them_all_says_why_and_hands_the_workers_flags(tmp_path):
    from argparse import Namespace

    from services.mesh.up import mesh_spec

    cfg, chosen, lines = machine_defaults(MeshConfig(), "avx512_bf16", 2, 0.36)
    assert (cfg.mesh.mode, cfg.engine.dtype, cfg.engine.quantization, cfg.engine.threads) == \
        ("unified", "bfloat16", "none", 2)
    assert cfg.engine.kv_cache_gb == pytest.approx(1.08)  # what the split's three workers would have had
    assert len(lines) == 2 and "native bfloat16" in lines[0] and "one worker with every core" in lines[1]
    args = Namespace(port=0, http_port=0, router_port=0, kvstore_port=0, config=None, served_model_name=None)
    spec = mesh_spec(cfg, tmp_path, args, chosen)  # the workers read only the file: what up chose goes as flags
    assert spec.engine_args == ["--dtype", "bfloat16", "--quantization", "none", "--kv-cache-gb", "1.08"]
    assert (spec.mode, spec.unified, spec.threads) == ("unified", 1, 2)


@pytest.mark.parametrize("raw, kept", [
    ({"engine": {"dtype": "float32"}}, "weights"),
    ({"engine": {"quantization": "gguf"}}, "weights"),
    ({"mesh": {"mode": "disaggregated"}}, "topology"),
    ({"mesh": {"decode": 3}}, "topology"),
    ({"autoscaler": {"enabled": True}}, "topology"),
    ({"engine": {"tensor_parallel_size": 2}}, "topology"),
])
def test_what_the_config_sets_is_kept(raw, kept):
    user = MeshConfig.model_validate(raw)
    cfg, _, lines = machine_defaults(user, "avx512_bf16", 2, 0.36)
    if kept == "weights":
        assert (cfg.engine.dtype, cfg.engine.quantization) == (user.engine.dtype, user.engine.quantization)
        assert cfg.mesh.mode == "unified" and len(lines) == 1
    else:
        assert cfg.mesh.model_dump() == user.mesh.model_dump() and cfg.engine.threads == user.engine.threads
        assert cfg.engine.dtype == "bfloat16" and len(lines) == 1


def test_a_sized_pool_and_threads_are_kept_in_the_unified_default():
    user = MeshConfig.model_validate({"engine": {"kv_cache_gb": 0.5, "threads": 1}})
    cfg, chosen, _ = machine_defaults(user, "avx2", 2, 0.36)
    assert (cfg.mesh.mode, cfg.engine.kv_cache_gb, cfg.engine.threads) == ("unified", 0.5, 1)
    assert chosen == {"dtype": "float32", "quantization": "auto"}
