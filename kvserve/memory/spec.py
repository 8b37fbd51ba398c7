"""What the KV planner needs to know about a model, read from a config.json, a GGUF file, a built-in
model or a named preset."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.config import HF_SIZES, check_hf_sizes
from kvserve.errors import KVServeError, ModelNotFoundError
from kvserve.layers.quantized import resident_bytes


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_context: int | None = None
    # MLA (DeepSeek): each layer caches one latent of kv_lora_rank plus a shared RoPE key of qk_rope_head_dim.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    # local layers hold at most `sliding_window` tokens; layer_types says which layers are local
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # mixture of experts (only the parameter count depends on these)
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_dense_layers: int = 0
    weight_bytes: int | None = None  # what the weights hold in memory where the source says (a GGUF's tensors as loaded)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else f"GQA-{self.num_kv_heads}"

    def window_of(self, layer: int) -> int | None:
        """How many tokens a layer keeps: its sliding window, or None for a global layer."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def kv_elements_per_layer(self) -> int:
        """Cached values per token per layer: K and V of every KV head, or MLA's latent + RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 2 * self.num_kv_heads * self.head_dim

    def mha_kv_elements_per_layer(self) -> int:
        """The same, had the model used full multi-head attention (one K and V per query head)."""
        if self.is_mla:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 2 * self.num_heads * self.head_dim

    def num_params(self) -> int:
        h, layers = self.hidden_size, self.num_layers
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        moe_layers = layers - self.num_dense_layers if self.num_experts else 0
        dense_mlp = 3 * h * self.intermediate_size
        experts = self.num_experts + self.num_shared_experts
        moe_mlp = 3 * h * self.moe_intermediate_size * experts + h * self.num_experts
        return int(embed + layers * (self._attention_params() + 2 * h) + h
                   + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp)

    def active_params(self) -> int:
        """Parameters one token goes through: for MoE, the shared experts and its top-k routed ones."""
        if not self.num_experts:
            return self.num_params()
        h, routed = self.hidden_size, self.experts_per_token or self.num_experts
        unused = (self.num_experts - routed) * 3 * h * self.moe_intermediate_size * (self.num_layers - self.num_dense_layers)
        return self.num_params() - unused

    def _attention_params(self) -> int:
        h, heads = self.hidden_size, self.num_heads
        if not self.is_mla:
            return h * self.head_dim * (2 * heads + 2 * self.num_kv_heads)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * heads * qk if self.q_lora_rank else h * heads * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h


def hf_layer_types(cfg: dict) -> tuple[str, ...]:
    """Each layer's attention, "full_attention" or "sliding_attention"; () when no layer slides."""
    cfg = {**cfg, **cfg.get("text_config", {})}
    layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True):
        return ()
    types = cfg.get("layer_types")
    if not types and str(cfg.get("model_type", "")).startswith("gemma3"):  # before layer_types: every Nth is global
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if not types and "max_window_layers" in cfg:  # Qwen2: layers from max_window_layers on slide
        types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention" for i in range(layers)]
    types = tuple(types or ["sliding_attention"] * layers)  # Mistral: every layer
    return types if "sliding_attention" in types else ()


def spec_from_hf_config(cfg: dict, name: str = "model") -> ModelSpec:
    cfg = {**cfg, **cfg.get("text_config", {})}  # multimodal configs nest the decoder
    check_hf_sizes(cfg, required=HF_SIZES, where=f"the config of {name}")
    try:
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        layer_types = hf_layer_types(cfg)
        window = cfg.get("sliding_window") if "sliding_attention" in layer_types else None
        return ModelSpec(
            name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg.get("intermediate_size", 4 * hidden), vocab_size=cfg["vocab_size"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_context=cfg.get("max_position_embeddings"),
            kv_lora_rank=cfg.get("kv_lora_rank") or 0, qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
            qk_nope_head_dim=cfg.get("qk_nope_head_dim") or 0, v_head_dim=cfg.get("v_head_dim") or 0,
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            sliding_window=window, layer_types=layer_types,
            num_experts=cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0,
            experts_per_token=cfg.get("num_experts_per_tok") or 0,
            num_shared_experts=cfg.get("n_shared_experts") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0),
            num_dense_layers=cfg.get("first_k_dense_replace") or 0,
        )
    except (KeyError, TypeError) as e:
        raise KVServeError(f"config of {name} lacks a field the planner needs: {e}") from e


