"""The generated stubs match protos/, and the boundaries hold: no torch in light services."""

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the proto generator and every service's --help as processes

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_protos(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)], check=True)
    fenced = ROOT / "services" / "common" / "pb"
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".py", ".pyi"))
    assert names == sorted(p.name for p in fenced.iterdir() if p.suffix in (".py", ".pyi"))
    for name in names:
        assert filecmp.cmp(tmp_path / name, fenced / name, shallow=False), (
            f"services/common/pb/{name} is stale: run python scripts/gen_protos.py")


@pytest.mark.parametrize("module", ["services.gateway.server", "services.router.__main__", "services.kvstore.__main__",
                                    "services.common.rpc", "services.policy.routing.policies"])
def test_light_services_never_import_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


@pytest.mark.parametrize("service", ["gateway", "router", "kvstore", "prefill", "decode", "worker"])
def test_every_service_has_help(service):
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], capture_output=True, text=True,
                          env={"MESHSERVE_MODEL": "unused", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--port" in proc.stdout
