"""The kernel dispatcher picks a vector ISA level the CPU can execute, and every level this machine can
execute builds kernels that agree with the PyTorch reference (the sampler bit for bit)."""

import logging
import os

import pytest
import torch

from services.engine.kernels import ISA_LEVELS, cpu_flags, host_isa, paged_attention, pick_isa, sampler, supported_isas

AVX512_HOST = frozenset("fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16".split())
AVX2_HOST = frozenset("fpu sse2 avx avx2 fma".split())
OLD_HOST = frozenset("fpu sse2 avx".split())
NO_DQ_HOST = AVX2_HOST | {"avx512f"}  # AVX-512 foundation only (Knights Landing): not our avx512 level


@pytest.mark.parametrize("flags, requested, want", [
    (AVX512_HOST, None, "avx512"), (AVX2_HOST, None, "avx2"), (OLD_HOST, None, "generic"),
    (NO_DQ_HOST, None, "avx2"), (frozenset(), None, "generic"),
    (AVX512_HOST, "avx2", "avx2"), (AVX512_HOST, "generic", "generic"),
    (AVX2_HOST, "avx512", "avx2"),  # asked for more than the CPU has: the widest it has, with a warning
])
def test_dispatcher_picks_a_level_the_cpu_supports(flags, requested, want):
    assert pick_isa(flags, requested) == want
    assert want in supported_isas(flags)


def test_asking_for_a_level_the_cpu_lacks_is_said(caplog):
    with caplog.at_level(logging.WARNING):
        pick_isa(AVX2_HOST, "avx512")
    assert "lacks avx512bw avx512dq avx512f avx512vl" in caplog.text


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown"):
        pick_isa(AVX512_HOST, "sse9")


def test_this_host_runs_a_level_it_supports():
    assert host_isa() in supported_isas(cpu_flags())
    assert supported_isas(cpu_flags())[-1] == "generic" and set(supported_isas(cpu_flags())) <= set(ISA_LEVELS)


def machine_levels() -> list:
    return supported_isas(cpu_flags())


def built(factory, isa):
    module = factory(isa)
    if module is None and os.environ.get("MESHSERVE_KERNELS") == "0":
        pytest.skip("kernels disabled by MESHSERVE_KERNELS=0")
    assert module is not None, f"the {isa} build failed (see the logged warning)"
    return module


@pytest.mark.parametrize("isa", machine_levels())
def test_every_level_of_the_attention_kernel_matches_pytorch(isa):
    from tests.engine.test_attention import SHAPES, check_kernel_against_pytorch

    for kv_heads, heads, d in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            check_kernel_against_pytorch(built(paged_attention, isa), kv_heads, heads, d, dtype)


@pytest.mark.parametrize("isa", machine_levels())
def test_every_level_of_the_sampler_gives_the_fallbacks_tokens(isa):
    from tests.engine.test_sampling import check_kernel_against_fallback

    for scale in (0.5, 12.0):
        check_kernel_against_fallback(built(sampler, isa), scale)
