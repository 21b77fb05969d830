"""Optional compiled CPU kernels, built on first use with torch's C++ extension loader.

The engine runs without them (pure PyTorch), and uses them when the build succeeds:
MESHSERVE_KERNELS=0 turns them off.

Each kernel is built per ISA level (ISA_LEVELS, widest first: amx, avx512_bf16, avx512, avx2, generic), and the
dispatcher (pick_isa) takes the widest level whose instructions the CPU has (/proc/cpuinfo flags; AMX only where
Linux grants this process the tile state), or the one MESHSERVE_ISA names when the CPU can run it. A level is one
code path, chosen at build time: the avx512 build holds no bfloat16 dot product and no tile instruction, so forcing
a level (MESHSERVE_ISA, or a test asking for it) runs exactly what a CPU of that level runs. A kernel whose code does
not differ between two levels is built at the lower one (KernelSpec.levels): only the attention kernel has amx and
avx512_bf16 paths (its prompt kernel on AMX tiles or on vdpbf16ps, its decode dot products on vdpbf16ps).

Built objects are cached by torch (TORCH_EXTENSIONS_DIR) under a name that carries the level, so one cache serves
several levels and a machine never runs code compiled for instructions it lacks, and in a folder per torch
installation, so that two environments never rebuild each other's objects mid-run.

They are built when the project is installed (scripts/setup.sh runs `python -m services.engine.layers.kernels`),
so that a start compiles nothing; `--all-levels` builds every level (the container image does, so that it runs on
any CPU it is pulled onto). A build at run time (a new ISA, a changed source) says so on the log first. Builds are
serialized by an advisory lock (flock) that dies with its holder: torch's own lock file of a build that was killed
midway is removed at once instead of being waited on forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from services.common import envs

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


_AVX512 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl"})
ISA_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2", "generic")  # widest first
ISA_NEEDS = {  # /proc/cpuinfo flags each level's code uses
    "amx": _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"},
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
    "avx512": _AVX512,
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}
# F16C (float16 scales of quantized weights) comes with every AVX2 and AVX-512 CPU
_AVX512_CFLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl",
                  "-mprefer-vector-width=512"]
ISA_CFLAGS = {
    "amx": [*_AVX512_CFLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    "avx512_bf16": [*_AVX512_CFLAGS, "-mavx512bf16"],
    "avx512": _AVX512_CFLAGS,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
VECTOR_LEVELS = ("avx512", "avx2", "generic")  # the levels of a kernel with no bfloat16 or tile code
_TILE_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8"})


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


def build_level(isa: str, levels: tuple = ISA_LEVELS) -> str:
    """The level a kernel built at `levels` only runs for isa: the widest of them at or below it."""
    return next(lv for lv in ISA_LEVELS[ISA_LEVELS.index(isa):] if lv in levels)


@cache
def tiles_granted() -> bool:
    """Whether Linux grants this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux 5.16
    and later; oneDNN asks the same way): without it the tile instructions fault. Asked once per process."""
    import ctypes

    try:
        sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86-64
        return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


@cache
def host_flags() -> frozenset:
    """The CPU's flags as this process may use them: AMX's only where Linux grants the tiles."""
    flags = cpu_flags()
    if flags & _TILE_FLAGS and not tiles_granted():
        log.warning("this CPU has AMX but Linux does not grant this process the tiles (kernel 5.16 or later needed): "
                    "the kernels run at the avx512_bf16 level")
        return flags - _TILE_FLAGS
    return flags


def host_isa() -> str:
    return pick_isa(host_flags(), envs.ISA.get())


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

    root = Path(envs.TORCH_EXTENSIONS_DIR.get() or get_default_build_root())
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
    if envs.KERNELS.is_off():
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        folder = build_directory(name)
        with _BuildLock(folder, what):
            if not _built(folder, name):
                log.warning("building the %s kernel (C++, 10-30 s; `python -m services.engine.layers.kernels` builds "
                            "every kernel ahead, as scripts/setup.sh does)", what)
            folder.mkdir(parents=True, exist_ok=True)
            return load(name=name, sources=[str(CSRC / source)], extra_cflags=cflags, build_directory=str(folder),
                        verbose=False)
    except Exception as e:  # a missing compiler or ninja: fall back to PyTorch, loudly
        log.warning("%s kernel unavailable, using PyTorch: %s", what, e)
        return None


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its source (csrc/), compiler flags beside its level's, what the log calls it, the levels it is
    built at."""

    source: str
    cflags: tuple
    what: str
    levels: tuple = VECTOR_LEVELS

    def module(self, isa: str) -> str:
        """The built module's name for isa: it names the level its code was built for."""
        return f"meshserve_{Path(self.source).stem}_{build_level(isa, self.levels)}"

    def load(self, isa: str | None):
        """The module for isa (default: host_isa(), read at each call: MESHSERVE_ISA set later takes effect), built
        first if need be, or None."""
        return _module(self, build_level(isa or host_isa(), self.levels))


@cache
def _module(spec: KernelSpec, level: str):
    return _build(spec.module(level), spec.source, [*spec.cflags, *ISA_CFLAGS[level]], f"{spec.what} ({level})")


