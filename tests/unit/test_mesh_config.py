"""The mesh config file: YAML and TOML, with clear errors for what it does not know."""

import pytest

from services.up import load_config


def test_yaml_and_toml(tmp_path):
    y = tmp_path / "mesh.yaml"
    y.write_text("mesh: {mode: unified, unified: 2}\nengine: {kv_cache_gb: 0.1, block_size: 8}\n")
    t = tmp_path / "mesh.toml"
    t.write_text("[mesh]\nmode = 'unified'\nunified = 2\n[engine]\nkv_cache_gb = 0.1\nblock_size = 8\n")
    assert load_config(str(y)) == load_config(str(t)) == {"mesh": {"mode": "unified", "unified": 2},
                                                        "engine": {"kv_cache_gb": 0.1, "block_size": 8}}


@pytest.mark.parametrize("text,fragment", [
    ("autoscaler: {}\n", "unknown section(s) ['autoscaler']"),
    ("tenants: {}\n", "tenants must be a list"),
    ("tenants: [{name: a}]\n", "api_key_hashes is required"),
    ("tenants: [{name: a, api_key_hashes: [x]}]\n", "is not sha256$"),
    ("admission: {policy: lottery}\n", "unknown arbitration policy"),
    ("mesh: {policy: prefix-aware}\nrouting: {weights: {cache: 1}}\n", "unknown scorer"),
    ("mesh: {workers: 3}\n", "unknown key(s) ['workers'] in mesh"),
    ("engine: {blocksize: 8}\n", "unknown key(s) ['blocksize'] in engine"),
    ("mesh: [1, 2]\n", "must be a mapping"),
    ("mesh: {mode: [\n", "cannot parse"),
])
def test_errors_name_the_file_and_the_key(tmp_path, text, fragment):
    f = tmp_path / "mesh.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit) as exc:
        load_config(str(f))
    assert fragment in str(exc.value) and "mesh.yaml" in str(exc.value)
