"""The kernel dispatcher picks a level the CPU can execute, and every kernel at every level agrees with its
reference (the sampler bit for bit): each level is forced in turn, so one machine checks the paths the others take,
and a level this host cannot execute is skipped with the reason (tests/support/levels.py)."""

import logging

import numpy as np
import pytest
import torch

from services.engine.layers import kernels
from services.engine.layers.kernels import (
    ISA_LEVELS,
    VECTOR_LEVELS,
    allreduce,
    build_level,
    cpu_flags,
    host_isa,
    lora,
    paged_attention,
    pick_isa,
    sampler,
    supported_isas,
)
from tests.support.levels import built, force_level, runnable_levels

SKYLAKE = frozenset("fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni".split())
ZEN4 = SKYLAKE | {"avx512_bf16"}  # AMD EPYC Zen 4 and 5, Intel Cooper Lake
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
AVX2_HOST = frozenset("fpu sse2 avx avx2 fma f16c".split())  # Zen 3, Haswell to Comet Lake desktops
OLD_HOST = frozenset("fpu sse2 avx".split())
NO_DQ_HOST = AVX2_HOST | {"avx512f"}  # AVX-512 foundation only (Knights Landing): not our avx512 level


@pytest.mark.parametrize("flags, requested, want", [
    (SAPPHIRE_RAPIDS, None, "amx"), (ZEN4, None, "avx512_bf16"), (SKYLAKE, None, "avx512"),
    (AVX2_HOST, None, "avx2"), (OLD_HOST, None, "generic"), (NO_DQ_HOST, None, "avx2"), (frozenset(), None, "generic"),
    (SAPPHIRE_RAPIDS, "avx512_bf16", "avx512_bf16"), (SAPPHIRE_RAPIDS, "avx512", "avx512"), (ZEN4, "avx2", "avx2"),
    (ZEN4, "generic", "generic"),
    (ZEN4, "amx", "avx512_bf16"), (AVX2_HOST, "avx512", "avx2"),  # asked for more than the CPU has: its widest
])
def test_dispatcher_picks_a_level_the_cpu_supports(flags, requested, want):
    assert pick_isa(flags, requested) == want
    assert want in supported_isas(flags)


def test_asking_for_a_level_the_cpu_lacks_is_said(caplog):
    with caplog.at_level(logging.WARNING):
        pick_isa(ZEN4, "amx")
    assert "lacks amx_bf16 amx_tile" in caplog.text


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown"):
        pick_isa(ZEN4, "sse9")


