"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat mixed batch and the paged KV pool.

forward() takes the batch's tokens and positions as flat [T] tensors; every linear layer runs
once over all T tokens (prefill chunks and decode tokens alike); attention is delegated to a
backend (services.engine.layers.attention). Logits are computed only for the rows that sample.
q/k/v and gate/up projections are fused into one matmul each. Every projection goes through
_proj(), the one place where per-token LoRA deltas are added (services.engine.lora.LoRABatch). The
elementwise work between projections (rotary, residual + RMSNorm, SiLU-and-mul) runs in the compiled layer ops
(services.engine.layers.kernels.layer_ops: one pass each) when they build, else in PyTorch (TorchLayerOps),
with the same rounding. Qwen3 adds an RMSNorm over each query and key head before rotary (ModelConfig.qk_norm);
Gemma 3 (services.engine.models.gemma3) reuses this class's pieces with its own layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common import envs
from services.common.errors import ModelLoadError
from services.config.engine import ModelConfig
from services.engine.layers.kernels import layer_ops
from services.engine.layers.quant import QuantizedWeight, concat, fusable
from services.engine.layers.rope import RotaryEmbedding, apply_rotary

LM_HEAD_SHARD = "lm_head.shard"  # a rank's rows of the LM head (its slice of the vocabulary), in a sharded state dict


@dataclass
class LayerWeights:  # a projection's weight is a tensor or a QuantizedWeight (services.engine.layers.quant)
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2*KVH) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2*KVH) * D]
    o: torch.Tensor  # [hidden, H * D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [head_dim]: qk_norm models (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden]: Gemma's norm of the attention's output
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: Gemma's norm of the MLP's output


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class TorchLayerOps:
    """The compiled layer ops' contract in PyTorch (csrc/layer_ops.cpp has the same three functions)."""

    @staticmethod
    def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, head_dim: int) -> None:
        """Rotate the first n_heads heads of each row of x [T, W] in place; cos, sin: [T, head_dim]."""
        heads = x[:, :n_heads * head_dim].view(-1, n_heads, head_dim)
        heads.copy_(apply_rotary(heads, cos[:, None], sin[:, None]))

    @staticmethod
    def add_rms_norm_(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h += a (when given), in place; returns weight * rms_norm(h)."""
        if a is not None:
            h.add_(a)
        return rms_norm(h, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _pick_layer_ops():
    return layer_ops() or TorchLayerOps()


def _native_bf16() -> bool:
    """Whether oneDNN has bfloat16 instructions here (AVX512_BF16 or AMX): elsewhere it would emulate them."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


# The dtypes oneDNN's linear runs: float32 always; bfloat16 where the CPU has it natively. On SmolLM2's shapes
# (Xeon with AVX512_BF16 and AMX, 2 threads) a packed bfloat16 weight ran 1.2-2.9x as fast as torch's own
# bfloat16 linear at 1 to 256 rows, with the same results (python -m bench.linear_probe --dtype bfloat16).
ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _native_bf16() else (torch.float32,)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype not in ONEDNN_DTYPES or weight.dtype != x.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pick_linear():
    """oneDNN's linear where this torch build has it and MESHSERVE_ONEDNN is not 0, else F.linear.

    On the CPUs measured (docs/BENCHMARKS.md, `python -m bench.linear_probe`) torch's default float32 linear goes
    through MKL, which on AMD processors skips its widest code paths; oneDNN (what vLLM's CPU
    build uses) runs the engine's shapes 2-2.7x faster on AVX-512 with results equal to ~3e-6."""
    if envs.ONEDNN.is_off() or not torch.backends.mkldnn.is_available():
        return F.linear
    try:
        probe = torch.ones(2, 4)
        if torch.allclose(_onednn_linear(probe, torch.ones(3, 4), torch.zeros(3)), F.linear(probe, torch.ones(3, 4))):
            return _onednn_linear
    except (RuntimeError, AttributeError):
        pass
    return F.linear


LINEAR = _pick_linear()
PACK_BATCH_HINT = 256  # the row count oneDNN lays packed weights out for (any row count still works)


def _pack(weight):
    """The weight in oneDNN's blocked layout, once at load (vLLM's CPU path does the same): the same
    results, ~5-35% faster per call on the shapes measured. Unchanged where oneDNN is not used, and for
    quantized weights (services.engine.layers.quant)."""
    if LINEAR is not _onednn_linear or isinstance(weight, QuantizedWeight) or weight.dtype not in ONEDNN_DTYPES:
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def _fuse(parts: list):
    """One weight of the rows of parts (q/k/v, gate/up): quantized where they can be fused (quant.fusable), else
    float32."""
    if fusable(parts):
        return concat(parts)
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])


def _linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight(x, bias)
    return LINEAR(x, weight, bias)


def _proj(x: torch.Tensor, weight, bias: torch.Tensor | None, lora=None, layer: int = 0,
          group: str = "") -> torch.Tensor:
    """x @ weight.T + bias, plus each row's LoRA delta when the batch has adapters (lora: LoRABatch)."""
    out = _linear(x, weight, bias)
    if lora is not None:
        lora.apply(out, x, layer, group)
    return out


