"""Optional compiled CPU kernels, built on first use with torch's C++ extension loader.

The engine runs without them (pure PyTorch), and uses them when the build succeeds:
MESHSERVE_KERNELS=0 turns them off.

Each kernel is built per vector ISA level (ISA_LEVELS: avx512, avx2, generic), and the dispatcher
(pick_isa) takes the widest level whose instructions the CPU has (/proc/cpuinfo flags), or the one
MESHSERVE_ISA names when the CPU can run it. Built objects are cached by torch
(TORCH_EXTENSIONS_DIR) under a name that carries the level, so one cache serves several levels and
a machine never runs code compiled for instructions it lacks, and in a folder per torch installation, so
that two environments never rebuild each other's objects mid-run.

They are built when the project is installed (scripts/setup.sh runs `python -m services.engine.kernels`),
so that a start compiles nothing. A build at run time (a new ISA, a changed source) says so on the log
first. Builds are serialized by an advisory lock (flock) that dies with its holder: torch's own lock file
of a build that was killed midway is removed at once instead of being waited on forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
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


def build_directory(name: str) -> Path:
    """Where kernel `name` is built and cached: torch's extension root (TORCH_EXTENSIONS_DIR, or its default), in a
    folder per torch installation: torch writes the include paths of the interpreter that builds into its ninja
    file, so a process of another environment sharing the folder rebuilt the kernels under a running one."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    tag = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:10]
    return root / f"meshserve-torch-{tag}" / name


def _built(folder: Path, name: str) -> bool:
    return (folder / f"{name}.so").exists()


class _BuildLock:
    """An advisory lock (flock) beside a kernel's build folder, held around torch's build: the kernel releases
    it when its holder dies, however it dies. Holding it, a torch lock file in the folder was left by a
    build that was killed (every build of ours runs under this lock) and is removed."""

    def __init__(self, folder: Path, what: str):
        self.folder, self.what = folder, what
        self.path = folder.with_name(folder.name + ".meshserve-lock")
        self.fd = -1

    def __enter__(self) -> _BuildLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            log.info("waiting for process %s, which is building or loading the %s kernel", holder, self.what)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        stale = self.folder / "lock"
        if stale.exists():
            log.warning("removing %s: a build of the %s kernel was killed midway and left it", stale, self.what)
            stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # releases the flock


def _build(name: str, source: str, cflags: list[str], what: str):
    """The compiled module, or None when disabled or the build fails (the reason is logged)."""
    if os.environ.get("MESHSERVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        folder = build_directory(name)
        with _BuildLock(folder, what):
            if not _built(folder, name):
                log.warning("building the %s kernel (C++, about a minute; `python -m services.engine.kernels` builds "
                            "every kernel ahead, as scripts/setup.sh does)", what)
            folder.mkdir(parents=True, exist_ok=True)
            return load(name=name, sources=[str(CSRC / source)], extra_cflags=cflags, build_directory=str(folder),
                        verbose=False)
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


@cache
def quant_linear(isa: str | None = None):
    """Weight-only quantized linear layers over GGUF's Q4_0, Q4_1 and Q8_0 blocks (csrc/quant_linear.cpp) for isa
    (default: host_isa()), or None. F16C (float16 scales) comes with every AVX2 and AVX-512 CPU."""
    isa = isa or host_isa()
    f16c = ["-mf16c"] if isa != "generic" else []
    return _build(f"meshserve_quant_linear_{isa}", "quant_linear.cpp",
                  ["-O3", "-fopenmp", "-ffp-contract=fast", *ISA_CFLAGS[isa], *f16c],
                  f"quantized linear ({isa})")


@cache
def allreduce(isa: str | None = None):
    """The shared-memory all-reduce of a tensor-parallel group on one host (csrc/allreduce.cpp), or None. No
    -ffast-math: every rank must add in the same order, to the same bits."""
    isa = isa or host_isa()
    return _build(f"meshserve_allreduce_{isa}", "allreduce.cpp", ["-O3", "-ffp-contract=off", *ISA_CFLAGS[isa]],
                  f"all-reduce ({isa})")


KERNELS = (paged_attention, sampler, layer_ops, lora, quant_linear, allreduce)


def build_all(isa: str | None = None) -> dict[str, bool]:
    """Build (or find built) every kernel for isa (default: host_isa()); {kernel: usable}."""
    return {k.__name__: k(isa) is not None for k in KERNELS}


def main() -> int:
    """python -m services.engine.kernels [--strict]: build every kernel for this CPU now (scripts/setup.sh runs it;
    the Dockerfile with --strict: a kernel that does not build fails the image instead of running PyTorch's path)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if os.environ.get("MESHSERVE_KERNELS", "1") == "0":
        print("MESHSERVE_KERNELS=0: the kernels are off; nothing to build")
        return 0
    isa = host_isa()
    built = build_all(isa)
    print(f"kernels for {isa}: " + ", ".join(f"{k} {'ready' if ok else 'UNAVAILABLE (PyTorch fallback)'}"
                                             for k, ok in built.items()))
    return 1 if "--strict" in sys.argv[1:] and not all(built.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
