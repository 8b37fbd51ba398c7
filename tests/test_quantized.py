"""Weights kept in their GGUF file's format (layers/quantized.py): linear layers and embeddings read them packed,
SmolLM2 and Gemma 3 hold about their files' size, and a loaded model's resident memory stays near it."""
from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from kvserve import LLM
from kvserve.kernels import native_ops
from kvserve.layers.linear import Linear
from kvserve.layers.quantized import GGUFTensor, QuantizedWeight, packed_row_bytes
from kvserve.models.registry import resolve_model_path
from tests.conftest import FP32, greedy
from tests.test_kernels import T, random_blocks

pytestmark = pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")


def test_quantized_linear_uses_the_kernels_for_few_rows_and_tiles_for_many(monkeypatch):
    from kvserve.layers import quantized

    monkeypatch.setattr(quantized, "TILE_BYTES", 8 * 64 * 4)  # tiles of 8 rows: the GEMM runs over several
    blocks = random_blocks(T.Q4_1, 20, 64)
    layer = Linear(64, 20, bias=True)
    layer.use_quantized(QuantizedWeight.pack(GGUFTensor(torch.from_numpy(blocks), "Q4_1", (20, 64))))
    assert layer.weight is None
    values = torch.from_numpy(gguf.quants.dequantize(blocks, T.Q4_1).astype(np.float32))
    for rows in (2, 40, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), x @ values.T + layer.bias, rtol=1e-5, atol=1e-4)


def test_quantized_weight_parts_of_different_types_concatenate():
    """A fused projection whose parts the file stores in different types (Gemma 3's q/k Q5_0 and v Q8_0). Parts of a
    type merge where the first is whole panels of 16 rows (kernels/quants.h), else its last rows stay a part's tail."""
    parts = [(T.Q5_0, 32), (T.Q5_0, 16), (T.Q8_0, 8), (T.Q8_0, 8)]
    blocks = [random_blocks(t, n, 64, seed=i) for i, (t, n) in enumerate(parts)]
    weight = QuantizedWeight.cat([QuantizedWeight.pack(GGUFTensor(torch.from_numpy(b), t.name, (n, 64)))
                                  for b, (t, n) in zip(blocks, parts)])
    assert weight.types == ["Q5_0", "Q8_0", "Q8_0"] and weight.out_features == 64
    values = torch.cat([torch.from_numpy(gguf.quants.dequantize(b, t).astype(np.float32)) for b, (t, _) in zip(blocks, parts)])
    x = torch.randn(3, 64)
    torch.testing.assert_close(weight.matmul(x, False), x @ values.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(weight.dequantize(), values)
    ids = torch.tensor([[3, 0], [63, 3]])
    with pytest.raises(ValueError):  # an embedding is one part
        weight.rows(ids)


def test_smollm2_keeps_its_gguf_weights_packed(smollm2):
    model = smollm2.engine.runner.model
    quantized = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
    assert len(quantized) == 122 and all(m.weight is None for m in quantized)  # 30 x 4 linears, the embedding, the tied head
    assert model.lm_head.qweight is model.embed_tokens.qweight and model.lm_head.qweight.types == ["Q8_0"]
    size = resolve_model_path("smollm2-135m").stat().st_size
    assert 0.95 * size < model.weight_bytes() < 1.02 * size


def test_smollm2_decodes_the_same_with_packed_and_dequantized_weights(smollm2):
    plain = LLM("smollm2-135m", native_kernels=False, kv_cache_memory="64MiB", **FP32)
    assert not any(getattr(m, "qweight", None) is not None for m in plain.engine.runner.model.modules())
    prompts = ["The three primary colors are", "def fibonacci(n):"]
    assert [o.outputs[0].token_ids for o in smollm2.generate(prompts, greedy(24), use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(24), use_tqdm=False)]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_packed_row_bytes_are_the_kernels(qtype):
    """The planner's figure for a packed row (no kernels needed) equals the rows the kernels pack."""
    for cols in ((32, 96, 160, 576, 1536) if gguf.constants.GGML_QUANT_SIZES[T[qtype]][0] == 32 else (256, 768, 2048)):
        assert native_ops().gguf_pack(torch.from_numpy(random_blocks(T[qtype], 2, cols)), int(T[qtype])).shape[1] == \
            packed_row_bytes(qtype, cols)


def test_memory_planner_counts_the_weights_kvserve_holds(smollm2):
    """kvserve memory reads a GGUF's tensors: its weight bytes are those the loaded model holds, not parameters x 16 bits."""
    from kvserve.memory import load_spec

    assert load_spec("smollm2-135m").weight_bytes == smollm2.engine.runner.model.weight_bytes()


RSS = """
import os, sys
from kvserve import LLM
from kvserve.models.loader import open_checkpoint
def rss():
    return next(int(line.split()[1]) * 1024 for line in open(f"/proc/{os.getpid()}/status") if line.startswith("VmRSS"))
if sys.argv[1] == "model":
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB")
    print(rss(), llm.engine.kv_usage()["total_bytes"])
else:  # the same imports, the kernels and the tokenizer, no weights
    from kvserve.kernels import native_ops
    native_ops(), open_checkpoint("smollm2-135m")
    print(rss(), 0)
"""


def test_resident_memory_is_about_the_file_plus_the_kv_pool():
    """RSS after loading SmolLM2, minus a process that imported the same and loaded only the tokenizer: under 1.5x
    the GGUF file plus the KV pool (an fp32 copy of the weights alone would be 5.5x the file)."""
    procs = [subprocess.Popen([sys.executable, "-c", RSS, which], stdout=subprocess.PIPE, text=True) for which in ("base", "model")]
    (base, _), (loaded, pool) = ([int(n) for n in p.communicate()[0].split()] for p in procs)  # side by side: seconds each
    assert [p.returncode for p in procs] == [0, 0]
    size = resolve_model_path("smollm2-135m").stat().st_size
    print(f"resident: {(loaded - base) / 2**20:.0f} MiB more than the baseline; file {size / 2**20:.0f} MiB, KV pool {pool / 2**20:.0f} MiB")
    assert loaded - base < 1.5 * size + pool
