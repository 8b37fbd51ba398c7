"""What every decoder shares: the layer loop, the LM head, and the weight transforms done at load
(q/k/v and gate/up fused into one matmul each, bf16 weights, a GGUF file's own blocks, Q8_0 blocks)."""
from __future__ import annotations

import itertools

import torch
from torch import nn

from kvserve.attention import ForwardContext
from kvserve.config import ModelConfig
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding


class CausalLM(nn.Module):
    """Subclasses build `embed_tokens`, `layers` (each called as layer(x, rope, ctx)), `norm` and `lm_head`."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        global_rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, config.rope_freq_factors)
        self.rotary = {"full_attention": global_rope, "sliding_attention": global_rope}
        if config.local_rope_theta is not None:
            self.rotary["sliding_attention"] = RotaryEmbedding(config.head_dim, max_positions, config.local_rope_theta, None)
        self._rotary_modules = nn.ModuleList(dict.fromkeys(self.rotary.values()))  # so .to(device) moves the tables

    @classmethod
    def hf_options(cls, cfg: dict) -> dict:
        """ModelConfig fields this architecture sets from its config.json, beyond the common ones."""
        return {}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for the step's flattened tokens (after the first num_layers layers: a
        self-speculative draft)."""
        x = self.embed(input_ids)
        tables = {r: r.tables(ctx.positions, x.dtype) for r in self._rotary_modules}
        rope = {kind: tables[r] for kind, r in self.rotary.items()}
        for layer in itertools.islice(self.layers, num_layers):  # a ModuleList slice builds a new list: 60 us a step
            x = layer(x, rope, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hf_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A Hugging Face state dict renamed and fused to this module's parameters."""
        return fuse_hf_weights(weights, self.config)

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(self.hf_state_dict(weights), strict=True, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def use_bf16_matmuls(self) -> None:
        """Every linear layer's weight in bf16 (the LM head untied from the embedding, which stays fp32);
        activations stay fp32 and are cast at each matmul."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)

    def use_native_kernels(self, gguf_blocks: dict[str, torch.Tensor], int8_activations: bool = False) -> int:
        """Norms, RoPE and SiLU-and-mul use kvserve.kernels, and each linear layer gets its GGUF blocks (by HF name) where
        the file has them (int8_activations: multiplied by int8-quantized activations); returns how many got blocks."""
        from kvserve.models.llama import MLP, Attention

        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.native = True
            if isinstance(module, MLP):
                module.native = module.silu
            if isinstance(module, Linear):
                module.int8_activations = int8_activations
        fused = fuse_hf_weights(gguf_blocks, self.config)
        layers = [(name, m) for name, m in self.named_modules() if isinstance(m, Linear) and f"{name}.weight" in fused]
        for name, module in layers:
            module.blocks = fused[f"{name}.weight"]
            assert module.blocks.shape[0] == module.out_features
        return len(layers)

    def use_q8_blocks(self) -> None:
        """Q8_0 blocks for every linear layer that has none, against int8 activations, and native norms (a draft
        model: it reads 8.5 bits per weight instead of 32 or 16)."""
        self.use_native_kernels({}, int8_activations=True)
        for module in self.modules():
            if isinstance(module, Linear) and module.blocks is None and module.in_features % 32 == 0:
                module.blocks = _q8_blocks(module.weight)


def _q8_blocks(weight: torch.Tensor) -> torch.Tensor:
    import gguf

    rows = weight.detach().float().cpu().numpy()
    return torch.from_numpy(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0))


def fuse_hf_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename and fuse q/k/v and gate/up (weights and biases); parts that are missing or of unequal width are
    left unfused."""
    w = {k.removeprefix("model."): v for k, v in weights.items() if "rotary_emb" not in k}
    if config.tie_word_embeddings:
        w.pop("lm_head.weight", None)
        if "embed_tokens.weight" in w:
            w["lm_head.weight"] = w["embed_tokens.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            _fuse(w, [p + f"self_attn.{n}_proj.{kind}" for n in "qkv"], p + f"self_attn.qkv_proj.{kind}")
            _fuse(w, [p + f"mlp.gate_proj.{kind}", p + f"mlp.up_proj.{kind}"], p + f"mlp.gate_up_proj.{kind}")
    return w


def _fuse(w: dict[str, torch.Tensor], parts: list[str], name: str) -> None:
    if all(p in w for p in parts) and len({w[p].shape[1:] for p in parts}) == 1:
        w[name] = torch.cat([w.pop(p) for p in parts])
