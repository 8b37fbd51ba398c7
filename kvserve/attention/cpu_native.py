"""fp32 on CPU: decode queries go to kvserve.kernels, which reads each sequence's blocks in place, in any
KV format, dequantizing in registers; prefill chunks use SDPA."""
from __future__ import annotations

import torch

from kvserve.attention import QueryGroup
from kvserve.attention.sdpa import SDPABackend
from kvserve.kernels import native_ops


class NativeCPUBackend(SDPABackend):
    def attend(self, j: int, q: torch.Tensor, group: QueryGroup, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
        if not group.is_decode:
            return super().attend(j, q, group, block_tables, scale)
        cache, layout = self.cache, self.cache.layout
        residual = cache.residual_k is not None
        return native_ops().paged_decode_attention(
            q[group.flat_index], list(cache.k[j].values()), list(cache.v[j].values()), block_tables, group.context_lens,
            scale, layout.k_format.code, layout.v_format.code, list(cache.residual_k[j].values()) if residual else [],
            list(cache.residual_v[j].values()) if residual else [], layout.residual_format.code if residual else 0)
