"""Gemma 3 (text): sliding-window layers (five per global one) with their own RoPE base, q/k norms, norms
before and after both attention and MLP, a scaled embedding and a GELU-tanh MLP. Its norms multiply by
1 + weight, folded into the weight at load so they are plain RMSNorms."""
from __future__ import annotations

import math

import torch

from kvserve.attention import ForwardContext
from kvserve.config import ModelConfig
from kvserve.errors import KVServeError
from kvserve.layers.norm import RMSNorm
from kvserve.models.llama import DecoderLayer, LlamaForCausalLM, Rope


class Gemma3DecoderLayer(DecoderLayer):
    """Its post_attention_layernorm norms the attention's output; pre_feedforward_layernorm is the norm before the MLP."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(size, eps), RMSNorm(size, eps)

    def unfused(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]:
        return self.input_layernorm, self.pre_feedforward_layernorm, self.post_attention_layernorm, self.post_feedforward_layernorm


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.embed_scale = math.sqrt(config.hidden_size)

    @classmethod
    def hf_options(cls, cfg: dict) -> dict:
        cfg = {**cfg, **cfg.get("text_config", {})}
        if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
            raise KVServeError("logit soft-capping (Gemma 2) is not supported")
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        return {"hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh", "qk_norm": True,
                "attention_scale": cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)) ** -0.5,
                "local_rope_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))}

    def hf_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: w + 1 if "norm" in name else w for name, w in super().hf_state_dict(weights).items()}
