"""fp32 on CPU: decode queries go to kvserve.kernels, which reads each sequence's blocks in place, in any
KV format, dequantizing in registers; prefill chunks use SDPA."""
from __future__ import annotations

import torch

from kvserve.attention import QueryGroup
from kvserve.attention.sdpa import SDPABackend
from kvserve.kernels import native_ops
from kvserve.kv.cache import KVCache


class NativeCPUBackend(SDPABackend):
    def __init__(self, cache: KVCache):
        super().__init__(cache)
        layout, residual = cache.layout, cache.residual_k is not None
        codes = (layout.k_format.code, layout.v_format.code, layout.residual_format.code if residual else 0)
        # the kernel's arguments for each layer of a group, made once
        self.stores = [None if j in cache.merged else
                       (list(cache.k[j].values()), list(cache.v[j].values()), *codes[:2],
                        list(cache.residual_k[j].values()) if residual else [],
                        list(cache.residual_v[j].values()) if residual else [], codes[2]) for j in range(layout.layers_per_group)]
        self.windows = [g.spec.window or 0 for g in layout.groups]

    def attend(self, g: int, j: int, q: torch.Tensor, group: QueryGroup, scale: float, value_dims: int | None = None) -> torch.Tensor:
        if not group.is_decode or value_dims is not None or self.stores[j] is None:  # the kernel reads K and V stores of one width, unmerged
            return super().attend(g, j, q, group, scale, value_dims)
        k, v, k_code, v_code, k_res, v_res, res_code = self.stores[j]
        return native_ops().paged_decode_attention(q if group.in_order else q[group.flat_index], k, v, group.block_tables[g], group.context_lens[g], scale,
                                                   k_code, v_code, k_res, v_res, res_code, self.windows[g])
