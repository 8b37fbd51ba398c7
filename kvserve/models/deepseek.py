"""DeepSeek-V3 (and V2-style) Multi-head Latent Attention with dense MLPs.

Each token caches one latent c (kv_lora_rank, normalized) and one RoPE key shared by all heads: a single
"KV head" of kv_lora_rank + qk_rope_head_dim values. Attention runs in the absorbed form: each head's no-RoPE
query is multiplied into the latent space by its slice of kv_b_proj (W_UK), so scores are [q_latent, q_rope] .
[c, k_rope], an MQA over the cache whose values are c itself; each head's output latent is then multiplied by its
value slice (W_UV). K and V are never expanded per head for the context.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import ForwardContext
from kvserve.config import ModelConfig
from kvserve.errors import KVServeError
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import apply_rotary
from kvserve.models.llama import DecoderLayer, LlamaForCausalLM, Rope


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.heads = layer, config.num_heads
        self.rank, self.nope, self.rope_dim, self.v_dim = config.kv_lora_rank, config.qk_nope_head_dim, config.head_dim, config.v_head_dim
        qk_dim = self.nope + self.rope_dim
        if config.q_lora_rank:
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(config.q_lora_rank, self.heads * qk_dim, bias=False)
        else:
            self.q_proj = Linear(config.hidden_size, self.heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.rank + self.rope_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.heads * self.v_dim, config.hidden_size, bias=config.o_bias)
        self.scale = qk_dim**-0.5

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_rope = q.view(tokens, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        cos, sin = rope["full_attention"]
        kv_b = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank).to(q.dtype)
        w_uk, w_uv = kv_b.split([self.nope, self.v_dim], dim=1)  # [H, nope, rank], [H, v, rank]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        query = torch.cat([q_latent, apply_rotary(q_rope, cos, sin)], dim=-1)
        key = torch.cat([self.kv_a_layernorm(latent), apply_rotary(k_rope.unsqueeze(1), cos, sin).squeeze(1)], dim=-1)
        out = ctx.attention(self.layer, query, key.unsqueeze(1), None, self.scale, value_dims=self.rank)  # [T, H, rank]
        return self.o_proj(torch.einsum("thr,hvr->thv", out, w_uv).reshape(tokens, -1))


class DeepseekDecoderLayer(DecoderLayer):
    attention_class = MLAttention


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekDecoderLayer

    @classmethod
    def hf_options(cls, cfg: dict) -> dict:
        layers = cfg["num_hidden_layers"]
        if cfg.get("n_routed_experts") and (cfg.get("first_k_dense_replace") or 0) < layers:
            raise KVServeError(f"mixture-of-experts layers are not supported: this DeepSeek config routes experts from layer "
                               f"{cfg.get('first_k_dense_replace') or 0} on (first_k_dense_replace < num_hidden_layers = {layers})")
        return {"kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": cfg.get("q_lora_rank") or 0,
                "qk_nope_head_dim": cfg["qk_nope_head_dim"], "v_head_dim": cfg["v_head_dim"], "head_dim": cfg["qk_rope_head_dim"],
                "num_kv_heads": 1, "rope_interleave": cfg.get("rope_interleave", True)}

    def hf_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """DeepSeek interleaves each RoPE pair (x0, x1), (x2, x3), ...; reorder those rows to the rotate-half layout
        (evens, then odds) once here, so attention applies the same RoPE as every other model."""
        w = super().hf_state_dict(weights)
        if not self.config.rope_interleave:
            return w
        c, r = self.config, self.config.head_dim
        order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
        for i in range(c.num_layers):
            p = f"layers.{i}.self_attn."
            q_name = p + ("q_b_proj.weight" if c.q_lora_rank else "q_proj.weight")
            q = w[q_name].view(c.num_heads, c.qk_nope_head_dim + r, -1)
            w[q_name] = torch.cat([q[:, :c.qk_nope_head_dim], q[:, c.qk_nope_head_dim:][:, order]], dim=1).flatten(0, 1)
            for name in (p + "kv_a_proj_with_mqa.weight", p + "kv_a_proj_with_mqa.bias"):
                if name in w:
                    w[name] = torch.cat([w[name][:c.kv_lora_rank], w[name][c.kv_lora_rank:][order]])
        return w
