"""The KV layout, declared once: what each layer caches, which layers share block tables, how K and V are
stored, and the bytes that follow. The pool, the cache tensors, attention, prefix hashing, swap and the
planner all read it.

Layers with equal specs form groups of equal size (vLLM's hybrid layout): each group has its own block
table per request, and all groups share one pool, the i-th layer of every group using the i-th tensor.
A model with only full-attention layers has one group of all its layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.errors import KVServeError
from kvserve.kv.formats import KVFormat, get_format

if TYPE_CHECKING:
    from kvserve.kv.policies.minicache import MiniCache
    from kvserve.memory.spec import ModelSpec

KINDS = ("full", "sliding", "latent")


@dataclass(frozen=True, slots=True)
class LayerKV:
    """What one attention layer caches per token."""

    kind: str  # "full", "sliding" (the last `window` tokens) or "latent" (MLA: one vector, no V)
    num_heads: int
    k_dim: int
    v_dim: int  # 0: the layer caches K only
    window: int | None = None


@dataclass(frozen=True, slots=True)
class KVGroup:
    spec: LayerKV
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    k_format: KVFormat
    v_format: KVFormat
    block_size: int
    # A per-channel format packs whole blocks: each sequence's newest tokens stay in float blocks
    # (`residual_format`) until they are `residual_tokens` old.
    residual_tokens: int = 0
    residual_format: KVFormat | None = None
    merge: MiniCache | None = None  # layer pairs from merge.start on share one K and one V store (one group only)
    _block_bytes: tuple[int, int] = field(init=False, repr=False, compare=False)  # block_bytes(), block_bytes(residual=True)
    num_layers: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):  # the engine asks for these figures every step (a request's KV bytes)
        object.__setattr__(self, "_block_bytes", (self._count_block_bytes(False), self._count_block_bytes(True)))
        object.__setattr__(self, "num_layers", sum(len(g.layers) for g in self.groups))

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @property
    def windows(self) -> list[int | None]:
        """Per group: its sliding window, or None (global attention)."""
        return [g.spec.window for g in self.groups]

    @property
    def has_residual(self) -> bool:
        return not (self.k_format.per_token and self.v_format.per_token)

    def block_bytes(self, residual: bool = False) -> int:
        """Bytes of one block: block_size tokens of every layer in one group (residual: of the residual pool)."""
        return self._block_bytes[residual]

    def _count_block_bytes(self, residual: bool) -> int:
        if residual and (not self.has_residual or self.residual_format is None):
            return 0
        spec, bs = self.groups[0].spec, self.block_size
        k, v = (self.residual_format, self.residual_format) if residual else (self.k_format, self.v_format)
        per_layer = k.block_bytes(bs, spec.num_heads, spec.k_dim) + (v.block_bytes(bs, spec.num_heads, spec.v_dim) if spec.v_dim else 0)
        if self.merge is None:
            return self.layers_per_group * per_layer
        pairs = len(self.merge.pairs(self.layers_per_group))
        per_pair = sum(self.merge.pair_bytes(f, bs, spec.num_heads, spec.k_dim) for f in (k, v))
        return (self.layers_per_group - 2 * pairs) * per_layer + pairs * per_pair

    @property
    def bytes_per_token(self) -> float:
        """KV bytes one more token adds to a request while every layer holds it (packed, for kivi2)."""
        return len(self.groups) * self.block_bytes() / self.block_size

    @property
    def residual_bytes_per_token(self) -> float:
        return len(self.groups) * self.block_bytes(residual=True) / self.block_size if self.has_residual else 0.0

    def bytes_held(self, context: int) -> float:
        """KV bytes of one request of `context` tokens: windowed layers hold at most their window, and a
        kivi2 layout holds its newest tokens in full precision."""
        per_layer = self.bytes_per_token / self.num_layers
        extra = (self.residual_bytes_per_token - self.bytes_per_token) / self.num_layers
        total = 0.0
        for group in self.groups:
            held = min(context, group.spec.window or context)
            total += len(group.layers) * (held * per_layer + min(held, self.residual_tokens) * extra)
        return total

    @property
    def dtype_name(self) -> str:
        k, v = self.k_format.name, self.v_format.name
        return k if k == v else f"{k}/{v}"

    def describe(self) -> str:
        spec = self.groups[0].spec
        kinds = {}
        for g in self.groups:
            kind = f"sliding over {g.spec.window} tokens" if g.spec.window else g.spec.kind
            kinds[kind] = kinds.get(kind, 0) + 1
        kinds = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        text = (f"KV {self.dtype_name}: {self.bytes_per_token:,.0f} B/token, {len(self.groups)} group(s) ({kinds}) of "
                f"{self.layers_per_group} layers x {spec.num_heads} heads x {spec.k_dim}, {self.block_size}-token blocks")
        if self.has_residual:
            text += f", newest {self.residual_tokens} tokens in {self.residual_format.name}"
        if self.merge:
            text += f", {self.merge}: {len(self.merge.pairs(self.layers_per_group))} merged layer pairs"
        return text

    def to_dict(self) -> dict:
        return {"k_dtype": self.k_format.name, "v_dtype": self.v_format.name, "block_size": self.block_size,
                "groups": len(self.groups), "layers_per_group": self.layers_per_group,
                "bytes_per_token": self.bytes_per_token, "residual_tokens": self.residual_tokens if self.has_residual else 0,
                "residual_bytes_per_token": self.residual_bytes_per_token, "merge": str(self.merge) if self.merge else None}


def layer_specs(model: ModelSpec) -> list[LayerKV]:
    """What each layer of a model caches, from its architecture."""
    if model.is_mla:
        return [LayerKV("latent", 1, model.kv_lora_rank + model.qk_rope_head_dim, 0)] * model.num_layers
    layers = []
    for i in range(model.num_layers):
        window = model.window_of(i)
        layers.append(LayerKV("sliding" if window else "full", model.num_kv_heads, model.head_dim, model.head_dim, window))
    return layers


def group_layers(layers: list[LayerKV]) -> tuple[KVGroup, ...]:
    """Layers with equal specs, in groups of one size (the gcd of each spec's count) so groups share tensors."""
    by_spec: dict[LayerKV, list[int]] = {}
    for i, spec in enumerate(layers):
        by_spec.setdefault(spec, []).append(i)
    size = math.gcd(*(len(ids) for ids in by_spec.values()))
    return tuple(KVGroup(spec, tuple(ids[i:i + size])) for spec, ids in by_spec.items() for i in range(0, len(ids), size))


def build_layout(model: ModelSpec, k_dtype: str, v_dtype: str, block_size: int = 16, residual_tokens: int = 128,
                 residual_dtype: str = "float32", merge: MiniCache | None = None) -> KVLayout:
    """The layout for a model with K and V stored as the named KV dtypes (see kvserve.kv.formats); `merge`: MiniCache's
    layer pairs."""
    k_format, v_format = get_format(k_dtype, "k"), get_format(v_dtype, "v")
    groups = group_layers(layer_specs(model))
    spec = groups[0].spec
    if len({(g.spec.num_heads, g.spec.k_dim, g.spec.v_dim) for g in groups}) > 1:
        raise KVServeError("layer groups with different K/V shapes are not supported")
    k_format.check(spec.k_dim)
    if spec.v_dim:
        v_format.check(spec.v_dim)
    if merge is not None:
        if len(groups) > 1 or spec.kind != "full":
            raise KVServeError(f"kv_policy minicache merges full-attention layers; {model.name} has "
                               f"{', '.join(sorted({g.spec.kind for g in groups} - {'full'}))} ones")
        if not (k_format.per_token and v_format.per_token):
            raise KVServeError("kv_policy minicache needs a per-token KV dtype (float, int8, int4, fp8), not kivi2")
        merge.check(block_size)
        merge = merge.at(model.num_layers)
    layout = KVLayout(groups, k_format, v_format, block_size, merge=merge)
    if not layout.has_residual:
        return layout
    if spec.kind == "latent":
        raise KVServeError("kivi2 needs K and V; an MLA layer caches one latent: use a per-token format (int8, int4, fp8)")
    if any(g.spec.window for g in groups):
        raise KVServeError("kivi2 with sliding-window layers is not supported: its residual blocks do not slide")
    if residual_tokens < 0 or residual_tokens % block_size:
        raise KVServeError(f"the kivi2 residual must be a multiple of the block size ({block_size}), got {residual_tokens}")
    return KVLayout(groups, k_format, v_format, block_size, residual_tokens, get_format(residual_dtype, "k"))
