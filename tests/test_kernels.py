"""The GGUF-block matmul equals fp32 math on the dequantized weights, and the engine gives the same answers with it."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvserve import LLM
from kvserve.kernels import gguf_ops
from kvserve.layers.linear import Linear
from tests.conftest import greedy

pytestmark = pytest.mark.skipif(gguf_ops() is None, reason="no AVX2 CPU or no C++ compiler")
TYPES = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 13, 32])
def test_matmul_equals_dequantized_fp32(qtype, rows):
    rng = np.random.default_rng(rows)
    blocks = gguf.quants.quantize(rng.standard_normal((80, 192)).astype(np.float32), qtype)
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    out = gguf_ops().gguf_matmul(x, torch.from_numpy(blocks))
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_linear_uses_blocks_only_for_few_rows():
    blocks = gguf.quants.quantize(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32), TYPES[1])
    layer = Linear(64, 8, bias=False)
    layer.blocks = torch.from_numpy(blocks)  # deliberately not the values of layer.weight: shows which path ran
    x = torch.randn(40, 64)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, TYPES[1]).astype(np.float32))
    torch.testing.assert_close(layer(x[:2]), x[:2] @ dequantized.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_unsupported_block_size_is_a_clear_error():
    with pytest.raises(RuntimeError, match="unsupported GGUF block of 22 bytes"):
        gguf_ops().gguf_matmul(torch.randn(1, 64), torch.zeros(4, 44, dtype=torch.uint8))


def test_smollm2_decodes_the_same_with_and_without_blocks(smollm2):
    assert sum(getattr(m, "blocks", None) is not None for m in smollm2.engine.runner.model.modules()) == 121
    plain = LLM("smollm2-135m", gguf_kernels=False, kv_cache_memory="64MiB")
    assert not any(getattr(m, "blocks", None) is not None for m in plain.engine.runner.model.modules())
    prompts = ["The three primary colors are", "def fibonacci(n):"]
    assert [o.token_ids for o in smollm2.generate(prompts, greedy(24), use_tqdm=False)] == \
        [o.token_ids for o in plain.generate(prompts, greedy(24), use_tqdm=False)]