class LlamaModel:
    """Weights as plain tensors; see module doc."""

    def __init__(self, config: ModelConfig, weights: dict):
        self.config = config
        get = _Getter(weights)
        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        head = weights.get(LM_HEAD_SHARD)  # a tensor-parallel rank's rows of it
        self.lm_head = _pack(head if head is not None else self.embed if config.tie_embeddings else
                             get("lm_head.weight"))
        self.layers = [self._layer(get, i) for i in range(config.num_layers)]
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_positions)
        self.dtype = self.embed.dtype
        self.ops = _pick_layer_ops()
        self.tp = None  # tensor parallelism: the group's collectives (services.engine.parallel)

    def _layer(self, get, i: int) -> LayerWeights:
        p, c = f"model.layers.{i}.", self.config
        norms = ({"q_norm": get(p + "self_attn.q_norm.weight"), "k_norm": get(p + "self_attn.k_norm.weight")}
                 if c.qk_norm else {})
        return LayerWeights(**self._projections(get, p), **norms, input_norm=get(p + "input_layernorm.weight"),
                            post_norm=get(p + "post_attention_layernorm.weight"))

    def _projections(self, get, p: str) -> dict:
        """A layer's projections (prefix p), q/k/v and gate/up fused, with their biases where the config has them."""
        c = self.config
        attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
        mlp = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
        return dict(
            qkv=_pack(_fuse([get(n + ".weight") for n in attn])),
            qkv_bias=torch.cat([get(n + ".bias") for n in attn]) if c.qkv_bias else None,
            o=_pack(get(p + "self_attn.o_proj.weight")),
            o_bias=get(p + "self_attn.o_proj.bias") if c.o_bias else None,
            gate_up=_pack(_fuse([get(n + ".weight") for n in mlp])),
            gate_up_bias=torch.cat([get(n + ".bias") for n in mlp]) if c.mlp_bias else None,
            down=_pack(get(p + "mlp.down_proj.weight")),
            down_bias=get(p + "mlp.down_proj.bias") if c.mlp_bias else None)

    def weights(self) -> list:
        """Every weight the model holds, once each (a tied lm_head is the embedding)."""
        found = [self.embed, self.norm, *([] if self.lm_head is self.embed else [self.lm_head])]
        for w in self.layers:
            found += [t for t in vars(w).values() if t is not None]
        return found

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.rows(input_ids)
        return F.embedding(input_ids, self.embed)

    def _attention(self, i: int, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention,
                   meta, kv_cache, lora) -> torch.Tensor:
        """Layer i's attention block from its normed input x: q/k/v, the heads' norms (qk_norm), rotary, paged
        attention (the layer's window's metadata), o; summed over the ranks under tensor parallelism."""
        c, ops = self.config, self.ops
        qkv = _proj(x, w.qkv, w.qkv_bias, lora, i, "qkv")
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if w.q_norm is not None:  # over each head, in place: the q heads, then the k heads
            heads = qkv[:, :q_width + kv_width].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
            for part, weight in ((heads[:, :c.num_heads], w.q_norm), (heads[:, c.num_heads:], w.k_norm)):
                part.copy_(rms_norm(part, weight, c.rms_norm_eps))
        ops.rotary_(qkv, cos, sin, c.num_heads + c.num_kv_heads, c.head_dim)  # q and k heads, in place
        q, k, v = (t.view(-1, n, c.head_dim) for t, n in zip(
            qkv.split((q_width, kv_width, kv_width), dim=-1), (c.num_heads, c.num_kv_heads, c.num_kv_heads)))
        a = attention.forward(q, k, v, kv_cache.k[i], kv_cache.v[i], meta.for_layer(c.window(i)))
        o = _proj(a, w.o, w.o_bias, lora, i, "o")
        return self.tp.all_reduce(o) if self.tp else o

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention, meta, kv_cache,
                logits_index: torch.Tensor, lora=None) -> torch.Tensor:
        """Logits [len(logits_index), vocab] for the selected rows of the flat batch, in the model's dtype (the
        sampler widens bfloat16 exactly, row by row); lora (LoRABatch): the rows' adapters, None when no row has
        one. Under tensor parallelism the model is one rank's shard: self.tp sums the partial outputs of o and down
        over the ranks and gathers the logits' vocabulary slices to rank 0 (services.engine.parallel)."""
        c, ops, tp = self.config, self.ops, self.tp
        h = self._embed(input_ids)
        cos, sin = (t[:, 0].contiguous() for t in self.rotary.tables(positions, self.dtype))
        pending = None  # the last MLP's output, added to h by the next norm (one pass for both)
        for i, w in enumerate(self.layers):
            x = ops.add_rms_norm_(h, pending, w.input_norm, c.rms_norm_eps)
            o = self._attention(i, w, x, cos, sin, attention, meta, kv_cache, lora)
            x = ops.add_rms_norm_(h, o, w.post_norm, c.rms_norm_eps)
            pending = _proj(ops.silu_mul(_proj(x, w.gate_up, w.gate_up_bias, lora, i, "gate_up")), w.down, w.down_bias,
                            lora, i, "down")
            if tp:
                tp.all_reduce(pending)
        last = h[logits_index]
        h = ops.add_rms_norm_(last, pending[logits_index], self.norm, c.rms_norm_eps)
        logits = _linear(h, self.lm_head, None)
        return tp.gather_logits(logits) if tp else logits  # tensor parallel: rank 0 gets them whole, others None


class _Getter:
    def __init__(self, weights: dict):
        self.weights = weights

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise ModelLoadError(f"weights: tensor {name!r} not found in the safetensors files")
        return self.weights[name]
