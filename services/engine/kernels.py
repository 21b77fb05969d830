"""Optional compiled CPU kernels, built on first use with torch's C++ extension loader.

The engine runs without them (pure PyTorch), and uses them when the build succeeds:
MESHSERVE_KERNELS=0 turns them off.

Each kernel is built per vector ISA level (ISA_LEVELS: avx512, avx2, generic), and the dispatcher
(pick_isa) takes the widest level whose instructions the CPU has (/proc/cpuinfo flags), or the one
MESHSERVE_ISA names when the CPU can run it. Built objects are cached by torch
(TORCH_EXTENSIONS_DIR) under a name that carries the level, so one cache serves several levels and
a machine never runs code compiled for instructions it lacks.
"""

from __future__ import annotations

import logging
import os
import time
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


ISA_LEVELS = ("avx512", "avx2", "generic")  # widest first
ISA_NEEDS = {  # /proc/cpuinfo flags each level's code uses
    "avx512": frozenset({"avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"}),
    "avx2": frozenset({"avx2", "fma"}),
    "generic": frozenset(),
}
ISA_CFLAGS = {
    "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mprefer-vector-width=512"],
    "avx2": ["-mavx2", "-mfma"],
    "generic": [],
}


def cpu_flags() -> frozenset:
    try:
        return frozenset(next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo")
                               if ln.startswith("flags")), []))
    except OSError:
        return frozenset()


def supported_isas(flags: frozenset) -> list[str]:
    """The levels a CPU with these flags can execute, widest first (generic always)."""
    return [isa for isa in ISA_LEVELS if ISA_NEEDS[isa] <= flags]


def pick_isa(flags: frozenset, requested: str | None = None) -> str:
    """The level to run: the requested one if the CPU supports it, else the widest it supports."""
    supported = supported_isas(flags)
    if requested:
        if requested not in ISA_LEVELS:
            raise ValueError(f"MESHSERVE_ISA={requested!r}: unknown (levels: {', '.join(ISA_LEVELS)})")
        if requested in supported:
            return requested
        log.warning("MESHSERVE_ISA=%s: this CPU lacks %s; using %s", requested,
                    " ".join(sorted(ISA_NEEDS[requested] - flags)), supported[0])
    return supported[0]


def host_isa() -> str:
    return pick_isa(cpu_flags(), os.environ.get("MESHSERVE_ISA"))


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


STALE_LOCK_S = 600.0  # a build takes a minute or two; a lock older than this was left by a build that was killed


def _clear_stale_lock(lock: Path) -> None:
    """torch's build lock outlives a build killed midway, and every later load() then waits on it forever (every
    worker started afterwards hung in its start-up): a lock older than STALE_LOCK_S is removed, with a warning."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale kernel build lock %s (%.0f s old: its build was killed)", lock, age)
        lock.unlink(missing_ok=True)


def _build(name: str, source: str, cflags: list[str], what: str):
    """The compiled module, or None when disabled or the build fails (the reason is logged)."""
    if os.environ.get("MESHSERVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        _put_ninja_on_path()
        _clear_stale_lock(Path(_get_build_directory(name, verbose=False)) / "lock")
        return load(name=name, sources=[str(CSRC / source)], extra_cflags=cflags, verbose=False)
    except Exception as e:  # a missing compiler or ninja: fall back to PyTorch, loudly
        log.warning("%s kernel unavailable, using PyTorch: %s", what, e)
        return None


@cache
def paged_attention(isa: str | None = None):
    """The paged decode attention kernel (csrc/paged_attention.cpp) for isa (default: host_isa()), or None."""
    isa = isa or host_isa()
    return _build(f"meshserve_paged_attention_{isa}", "paged_attention.cpp",
                  ["-O3", "-ffast-math", "-fopenmp", *ISA_CFLAGS[isa]], f"paged attention ({isa})")


@cache
def sampler(isa: str | None = None):
    """The fused sampling kernel (csrc/sampler.cpp) for isa (default: host_isa()), or None.

    Built without -ffast-math and with -ffp-contract=off: its noise must match the PyTorch
    fallback bit for bit (services/engine/sampler.py), on every level."""
    isa = isa or host_isa()
    return _build(f"meshserve_sampler_{isa}", "sampler.cpp",
                  ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", *ISA_CFLAGS[isa]],
                  f"sampling ({isa})")


@cache
def layer_ops(isa: str | None = None):
    """The fused elementwise layer ops (csrc/layer_ops.cpp: rotary, residual + RMSNorm, SiLU-and-mul) for
    isa (default: host_isa()), or None. No FMA contraction, so products round as PyTorch's do."""
    isa = isa or host_isa()
    return _build(f"meshserve_layer_ops_{isa}", "layer_ops.cpp",
                  ["-O3", "-ffast-math", "-ffp-contract=off", "-fopenmp", *ISA_CFLAGS[isa]],
                  f"layer ops ({isa})")


@cache
def lora(isa: str | None = None):
    """The segmented LoRA kernel (csrc/lora.cpp) for isa (default: host_isa()), or None."""
    isa = isa or host_isa()
    return _build(f"meshserve_lora_{isa}", "lora.cpp", ["-O3", "-ffast-math", *ISA_CFLAGS[isa]], f"LoRA ({isa})")
