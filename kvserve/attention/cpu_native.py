"""fp32 on CPU: decode queries go to kvserve.kernels, which reads each sequence's blocks in place, in any
KV format, dequantizing in registers; prefill chunks to its prompt kernel, a tiled causal flash attention over the
same blocks (SDPA on AMX, in bf16, for long steps; with batch_invariant, a prompt's tokens are decode
queries too: engine/model_runner.py). A step of decodes alone writes its new K/V and attends in one call, over a
float, fp8, int8 or int4 cache."""
from __future__ import annotations

import numpy as np
import torch

from kvserve.attention import ForwardContext, QueryGroup
from kvserve.attention.sdpa import SDPABackend
from kvserve.kernels import native_module, native_ops
from kvserve.kv.cache import KVCache
from kvserve.kv.formats.fp8 import FP8Format
from kvserve.kv.formats.full import FloatFormat
from kvserve.kv.formats.int4 import INT4
from kvserve.kv.formats.int8 import INT8
from kvserve.layers.linear import Linear


class NativeCPUBackend(SDPABackend):
    def __init__(self, cache: KVCache, bf16_past: int | None = None):
        super().__init__(cache, bf16_past)
        layout, residual = cache.layout, cache.residual_k is not None
        codes = (layout.k_format.code, layout.v_format.code, layout.residual_format.code if residual else 0)
        # the kernel's arguments for each layer of a group, made once: K and V stores, their formats, the residual pool's
        self.stores = [None if j in cache.merged else
                       (list(cache.k[j].values()), list(cache.v[j].values()), *codes[:2],
                        list(cache.residual_k[j].values()) if residual else [],
                        list(cache.residual_v[j].values()) if residual else [], codes[2]) for j in range(layout.layers_per_group)]
        self.windows = [w or 0 for w in layout.windows]
        written = layout.residual_format if residual else layout.k_format  # the format new tokens land in
        native = lambda f: isinstance(f, FloatFormat | FP8Format) or f in (INT8, INT4)  # noqa: E731  formats the kernel writes itself
        self.writes = native(written) and (residual or native(layout.v_format))
        self.stack, self.stack_rows, self.stack_depth, self.whole = None, 0, 0, None

    def stack_layers(self, model: torch.nn.Module) -> None:
        """Bind a model's fused decoder layers (models/llama.py: DecoderLayer.fuse), all of them, to their stores,
        with its rotary tables and final norm: then a step this backend runs whole runs the layer loop and the norm
        in one native call (kernels/decode_layer.cpp: DecodeStack)."""
        layers = list(model.layers)
        if not self.writes or any(getattr(layer, "fused", None) is None for layer in layers) or None in self.stores:
            return
        self.stack, self.stack_rows = torch.classes.kvserve.DecodeStack(), min(layer.fused_rows for layer in layers)
        packed = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
        self.stack_depth, self.batch_invariant = len(layers), all(m.row_invariant for m in packed)
        rope_kinds = list(dict.fromkeys(layer.self_attn.rope for layer in layers))
        for kind in rope_kinds:
            self.stack.add_rope(model.rotary[kind].cos, model.rotary[kind].sin)
        self.stack.set_norm(model.norm.weight.detach(), model.norm.eps)
        for layer in layers:
            g, j = self.cache.slot[layer.self_attn.layer]
            self.stack.add(layer.fused, *self.stores[j], g, rope_kinds.index(layer.self_attn.rope))
        ends = model.decode_ends()
        if ends is not None:
            self.stack.set_ends(*ends[0])
            self.whole = native_module().WholeStep(self.stack, self.windows, self.cache.block_size)
            self.decode_rows = min(self.stack_rows, ends[1])

    def decode(self, tokens: list[int], positions: list[int], tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step of plain decodes (each row's token and position, block tables [groups, B, W]) in one native call:
        the hidden states, the logits and each row's argmax (kernels/decode_layer.cpp: WholeStep)."""
        return self.whole.decode(tokens, positions, tables)

    def run_layers(self, x: torch.Tensor, ctx: ForwardContext, num_layers: int | None) -> torch.Tensor | None:
        if self.stack is None or ctx.step_arguments is None or x.shape[0] > self.stack_rows:
            return None
        tables, lens, windows, slots, hidden = zip(*ctx.step_arguments)
        return self.stack.forward(x, ctx.positions, tables, lens, windows, slots, self.stack_depth if num_layers is None else num_layers,
                                  hidden[0])

    def step_arguments(self, ctx: ForwardContext) -> list[tuple] | None:
        """Per KV group, the kernel's arguments of this step (block tables, context lengths, window, slots and the keys
        each query skips) where it writes and attends for every token: a step of decodes alone, over a float, fp8, int8
        or int4 cache, with no votes."""
        group = ctx.groups[0]
        if not (self.writes and group.in_order and group.is_decode and group.score_from is None):
            return None
        return [(group.block_tables[g], group.context_lens[g], self.windows[g], ctx.slot_mappings[g], group.hidden)
                for g in range(len(self.windows))]

    def layer_arguments(self, layer: int, ctx: ForwardContext) -> tuple | None:
        """The native kernel's arguments for this layer in this step (its stores, then the step's), or None."""
        g, j = self.cache.slot[layer]
        if ctx.step_arguments is None or self.stores[j] is None:
            return None
        return self.stores[j] + ctx.step_arguments[g]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, ctx: ForwardContext, scale: float,
                value_dims: int | None = None) -> torch.Tensor:
        arguments = self.layer_arguments(layer, ctx) if v is not None else None
        if arguments is not None:
            *stores, tables, lens, window, slots, hidden = arguments
            return native_ops().paged_decode_attention(q, stores[0], stores[1], tables, lens, scale, *stores[2:], window, k, v, slots, hidden)
        return super().forward(layer, q, k, v, ctx, scale, value_dims)

    def write(self, j: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor) -> None:
        if v is None or self.stores[j] is None or not self.writes:
            return super().write(j, k, v, slots)
        native_ops().paged_write_kv(*self.stores[j], k, v, slots)

    def attend(self, g: int, j: int, q: torch.Tensor, group: QueryGroup, scale: float, value_dims: int | None = None) -> torch.Tensor:
        if value_dims is not None or self.stores[j] is None:  # the kernels read K and V stores of one width, unmerged
            return super().attend(g, j, q, group, scale, value_dims)
        k, v, *formats = self.stores[j]
        if not group.is_decode:  # the prompt kernel takes head sizes of whole vectors; on AMX, SDPA's bf16 tiles are faster
            if q.shape[-1] % 8 or (self.bf16_past is not None and q.shape[0] > self.bf16_past):
                return super().attend(g, j, q, group, scale, value_dims)
            return native_ops().paged_prompt_attention(q, k, v, group.block_tables[g], group.context_lens[g], group.query_index, scale,
                                                       *formats, self.windows[g])
        return native_ops().paged_decode_attention(q if group.in_order else q[group.flat_index], k, v, group.block_tables[g],
                                                   group.context_lens[g], scale, *formats, self.windows[g], hidden=group.hidden)
