"""The Llama-family decoder (Llama 2/3, Mistral without sliding window, SmolLM): MHA, GQA and MQA alike."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.kernels import native_ops
from kvserve.attention import ForwardContext
from kvserve.layers.linear import Linear
from kvserve.layers.rotary import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    native = False  # kvserve.kernels' rms_norm: ~10x less overhead per call on a decode step's few rows

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native_ops().rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o_proj = Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = apply_rotary(q.view(tokens, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(tokens, self.kv_heads, self.head_dim), cos, sin)
        out = ctx.attention(self.layer, q, k, v.view(tokens, self.kv_heads, self.head_dim), self.scale)
        return self.o_proj(out.view(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for the step's flattened tokens (after the first num_layers layers: a
        self-speculative draft)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(ctx.positions, x.dtype)
        for layer in itertools.islice(self.layers, num_layers):  # a ModuleList slice builds a new list: 60 us a step
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict, fusing q/k/v and gate/up into one matmul each."""
        self.load_state_dict(_fuse_hf_weights(weights, self.config), strict=True, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def use_bf16_matmuls(self) -> None:
        """Every linear layer's weight in bf16 (the LM head untied from the embedding, which stays fp32);
        activations stay fp32 and are cast at each matmul."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)

    def use_native_kernels(self, gguf_blocks: dict[str, torch.Tensor]) -> int:
        """Norms use kvserve.kernels, and each linear layer gets its GGUF blocks (by HF name) where the file
        has them; returns how many linear layers got blocks."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.native = True
        fused = _fuse_hf_weights(gguf_blocks, self.config)
        layers = [(name, m) for name, m in self.named_modules() if isinstance(m, Linear) and f"{name}.weight" in fused]
        for name, module in layers:
            module.blocks = fused[f"{name}.weight"]
            assert module.blocks.shape[0] == module.out_features
        return len(layers)

    def use_q8_blocks(self) -> None:
        """Q8_0 blocks for every linear layer that has none, and native norms (a draft model: it reads 8.5 bits
        per weight instead of 32 or 16)."""
        self.use_native_kernels({})
        for module in self.modules():
            if isinstance(module, Linear) and module.blocks is None and module.in_features % 32 == 0:
                module.blocks = _q8_blocks(module.weight)


def _q8_blocks(weight: torch.Tensor) -> torch.Tensor:
    import gguf

    rows = weight.detach().float().cpu().numpy()
    return torch.from_numpy(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0))


def _fuse_hf_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename and fuse q/k/v and gate/up; parts that are missing or of unequal width are left unfused."""
    w = {k.removeprefix("model."): v for k, v in weights.items() if "rotary_emb" not in k}
    if config.tie_word_embeddings:
        w.pop("lm_head.weight", None)
        if "embed_tokens.weight" in w:
            w["lm_head.weight"] = w["embed_tokens.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        _fuse(w, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], p + "self_attn.qkv_proj.weight")
        _fuse(w, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "mlp.gate_up_proj.weight")
    return w


def _fuse(w: dict[str, torch.Tensor], parts: list[str], name: str) -> None:
    if all(p in w for p in parts) and len({w[p].shape[1:] for p in parts}) == 1:
        w[name] = torch.cat([w.pop(p) for p in parts])
