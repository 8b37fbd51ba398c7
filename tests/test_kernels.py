"""kvserve.kernels: the GGUF-block matmul and paged decode attention equal plain torch, and the engine answers the same with them."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM
from kvserve.kernels import native_ops
from kvserve.layers.linear import Linear
from tests.conftest import FP32, greedy

pytestmark = pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
TYPES = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0]


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8-activation kernels see it: each block of 32 values rounded to a multiple of max|x| / 127."""
    g = x.unflatten(-1, (-1, 32))
    scale = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((g * inv).round() * scale).flatten(-2)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 32])
def test_matmul_equals_dequantized_fp32(qtype, rows, int8):
    rng = np.random.default_rng(rows)
    blocks = gguf.quants.quantize(rng.standard_normal((80, 192)).astype(np.float32), qtype)
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0  # a block of zeros: scale 0
    out = native_ops().gguf_matmul(x, torch.from_numpy(blocks), int8)
    torch.testing.assert_close(out, (int8_rows(x) if int8 else x) @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(qtype, int8):
    """Speculative verification multiplies a sequence's guesses with its last token: each row must come out
    bit for bit as it would alone, so that verified tokens equal one-token decoding."""
    blocks = torch.from_numpy(gguf.quants.quantize(np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32), qtype))
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([native_ops().gguf_matmul(x[i:i + 1], blocks, int8) for i in range(13)])
    for rows in range(2, 14):
        assert torch.equal(native_ops().gguf_matmul(x[:rows], blocks, int8), alone[:rows]), rows


def test_linear_uses_blocks_only_for_few_rows():
    blocks = gguf.quants.quantize(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32), TYPES[1])
    layer = Linear(64, 8, bias=False)
    layer.blocks = torch.from_numpy(blocks)  # deliberately not the values of layer.weight: shows which path ran
    x = torch.randn(300, 64)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, TYPES[1]).astype(np.float32))
    torch.testing.assert_close(layer(x[:2]), x[:2] @ dequantized.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x[:40]), x[:40] @ layer.weight.T)  # fp32, as W @ x^T
    torch.testing.assert_close(layer(x), x @ layer.weight.T)  # fp32, as x @ W^T


def test_linear_adds_bias_on_both_fp32_paths():
    layer = Linear(64, 8, bias=True)
    for rows in (5, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)


def test_unsupported_block_size_is_a_clear_error():
    with pytest.raises(RuntimeError, match="unsupported GGUF block of 22 bytes"):
        native_ops().gguf_matmul(torch.randn(1, 64), torch.zeros(4, 44, dtype=torch.uint8))


def test_smollm2_decodes_the_same_with_and_without_blocks(smollm2):
    assert sum(getattr(m, "blocks", None) is not None for m in smollm2.engine.runner.model.modules()) == 121
    plain = LLM("smollm2-135m", native_kernels=False, kv_cache_memory="64MiB", **FP32)
    assert not any(getattr(m, "blocks", None) is not None for m in plain.engine.runner.model.modules())
    prompts = ["The three primary colors are", "def fibonacci(n):"]
    assert [o.outputs[0].token_ids for o in smollm2.generate(prompts, greedy(24), use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(24), use_tqdm=False)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dim", [20, 64, 72])  # vectors and a scalar tail; one register tile; two tiles
@pytest.mark.parametrize("window", [0, 5, 9])  # 0: none; windows that start mid-block
def test_paged_decode_attention_equals_sdpa(heads, kv_heads, dim, window):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    block_size, lens = 8, [1, 7, 8, 23]  # lengths end mid-block and on a block boundary, with 8-key chunks and tails
    k_cache, v_cache = (torch.randn(16, block_size, kv_heads, dim, generator=g) for _ in range(2))
    tables = torch.randperm(16, generator=g)[:12].view(len(lens), 3)  # scattered, non-contiguous blocks
    if window:  # blocks wholly before the window are never read: point them past the pool
        for b, n in enumerate(lens):
            tables[b, :max(0, n - window) // block_size] = 10**6
    q = torch.randn(len(lens), heads, dim, generator=g)
    out = native_ops().paged_decode_attention(q, [k_cache], [v_cache], tables, torch.tensor(lens), 0.3, 0, 0, [], [], 0, window)
    for b, n in enumerate(lens):
        first = max(0, n - window) if window else 0
        keys, values = (c[tables[b].clamp(max=15)].flatten(0, 1)[first:n].transpose(0, 1) for c in (k_cache, v_cache))
        expected = F.scaled_dot_product_attention(q[b, :, None], keys, values, scale=0.3, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[b], expected, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_rejects_lengths_past_the_table():
    cache = torch.zeros(4, 4, 1, 8)
    with pytest.raises(RuntimeError, match="context length 9 does not fit 2 blocks"):
        native_ops().paged_decode_attention(torch.zeros(1, 1, 8), [cache], [cache], torch.tensor([[0, 1]]), torch.tensor([9]),
                                            1.0, 0, 0, [], [], 0)


def test_rms_norm_equals_torch():
    x, w = torch.randn(5, 3, 96), torch.randn(96)
    torch.testing.assert_close(native_ops().rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6))


@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_rope_in_place_equals_apply_rotary_on_strided_views(tokens):
    """q and k as the fused qkv projection's strided views, rotated in place; v untouched."""
    from kvserve.layers.rotary import RotaryEmbedding, apply_rotary

    heads, kv_heads, dim = 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    before = qkv.clone()
    cos, sin = RotaryEmbedding(dim, 512, 10000.0, None).tables(torch.randint(0, 512, (tokens,)), torch.float32)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    native_ops().rope_(q, cos, sin)
    native_ops().rope_(k, cos, sin)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], before[:, (heads + kv_heads) * dim:])


@pytest.mark.parametrize("width", [8, 1536, 13])  # one vector; SmolLM2's; a scalar tail only
def test_silu_and_mul_equals_torch(width):
    x = torch.randn(4, 2 * width) * 8  # large magnitudes: exp's clamped range
    x[0, 0], x[1, 1] = 100.0, -100.0
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(native_ops().silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_native_decode_step_equals_plain_torch(tiny_model_dir):
    """Norms, RoPE, SiLU-and-mul and decode attention by kvserve.kernels: the logprobs of plain torch."""
    params = greedy(16, logprobs=2)
    prompt = [(i * 37 + 11) % 250 + 1 for i in range(40)]
    native, plain = (LLM(str(tiny_model_dir), native_kernels=flag, **FP32).generate([prompt], params, use_tqdm=False)[0].outputs[0]
                     for flag in (True, False))
    assert native.token_ids == plain.token_ids
    for a, b in zip(native.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
