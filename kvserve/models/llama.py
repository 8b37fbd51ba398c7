"""The Llama-family decoder (Llama 2/3, Mistral, SmolLM): MHA, GQA and MQA alike. Its attention and MLP
carry the options other families add (biases, q/k norms, activations), so they subclass it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import ForwardContext
from kvserve.config import ModelConfig
from kvserve.layers.linear import Embedding, Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import apply_rotary
from kvserve.models.base import CausalLM

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # cos and sin of the step's positions, by layer type


class Attention(nn.Module):
    ops = None  # RoPE by fused ops: kvserve.kernels on CPU (fp32), kernels/pointwise_triton.py on CUDA; None: torch's

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, config.num_heads, config.num_kv_heads, config.head_dim
        self.rope = "sliding_attention" if config.is_sliding(layer) else "full_attention"
        self.qkv_proj = Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=config.qkv_bias)
        self.o_proj = Linear(self.heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = config.attention_scale or self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k = q.view(tokens, self.heads, d), k.view(tokens, self.kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[self.rope]
        if self.ops is not None:  # in place on the fused projection's output: one call each instead of six ops
            self.ops.rope_(q, cos, sin)
            self.ops.rope_(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attention(self.layer, q, k, v.view(tokens, self.kv_heads, d), self.scale)
        return self.o_proj(out.view(tokens, -1))


class MLP(nn.Module):
    ops = None  # SiLU-and-mul by fused ops (as Attention's), with SiLU

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.activation = config.hidden_act
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    attention_class = Attention

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.fused = None  # the layer's weights in native code (see fuse)
        self.fused_rows = 0

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        if x.shape[0] <= self.fused_rows:
            return self._fused(x, rope, ctx)
        return self.unfused(x, rope, ctx)

    def unfused(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """The norms before attention and before the MLP, and those over their outputs (None: none)."""
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def fuse(self) -> bool:
        """Steps of a few rows run as native code (kernels/decode_layer.cpp: the layer in one call where the backend
        lets the kernel attend, else two around its attention), where this layer is the Llama one (or Gemma 3's) with
        quantized weights: the same arithmetic, without dozens of Python-dispatched ops."""
        attn, mlp = self.self_attn, self.mlp
        if type(attn) is not Attention or attn.ops is None or mlp.activation not in ("silu", "gelu_pytorch_tanh"):
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.qweight is None for m in linears) or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return False
        before_attn, before_mlp, after_attn, after_mlp = self.norms()
        self.fused = torch.classes.kvserve.DecodeLayer(
            before_attn.weight, before_attn.eps, *attn.qkv_proj.qweight.kernel_args, attn.qkv_proj.bias,
            before_mlp.weight, before_mlp.eps, *attn.o_proj.qweight.kernel_args, attn.o_proj.bias,
            *mlp.gate_up_proj.qweight.kernel_args, *mlp.down_proj.qweight.kernel_args, attn.qkv_proj.activations,
            attn.heads, attn.kv_heads, attn.scale)
        if attn.qk_norm:
            self.fused.qk_norms(attn.q_norm.weight, attn.q_norm.eps, attn.k_norm.weight, attn.k_norm.eps)
        if after_attn is not None:
            self.fused.output_norms(after_attn.weight, after_attn.eps, after_mlp.weight, after_mlp.eps)
        self.fused.activation(mlp.activation)
        self.fused_rows = min(m.kernel_rows for m in linears)
        return True

    def _fused(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        attn = self.self_attn
        cos, sin = rope[attn.rope]
        kernel = ctx.kernel_arguments(attn.layer)
        if kernel is not None:  # attention too, inside one call
            return self.fused.forward(x, cos, sin, *kernel)
        tokens, d = x.shape[0], attn.head_dim
        q, k, v = self.fused.pre(x, cos, sin).split([attn.heads * d, attn.kv_heads * d, attn.kv_heads * d], dim=-1)
        out = ctx.attention(attn.layer, q.view(tokens, attn.heads, d), k.view(tokens, attn.kv_heads, d),
                            v.view(tokens, attn.kv_heads, d), attn.scale)
        return self.fused.post(x, out.view(tokens, -1))


class LlamaForCausalLM(CausalLM):
    layer_class = DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
