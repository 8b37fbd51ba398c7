"""Qwen2 / Qwen2.5 (biases on q, k and v) and Qwen3 (an RMSNorm on each head of q and k): Llama otherwise."""
from __future__ import annotations

from kvserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def hf_options(cls, cfg: dict) -> dict:
        return {"qkv_bias": True, "o_bias": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def hf_options(cls, cfg: dict) -> dict:
        return {"qk_norm": True}
