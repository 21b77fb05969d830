"""The environment variables meshserve reads: one registry (services/common/envs.py), the docs' table the same,
no reads elsewhere, the legacy aliases still working with one warning."""

import ast
import logging
from pathlib import Path

import pytest

from services.common import envs

ROOT = Path(__file__).resolve().parents[2]
# Reads of the process environment that are not settings: the compiler search path the kernels extend.
NOT_SETTINGS = {("services/engine/layers/kernels.py", "PATH")}


def test_the_operations_table_is_the_registry():
    docs = (ROOT / "docs" / "OPERATIONS.md").read_text()
    assert envs.table() in docs, "docs/OPERATIONS.md: paste `python -m services.common.envs` over its table"


def _reads(path: Path):
    """(line, name or None) for every read of os.environ / os.getenv in a module (writes and copies are not reads)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            is_environ_get = (f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "environ")
            is_getenv = f.attr == "getenv"
            if is_environ_get or is_getenv:
                arg = node.args[0] if node.args else None
                yield node.lineno, arg.value if isinstance(arg, ast.Constant) else None
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and isinstance(node.value, ast.Attribute) and node.value.attr == "environ"):
            key = node.slice
            yield node.lineno, key.value if isinstance(key, ast.Constant) else None


def test_services_read_the_environment_only_through_the_registry():
    stray = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "services/common/envs.py" or "/pb/" in rel:
            continue
        stray += [f"{rel}:{line}: {name}" for line, name in _reads(path) if (rel, name) not in NOT_SETTINGS]
    assert not stray, "read these through services/common/envs.py (and list them there):\n" + "\n".join(stray)


def test_the_scan_finds_a_read(tmp_path):
    """The check above can fail: it sees each form of read."""
    sample = tmp_path / "sample.py"
    sample.write_text('import os\na = os.environ.get("X")\nb = os.environ["Y"]\nc = os.getenv("Z")\n'
                      'os.environ["W"] = "1"\n')
    assert [name for _, name in _reads(sample)] == ["X", "Y", "Z"]


def test_typed_values_and_defaults():
    assert envs.STARTUP_DELAY_S.get({}) == 0.0
    assert envs.STARTUP_DELAY_S.get({"MESHSERVE_STARTUP_DELAY_S": "2.5"}) == 2.5
    assert envs.GATEWAY_HTTP_PORT.get({}) is None
    assert envs.GATEWAY_HTTP_PORT.get({}, default=8000) == 8000
    assert envs.GATEWAY_HTTP_PORT.get({"GATEWAY_HTTP_PORT": "0"}) == 0
    assert envs.KERNELS.is_off({"MESHSERVE_KERNELS": "0"}) and not envs.KERNELS.is_off({})
    with pytest.raises(ValueError, match=r"GATEWAY_HTTP_PORT='eighty': not a valid int"):
        envs.GATEWAY_HTTP_PORT.get({"GATEWAY_HTTP_PORT": "eighty"})


def test_a_legacy_alias_still_sets_its_key_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(envs, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=envs.__name__):
        assert envs.KV_POOL.get({"KV_POOL": "true"}) is True
        assert envs.KV_POOL.get({"KV_POOL": "1"}) is True
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["KV_POOL is a legacy alias of the config key kv.pool; set MESHSERVE_KV__POOL or the key in "
                        "the mesh file instead"]


def test_config_keys_are_the_prefixed_double_underscore_names():
    seen = envs.config_keys({"MESHSERVE_ENGINE__MAX_NUM_SEQS": "64", "MESHSERVE_MODEL": "x", "OTHER__A": "1"})
    assert seen == {"engine__max_num_seqs": "64"}
