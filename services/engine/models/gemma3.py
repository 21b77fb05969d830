"""Gemma 3's text decoder (model_type gemma3_text) over the same flat batch, paged pool and projections as Llama.

What differs from Llama (transformers' Gemma3TextModel is the reference): the embeddings are multiplied by
sqrt(hidden); every RMSNorm multiplies by (1 + weight) (folded into the weight once at load: the same float32
product); a layer has four norms: before attention, on the attention's output (before the residual add), before the
MLP and on the MLP's output; an RMSNorm over each query and key head before rotary; the MLP is GELU (tanh) gated;
the scores' scale is query_pre_attn_scalar ** -0.5; and five layers of six attend a sliding window with a rotary of
their own base (ModelConfig.layer_windows, local_rope), the sixth the whole context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.config.engine import ModelConfig
from services.engine.layers.rope import RotaryEmbedding
from services.engine.models.llama import LayerWeights, LlamaModel, _linear, _proj


class Gemma3Model(LlamaModel):
    def __init__(self, config: ModelConfig, weights: dict):
        super().__init__(config, weights)
        self.norm = self.norm + 1
        self.local_rotary = RotaryEmbedding(config.local_rope or config.rope, config.head_dim, config.max_positions)
        self.embed_scale = torch.tensor(config.embed_scale, dtype=self.dtype)

    def _layer(self, get, i: int) -> LayerWeights:
        p = f"model.layers.{i}."

        def norm(name: str) -> torch.Tensor:  # (1 + weight), as Gemma3RMSNorm multiplies, in the weight's dtype
            w = get(p + name + ".weight")
            return w.float().add(1).to(w.dtype)

        return LayerWeights(
            **self._projections(get, p),  # Gemma 3 has no projection biases (the config says none)
            input_norm=norm("input_layernorm"), post_norm=norm("pre_feedforward_layernorm"),
            attn_out_norm=norm("post_attention_layernorm"), mlp_out_norm=norm("post_feedforward_layernorm"),
            q_norm=norm("self_attn.q_norm"), k_norm=norm("self_attn.k_norm"))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention, meta, kv_cache,
                logits_index: torch.Tensor, lora=None) -> torch.Tensor:
        """As LlamaModel.forward (see module doc for what differs)."""
        c, ops, tp = self.config, self.ops, self.tp
        h = self._embed(input_ids) * self.embed_scale
        tables = [tuple(t[:, 0].contiguous() for t in rot.tables(positions, self.dtype))
                  for rot in (self.rotary, self.local_rotary)]
        for i, w in enumerate(self.layers):
            x = ops.add_rms_norm_(h, None, w.input_norm, c.rms_norm_eps)
            cos, sin = tables[1 if c.window(i) else 0]
            o = self._attention(i, w, x, cos, sin, attention, meta, kv_cache, lora)
            h.add_(ops.add_rms_norm_(o, None, w.attn_out_norm, c.rms_norm_eps))
            x = ops.add_rms_norm_(h, None, w.post_norm, c.rms_norm_eps)
            gate, up = _proj(x, w.gate_up, w.gate_up_bias, lora, i, "gate_up").chunk(2, dim=-1)
            m = _proj(F.gelu(gate, approximate="tanh") * up, w.down, w.down_bias, lora, i, "down")
            if tp:
                tp.all_reduce(m)
            h.add_(ops.add_rms_norm_(m, None, w.mlp_out_norm, c.rms_norm_eps))
        x = ops.add_rms_norm_(h[logits_index], None, self.norm, c.rms_norm_eps)
        logits = _linear(x, self.lm_head, None)
        return tp.gather_logits(logits) if tp else logits