def test_amx_the_kernel_does_not_grant_is_not_used(monkeypatch, caplog):
    """A CPU with AMX under a Linux that refuses the tile state (before 5.16, or a sandbox): the tile instructions
    would fault, so the level below runs, and the log says why."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(kernels, "tiles_granted", lambda: False)
    monkeypatch.delenv("MESHSERVE_ISA", raising=False)
    kernels.host_flags.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert host_isa() == "avx512_bf16"
        assert "does not grant" in caplog.text
    finally:
        kernels.host_flags.cache_clear()


@pytest.mark.parametrize("isa, levels, want", [
    ("amx", ISA_LEVELS, "amx"), ("avx512_bf16", ISA_LEVELS, "avx512_bf16"), ("amx", VECTOR_LEVELS, "avx512"),
    ("avx512_bf16", VECTOR_LEVELS, "avx512"), ("avx2", VECTOR_LEVELS, "avx2"), ("generic", ISA_LEVELS, "generic"),
])
def test_a_kernel_without_bfloat16_code_is_built_once_for_the_levels_above_avx512(isa, levels, want):
    assert build_level(isa, levels) == want


def test_this_host_runs_a_level_it_supports():
    assert host_isa() in supported_isas(cpu_flags())
    assert runnable_levels()[-1] == "generic" and host_isa() in runnable_levels()


# What each level's attention kernel says it runs (its start-up line): a level is one path, never another.
PROMPT_PATHS = {"amx": "AMX tiles", "avx512_bf16": "vdpbf16ps", "avx512": "AVX-512", "avx2": "AVX2", "generic": ""}
DECODE_PATHS = {"amx": "vdpbf16ps", "avx512_bf16": "vdpbf16ps", "avx512": "AVX-512 FMAs", "avx2": "plain passes",
                "generic": "plain passes"}


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_every_level_of_the_attention_kernel_takes_its_own_path_and_matches_pytorch(isa):
    from tests.support.kernel_checks import SHAPES, check_kernel_against_pytorch, check_prompt_kernel

    kernel = built(paged_attention, isa)
    assert PROMPT_PATHS[isa] in kernel.prefill_path(True) and kernel.prefill_ready(True) == bool(PROMPT_PATHS[isa])
    assert DECODE_PATHS[isa] in kernel.decode_path(True)
    for kv_heads, heads, d in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            check_kernel_against_pytorch(kernel, kv_heads, heads, d, dtype)
    if PROMPT_PATHS[isa]:
        for dtype in (torch.float32, torch.bfloat16):
            check_prompt_kernel(kernel, dtype)


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_every_level_of_the_sampler_gives_the_fallbacks_tokens(isa):
    from tests.support.kernel_checks import check_kernel_against_fallback

    for scale in (0.5, 12.0):
        check_kernel_against_fallback(built(sampler, isa), scale)


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_every_level_of_the_lora_kernel_adds_each_segments_delta(isa):
    """Segments of a few rows (the kernel's loops) and of many (ATen's GEMMs), slots of different ranks, a slot of
    rank 0 (no such target), against the deltas computed in float64."""
    kernel = built(lora, isa)
    g = torch.Generator().manual_seed(3)
    rows, d_in, w, slots, rank = 40, 48, 24, 3, 8
    x = torch.randn(rows, d_in, generator=g)
    a, b = torch.randn(slots, rank, d_in, generator=g), torch.randn(slots, rank, w, generator=g)
    ranks = torch.tensor([8, 3, 0], dtype=torch.int32)
    segs = torch.tensor([[0, 2, 0], [2, 5, 1], [5, 7, 2], [7, 40, 1]])
    out = torch.randn(rows, w + 8, generator=g)
    want = out.double().clone()
    for start, end, slot in segs.tolist():
        r = int(ranks[slot])
        want[start:end, 4:4 + w] += x[start:end].double() @ a[slot, :r].double().T @ b[slot, :r].double()
    kernel.lora_apply_(out, x, a, b, segs, ranks, 4)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_every_level_of_the_quantized_linear_computes_what_gguf_dequantizes(isa, monkeypatch):
    from services.engine.layers.quant import KINDS, QuantizedWeight
    from tests.support.kernel_checks import blocks_of, reference, width_for

    force_level(isa, monkeypatch)  # QuantizedWeight takes the kernel of the level MESHSERVE_ISA names
    rng = np.random.default_rng(7)
    for kind in sorted(KINDS):  # the file's types, the repacked ones (Q5_0, K-quants) among them
        k = width_for(kind, 96)
        w = (rng.standard_normal((17, k)) * rng.uniform(0.01, 2.0, (17, 1))).astype(np.float32)
        blocks = blocks_of(w, kind)
        q = QuantizedWeight.from_blocks(torch.from_numpy(blocks), kind, k)
        for m in (1, 9, 67):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            want = (x.double() @ reference(blocks, kind, k).double().T).float()
            torch.testing.assert_close(q(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_every_level_of_the_shared_memory_all_reduce_equals_torch(isa, monkeypatch):
    from tests.support.kernel_checks import check_collectives

    force_level(isa, monkeypatch)  # the peer rank, a spawned process, inherits MESHSERVE_ISA
    assert allreduce().__name__.endswith(build_level(isa, VECTOR_LEVELS))
    for dtype in (torch.float32, torch.bfloat16):
        check_collectives(dtype)
