"""What every decoder shares: the layer loop, the LM head, and the weight transforms done at load
(q/k/v and gate/up fused into one matmul each, quantized weights kept packed, bf16 weights, Q8_0 drafts)."""
from __future__ import annotations

import itertools

import torch
from torch import nn

from kvserve.attention import ForwardContext
from kvserve.config import ModelConfig
from kvserve.errors import KVServeError
from kvserve.layers.linear import Embedding, Linear, VocabSubset
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantized import GGUFTensor, QuantizedWeight
from kvserve.layers.rotary import RotaryEmbedding


class CausalLM(nn.Module):
    """Subclasses build `embed_tokens`, `layers` (each called as layer(x, rope, ctx)), `norm` and `lm_head`."""

    embed_scale = 1.0  # what the embedding's rows are multiplied by (Gemma's sqrt(hidden))

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
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale == 1 else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for the step's flattened tokens (after the first num_layers layers: a
        self-speculative draft)."""
        x = self.embed(input_ids)
        stacked = ctx.backend.run_layers(x, ctx, num_layers)  # the final norm included
        if stacked is not None:
            return stacked
        tables = {r: r.tables(ctx.positions, x.dtype) for r in self._rotary_modules}
        rope = {kind: tables[r] for kind, r in self.rotary.items()}
        for layer in itertools.islice(self.layers, num_layers):  # a ModuleList slice builds a new list: 60 us a step
            x = layer(x, rope, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def compute_logits_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """compute_logits, and each row's argmax where the head's kernel found it as it multiplied; else None."""
        if not isinstance(self.lm_head, Linear):
            return self.compute_logits(hidden), None
        logits, argmax = self.lm_head.forward_argmax(hidden)
        return logits.float(), argmax

    def decode_ends(self) -> tuple[tuple, int] | None:
        """The embedding and the LM head as a native decode step takes them (kernels/decode_layer.cpp:
        DecodeStack.set_ends), and the most rows the head multiplies in place; None unless the head is one packed
        weight without bias and the embedding packed rows of one type."""
        head, embed = self.lm_head, self.embed_tokens
        if type(head) is not Linear or head.bias is not None or not all(w is not None and len(w.parts) == 1
                                                                      for w in (head.qweight, embed.qweight)):
            return None
        (rows,), (type_id,) = embed.qweight.kernel_args
        return (rows, type_id, self.embed_scale, *head.qweight.kernel_args, head.activations), head.kernel_rows

    def hf_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A Hugging Face state dict renamed and fused to this module's parameters."""
        return fuse_hf_weights(weights, self.config)

    def load_hf_weights(self, weights: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        """Dense tensors become parameters; quantized ones stay packed in their linear layer or embedding."""
        state = self.hf_state_dict(weights)
        quantized = {name: w for name, w in state.items() if isinstance(w, QuantizedWeight)}
        missing, unexpected = self.load_state_dict({n: w for n, w in state.items() if n not in quantized}, strict=False, assign=True)
        for name, weight in quantized.items():
            module = self.get_submodule(name.removesuffix(".weight"))
            if not isinstance(module, (Linear, Embedding)) or not name.endswith(".weight"):
                raise RuntimeError(f"{name} is quantized, but {type(module).__name__} holds only dense weights")
            module.use_quantized(weight)
        if [n for n in missing if n not in quantized] or unexpected:
            raise RuntimeError(f"missing weights {[n for n in missing if n not in quantized]}, unexpected weights {unexpected}")
        if self.config.tie_word_embeddings and self.embed_tokens.weight is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def weight_bytes(self) -> int:
        """Bytes the weights hold in memory (shared ones once)."""
        tensors = list(self.parameters()) + [rows for w in self.quantized_weights() for _, rows in w.parts]
        return sum({t.data_ptr(): t.nbytes for t in tensors}.values())

    def quantized_weights(self) -> list[QuantizedWeight]:
        return list({id(m.qweight): m.qweight for m in self.modules() if getattr(m, "qweight", None) is not None}.values())

    def describe_weights(self) -> str:
        """How much the weights hold and in which formats, e.g. 'weights 92 MiB (Q4_1, Q8_0 packed; float32)'."""
        packed = sorted({t for w in self.quantized_weights() for t in w.types})
        dense = sorted({str(p.dtype).removeprefix("torch.") for p in self.parameters()})
        return f"weights {self.weight_bytes() / 2**20:.0f} MiB ({', '.join(packed) + ' packed; ' if packed else ''}{', '.join(dense)})"

    def describe_matmuls(self) -> str:
        """How the linear layers multiply, for reports: 'int8 activations' (packed weights through the kernels,
        layers/linear.py), else 'bf16' or 'fp32'."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if any(m.qweight is not None and m.int8_activations for m in linears):
            return "int8 activations"
        return "bf16" if any(m.gemm_dtype == torch.bfloat16 for m in linears) else "fp32"

    def use_bf16_matmuls(self) -> None:
        """Every linear layer multiplies in bf16: a dense weight is kept in bf16 (the LM head untied from the
        embedding, which stays fp32), a quantized one dequantizes its tiles to bf16; activations stay fp32 and
        are cast at each matmul."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.gemm_dtype = torch.bfloat16
                if module.weight is not None:
                    module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)

    def use_fused_ops(self, ops, int8_activations: bool = False, bf16_tiles: bool = True) -> None:
        """Norms, RoPE and SiLU-and-mul call `ops` (kvserve.kernels' on CPU, kernels/pointwise_triton.py on CUDA);
        quantized linear layers multiply int8-quantized activations where asked, and steps of many rows on AMX's bf16
        tiles unless told not to (layers/linear.py)."""
        from kvserve.models.llama import MLP, Attention

        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.ops = ops
            if isinstance(module, MLP):
                module.ops = ops if module.activation == "silu" else None
            if isinstance(module, Linear):
                module.int8_activations, module.bf16_tiles = int8_activations, bf16_tiles

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Logits for these token ids only, -inf for the rest (a draft's head: layers/linear.py VocabSubset)."""
        if not 0 < len(ids) <= self.config.vocab_size or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise KVServeError(f"a draft vocabulary must be 1..{self.config.vocab_size} token ids below {self.config.vocab_size}")
        self.lm_head = VocabSubset(self.lm_head, ids)

    def fuse_decode_layers(self) -> int:
        """Layers that can run steps of a few rows as fused native ops do so (models/llama.py: DecoderLayer.fuse), once
        their weights and kernels are set; returns how many."""
        return sum(layer.fuse() for layer in self.layers if hasattr(layer, "fuse"))


def use_q8_weights(model: nn.Module) -> None:
    """The module's dense linear layers quantized to Q8_0 (a draft: it reads 8.5 bits per weight instead of 32 or 16)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None and module.in_features % 32 == 0:
            module.use_quantized(_q8(module.weight))


def _q8(weight: torch.Tensor) -> QuantizedWeight:
    import gguf

    rows = weight.detach().float().cpu().numpy()
    blocks = torch.from_numpy(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0))
    return QuantizedWeight.pack(GGUFTensor(blocks, "Q8_0", tuple(weight.shape)))


def fuse_hf_weights(weights: dict, config: ModelConfig) -> dict:
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


def _fuse(w: dict, parts: list[str], name: str) -> None:
    if not all(p in w for p in parts) or len({_width(w[p]) for p in parts}) != 1:
        return
    tensors = [w.pop(p) for p in parts]
    if all(isinstance(t, QuantizedWeight) for t in tensors):
        w[name] = QuantizedWeight.cat(tensors)
    else:  # a file that stores some parts dense: all dense
        w[name] = torch.cat([t.dequantize() if isinstance(t, QuantizedWeight) else t for t in tensors])


def _width(t) -> tuple:
    return (t.in_features,) if isinstance(t, QuantizedWeight) else tuple(t.shape[1:])