SPECS = {
    # decode, and prompts (csrc/prompt_attention.h): amx and avx512_bf16 have bfloat16 paths of their own
    "paged_attention": KernelSpec("paged_attention.cpp", ("-O3", "-ffast-math", "-fopenmp"), "paged attention",
                                  ISA_LEVELS),
    # no -ffast-math and no FMA contraction: its noise must match the PyTorch fallback bit for bit, on every level
    "sampler": KernelSpec("sampler.cpp", ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"), "sampling"),
    # no FMA contraction, so products round as PyTorch's do
    "layer_ops": KernelSpec("layer_ops.cpp", ("-O3", "-ffast-math", "-ffp-contract=off", "-fopenmp"), "layer ops"),
    "lora": KernelSpec("lora.cpp", ("-O3", "-ffast-math"), "LoRA"),
    "quant_linear": KernelSpec("quant_linear.cpp", ("-O3", "-fopenmp", "-ffp-contract=fast"), "quantized linear"),
    # no -ffast-math: every rank must add in the same order, to the same bits
    "allreduce": KernelSpec("allreduce.cpp", ("-O3", "-ffp-contract=off"), "all-reduce"),
}


def paged_attention(isa: str | None = None):
    """The paged attention kernels (csrc/paged_attention.cpp: decode; prompts in csrc/prompt_attention.h) for isa
    (default: host_isa()), or None."""
    return SPECS["paged_attention"].load(isa)


def sampler(isa: str | None = None):
    """The fused sampling kernel (csrc/sampler.cpp; bit for bit the fallback of layers/sampler.py), or None."""
    return SPECS["sampler"].load(isa)


def layer_ops(isa: str | None = None):
    """The fused elementwise layer ops (csrc/layer_ops.cpp: rotary, residual + RMSNorm, SiLU-and-mul), or None."""
    return SPECS["layer_ops"].load(isa)


def lora(isa: str | None = None):
    """The segmented LoRA kernel (csrc/lora.cpp), or None."""
    return SPECS["lora"].load(isa)


def quant_linear(isa: str | None = None):
    """Weight-only quantized linear layers over GGUF's Q4_0, Q4_1 and Q8_0 blocks (csrc/quant_linear.cpp), or None."""
    return SPECS["quant_linear"].load(isa)


def allreduce(isa: str | None = None):
    """The shared-memory all-reduce of a tensor-parallel group on one host (csrc/allreduce.cpp), or None."""
    return SPECS["allreduce"].load(isa)


def build_all(isa: str | None = None) -> dict[str, bool]:
    """Build (or find built) every kernel for isa (default: host_isa()); {kernel: usable}."""
    return {name: spec.load(isa) is not None for name, spec in SPECS.items()}


def summary(isa: str | None = None) -> str:
    """Which code each kernel runs here, for a process's start-up line: the level picked and why, and each kernel's
    level where its build is on disk (nothing is loaded or built here: a start pays only for the kernels it uses),
    else that it runs PyTorch's path until one builds."""
    if envs.KERNELS.is_off():
        return "compiled kernels off (MESHSERVE_KERNELS=0): every layer runs PyTorch's path"
    isa = isa or host_isa()
    forced = envs.ISA.get()
    why = f"MESHSERVE_ISA={forced}" if forced else f"the widest this CPU runs of {', '.join(ISA_LEVELS)}"
    parts = []
    for spec in SPECS.values():
        name = spec.module(isa)
        built = _built(build_directory(name), name)
        parts.append(f"{spec.what} {build_level(isa, spec.levels) if built else 'NOT BUILT (PyTorch until it is)'}")
    return f"kernels at level {isa} ({why}): " + ", ".join(parts)


def build_every_level(levels: tuple | list = ISA_LEVELS) -> dict[str, bool]:
    """Every kernel at each of levels, a child process per level, as many at once as there are cores ({level: every
    kernel built}). A level this CPU cannot run is built all the same: its child may die loading what it built
    (an illegal instruction), and the objects on disk are what count."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = {lv: pool.submit(subprocess.run, [sys.executable, "-m", "services.engine.layers.kernels", "--level", lv],
                                capture_output=True, text=True) for lv in levels}
    done = {}
    for level, run in runs.items():
        result = run.result()
        modules = {spec.module(level): spec for spec in SPECS.values()}
        done[level] = all(_built(build_directory(m), m) for m in modules)
        if not done[level]:
            log.warning("level %s: %s", level, (result.stderr or result.stdout).strip()[-2000:])
    return done


def main() -> int:
    """python -m services.engine.layers.kernels [--strict] [--all-levels | --runnable-levels | --level LEVEL]: build
    every kernel now, for this CPU (scripts/setup.sh runs it), for every level (the container image: it runs on any
    CPU it is pulled onto), for every level this CPU runs (`setup.sh test`: the kernel tests run each of them) or for
    one. --strict: a kernel that does not build fails (the image) instead of running PyTorch's path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = sys.argv[1:]
    if envs.KERNELS.is_off():
        print("MESHSERVE_KERNELS=0: the kernels are off; nothing to build")
        return 0
    if "--all-levels" in args or "--runnable-levels" in args:
        runnable = [lv for lv in ISA_LEVELS[ISA_LEVELS.index(host_isa()):] if lv in supported_isas(cpu_flags())]
        done = build_every_level(ISA_LEVELS if "--all-levels" in args else runnable)
        print("kernels built for each level: " + ", ".join(f"{lv} {'ready' if ok else 'FAILED'}"
                                                              for lv, ok in done.items()))
        return 1 if "--strict" in args and not all(done.values()) else 0
    isa = args[args.index("--level") + 1] if "--level" in args[:-1] else host_isa()
    if isa not in ISA_LEVELS:
        print(f"unknown level {isa!r} (levels: {', '.join(ISA_LEVELS)})", file=sys.stderr)
        return 2
    built = build_all(isa)
    print(f"kernels for {isa}: " + ", ".join(f"{k} {'ready' if ok else 'UNAVAILABLE (PyTorch fallback)'}"
                                             for k, ok in built.items()))
    return 1 if "--strict" in args and not all(built.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
