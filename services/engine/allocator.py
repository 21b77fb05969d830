"""glibc's allocator set for the engine's large, short-lived tensors.

A prefill step of 2,048 tokens allocates and frees buffers of 1-13 MB per layer (the fused gate/up projection's
output alone is 12.6 MB in bfloat16 on SmolLM2). glibc serves allocations above its mmap threshold with fresh
mappings and returns the top of the heap to the kernel above its trim threshold; both thresholds start low and
adapt only as large blocks are freed, so for the first minutes of a process every such buffer was new memory and
the GEMMs writing into it took the page faults: engine-mixed's 256 prompts ran in 14-16 s in a fresh process
against 11-12 s in one that had already served them (oneDNN's own kernel builds were 47 ms of that). Fixing the
thresholds from the start (what vLLM's CPU backend gets from tcmalloc, which the PyTorch CPU tuning guide also
recommends) removes the difference: 12.0 s and 12.1 s. Freed memory up to the trim threshold stays with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from services.common import envs

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 1024**2  # glibc's largest: buffers under 32 MB come from the heap
TRIM_THRESHOLD = 256 * 1024**2  # free heap kept before memory goes back to the kernel


def keep_large_buffers() -> bool:
    """Set the thresholds above (each engine calls it at construction; setting them again changes nothing;
    MESHSERVE_MALLOPT=0 leaves glibc's defaults). False where the C library is not glibc or refuses."""
    if envs.MALLOPT.is_off():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("mallopt refused the allocator thresholds; large buffers may be mapped afresh each step")
    return done
