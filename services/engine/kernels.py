"""Optional compiled CPU kernels, built on first use with torch's C++ extension loader.

The engine runs without them (pure PyTorch), and uses them when the build succeeds:
MESHSERVE_KERNELS=0 turns them off. Built objects are cached by torch (TORCH_EXTENSIONS_DIR),
keyed by source and flags, so a machine with another vector ISA builds its own.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


def _cpu_flags(wide: bool = False) -> list[str]:
    """-m flags for the host's vector ISA: AVX2/FMA, and with wide=True AVX-512 (512-bit vectors)."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    names = ["avx2", "fma"] + (["avx512f", "avx512dq", "avx512bw", "avx512vl"] if wide else [])
    flags = [f"-m{f}" for f in names if f in words]
    if "-mavx512f" in flags:
        flags.append("-mprefer-vector-width=512")
    return flags


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pinned ninja wheel lives in this interpreter's environment."""
    import sys

    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join(dirs + [os.environ.get("PATH", "")])


def _build(name: str, source: str, cflags: list[str], what: str):
    """The compiled module, or None when disabled or the build fails (the reason is logged)."""
    if os.environ.get("MESHSERVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        return load(name=name, sources=[str(CSRC / source)], extra_cflags=cflags, verbose=False)
    except Exception as e:  # a missing compiler or ninja: fall back to PyTorch, loudly
        log.warning("%s kernel unavailable, using PyTorch: %s", what, e)
        return None


@cache
def paged_attention():
    """The paged decode attention kernel (csrc/paged_attention.cpp), or None."""
    return _build("meshserve_paged_attention", "paged_attention.cpp",
                  ["-O3", "-ffast-math", "-fopenmp", *_cpu_flags(wide=True)], "paged attention")


@cache
def sampler():
    """The fused sampling kernel (csrc/sampler.cpp), or None.

    Built without -ffast-math and with -ffp-contract=off: its noise must match the PyTorch
    fallback bit for bit (services/engine/sampler.py)."""
    return _build("meshserve_sampler", "sampler.cpp",
                  ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", *_cpu_flags(wide=True)], "sampling")