def spec_from_gguf(path: Path, name: str | None = None) -> ModelSpec:
    from kvserve.models.gguf_convert import read_gguf

    reader = read_gguf(path)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch is None:
        raise KVServeError(f"{path} has no general.architecture metadata")
    p = f"{arch}."
    heads = field(p + "attention.head_count")
    hidden = field(p + "embedding_length")
    kv_heads = field(p + "attention.head_count_kv", heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    cfg = {
        "num_hidden_layers": field(p + "block_count"), "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": field(p + "attention.key_length", hidden // heads if heads else None),
        "intermediate_size": field(p + "feed_forward_length"), "max_position_embeddings": field(p + "context_length"),
        "vocab_size": len(tokens.data) if tokens else field(p + "vocab_size"), "tie_word_embeddings": not has_output,
        "sliding_window": field(p + "attention.sliding_window"),
        "kv_lora_rank": field(p + "attention.kv_lora_rank"), "qk_rope_head_dim": field(p + "rope.dimension_count"),
    }
    if arch.startswith("gemma3"):
        cfg["model_type"] = "gemma3_text"
    if not cfg["kv_lora_rank"]:
        cfg["qk_rope_head_dim"] = None
    weights = sum(resident_bytes(t.tensor_type.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors)
    return replace(spec_from_hf_config(cfg, name or path.name), weight_bytes=weights)


def _llama(layers, hidden, heads, kv_heads, inter, vocab, ctx, tie=False) -> dict:
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": inter, "vocab_size": vocab, "max_position_embeddings": ctx, "tie_word_embeddings": tie}


PRESETS: dict[str, dict] = {
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096),
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192),
    "llama-3.1-8b": _llama(32, 4096, 32, 8, 14336, 128256, 131072),
    "llama-3.1-70b": _llama(80, 8192, 64, 8, 28672, 128256, 131072),
    "llama-3.1-405b": _llama(126, 16384, 128, 16, 53248, 128256, 131072),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32000, 32768),
    "smollm2-135m": _llama(30, 576, 9, 3, 1536, 49152, 8192, tie=True),
    "gemma-3-270m": {**_llama(18, 640, 4, 1, 2048, 262144, 32768, tie=True), "head_dim": 256, "sliding_window": 512,
                     "sliding_window_pattern": 6, "model_type": "gemma3_text"},
    "deepseek-v3": {**_llama(61, 7168, 128, 128, 18432, 129280, 163840), "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536, "n_routed_experts": 256,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3},
}


def load_spec(source: str) -> ModelSpec:
    """A preset name, a built-in model, a config.json, a model directory or a GGUF file -> ModelSpec. A built-in
    model is read from its GGUF file where its package is installed (its weights' bytes are then known), else from
    its preset."""
    from kvserve.models.registry import BUILTIN_MODELS, resolve_model_path

    if source in BUILTIN_MODELS:
        try:
            return spec_from_gguf(resolve_model_path(source), source)
        except ModelNotFoundError:
            if source not in PRESETS:
                raise
    if source in PRESETS:
        return spec_from_hf_config(PRESETS[source], source)
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return spec_from_gguf(path)
    if not path.is_file():
        raise KVServeError(f"{source!r} is not a preset ({', '.join(PRESETS)}), a config.json, a model directory or a .gguf file")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KVServeError(f"cannot read {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise KVServeError(f"{path} is not a JSON object")
    return spec_from_hf_config(cfg, source)
