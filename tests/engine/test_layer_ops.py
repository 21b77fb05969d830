"""The compiled layer ops (rotary, residual + RMSNorm, SiLU-and-mul) against their PyTorch contract, in float32
and bfloat16, at every ISA level (forced; skipped with the reason where this machine cannot execute it)."""

import pytest
import torch

from services.engine.layers.kernels import ISA_LEVELS, host_isa, layer_ops
from services.engine.models.llama import TorchLayerOps
from tests.support.levels import built

DTYPES = [torch.float32, torch.bfloat16]


def last_bit(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal but for the last two bits (sums in another order; glibc's vector exp, within 4 ulp)."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a.float(), b.float(), rtol=4 * eps, atol=4 * eps)


def check_ops(ops, dtype: torch.dtype, rows: int = 37, heads: int = 4, kv_heads: int = 2, d: int = 64) -> None:
    g = torch.Generator().manual_seed(rows)
    ref = TorchLayerOps()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angles = torch.rand(rows, d // 2, generator=g) * 100
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    ours, theirs = qkv.clone(), qkv.clone()
    ops.rotary_(ours, cos, sin, heads + kv_heads, d)
    ref.rotary_(theirs, cos, sin, heads + kv_heads, d)
    assert torch.equal(ours, theirs), "rotary differs"  # the same products and sums, no FMA: bit for bit
    assert torch.equal(ours[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:]), "v was touched"

    for width in (256, 250):  # whole vectors of 16, and a tail
        check_norm(ops, ref, g, dtype, rows, width)

    for inter in (688, 693):
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        last_bit(ops.silu_mul(gate_up), ref.silu_mul(gate_up), dtype)


def check_norm(ops, ref, g, dtype, rows: int, width: int) -> None:
    h, a, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((rows, width), (rows, width), (width,)))
    h_ours, h_theirs = h.clone(), h.clone()
    x_ours, x_theirs = ops.add_rms_norm_(h_ours, a, w, 1e-6), ref.add_rms_norm_(h_theirs, a, w, 1e-6)
    assert torch.equal(h_ours, h_theirs), "the residual sum differs"
    last_bit(x_ours, x_theirs, dtype)
    last_bit(ops.add_rms_norm_(h.clone(), None, w, 1e-6), ref.add_rms_norm_(h.clone(), None, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_every_level_of_the_layer_ops_keeps_the_pytorch_contract(isa, dtype):
    for rows in (1, 37):
        check_ops(built(layer_ops, isa), dtype, rows=rows)


def test_rotary_rotates_only_the_heads_asked_for_in_a_strided_view():
    """The model rotates q and k inside the fused qkv output; a wider row (stride) must be honoured."""
    ops = built(layer_ops, host_isa())
    wide = torch.randn(5, 3 * 64 + 7)
    view = wide[:, :3 * 64]
    before = wide.clone()
    cos, sin = torch.ones(5, 64), torch.zeros(5, 64)  # the identity rotation
    ops.rotary_(view, cos, sin, 3, 64)
    assert torch.equal(wide, before)
    cos, sin = torch.zeros(5, 64), torch.ones(5, 64)  # a quarter turn: (x1, x2) -> (-x2, x1)
    ops.rotary_(view, cos, sin, 1, 64)
    assert torch.equal(wide[:, :32], -before[:, 32:64]) and torch.equal(wide[:, 32:64], before[:, :32])
    assert torch.equal(wide[:, 64:], before[:, 64:])
