"""Optional compiled CPU kernels, built on first use with torch's C++ extension loader.

The engine runs without them (pure PyTorch), and uses them when the build succeeds:
MESHSERVE_KERNELS=0 turns them off. Built objects are cached by torch (TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


def _cpu_flags() -> list[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return [f"-m{f}" for f in ("avx2", "fma") if f" {f}" in info]


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


@cache
def paged_attention():
    """The compiled module, or None when disabled or the build fails (the reason is logged)."""
    if os.environ.get("MESHSERVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        return load(name="meshserve_paged_attention", sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-ffast-math", "-fopenmp", *_cpu_flags()], verbose=False)
    except Exception as e:  # a missing compiler or ninja: fall back to PyTorch, loudly
        log.warning("paged attention kernel unavailable, using PyTorch attention: %s", e)
        return None
