"""The CUDA path: the same scheduling guarantees as on CPU (they run where torch sees a GPU), and the
device setting's errors (they run everywhere)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, KVServeError
from tests.conftest import FP32, greedy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")
PROMPTS = [list(range(1, 9)), list(range(40, 97)), [7] * 30, list(range(200, 203))]
NEW = 16


def _outputs(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)
    assert llm.engine.kv_manager.pool.num_used == 0
    return [o.outputs[0].token_ids for o in outs]


def test_bad_device_is_a_clear_error(tiny_model_dir):
    with pytest.raises(KVServeError, match="device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        LLM(str(tiny_model_dir), device="tpu")
    missing = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(KVServeError, match=f"device '{missing}'"):
        LLM(str(tiny_model_dir), device=missing)


def test_auto_device_picks_cuda_when_present(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_blocks=16)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert llm.engine.runner.kv_cache.device.type == expected
    assert next(llm.engine.runner.model.parameters()).device.type == expected


@needs_cuda
@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=7),  # prefill chunks mixed with decodes
    dict(num_blocks=20, block_size=4, preemption_mode="recompute"),
    dict(num_blocks=20, block_size=4, preemption_mode="swap"),
    dict(scheduler="static"),
], ids=["chunked", "recompute", "swap", "static"])
def test_cuda_batched_equals_alone(tiny_model_dir, options):
    alone_llm = LLM(str(tiny_model_dir), device="cuda", enable_prefix_caching=False)
    alone = [alone_llm.generate(p, greedy(NEW), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    llm = LLM(str(tiny_model_dir), device="cuda", enable_prefix_caching=False, **options)
    assert _outputs(llm) == alone
    if "preemption_mode" in options:
        assert llm.engine.scheduler.stats.num_preemptions > 0


@needs_cuda
def test_cuda_bfloat16_halves_kv_and_tracks_fp32(tiny_model_dir):
    fp32 = LLM(str(tiny_model_dir), device="cuda", num_blocks=16)
    bf16 = LLM(str(tiny_model_dir), device="cuda", num_blocks=16, dtype="bfloat16")
    assert bf16.engine.runner.kv_cache.nbytes * 2 == fp32.engine.runner.kv_cache.nbytes
    assert bf16.engine.layout.bytes_per_token * 2 == fp32.engine.layout.bytes_per_token
    a = fp32.generate(PROMPTS[1], greedy(1), use_tqdm=False)[0]
    b = bf16.generate(PROMPTS[1], greedy(1), use_tqdm=False)[0]
    la, lb = fp32.engine.runner.last_logits, bf16.engine.runner.last_logits
    assert la.dtype == lb.dtype == torch.float32
    assert (la - lb).abs().max() < 0.05 * la.abs().max()
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@needs_cuda
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8", "int4", "kivi2"])
def test_cuda_quantized_kv_tracks_the_cpu(tiny_model_dir_d32, dtype):
    """Every KV format runs on CUDA (SDPA over dequantized blocks) and holds what the CPU path holds."""
    options = dict(num_blocks=64, block_size=4, kv_cache_dtype=dtype, kivi_residual=8, **FP32)  # bf16 CPU matmuls would differ
    cpu, cuda = LLM(str(tiny_model_dir_d32), device="cpu", **options), LLM(str(tiny_model_dir_d32), device="cuda", **options)
    for llm in (cpu, cuda):
        llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)  # fills, packs (kivi2) and frees blocks
        assert llm.engine.kv_manager.pool.num_used == 0
    steps = []
    for llm in (cpu, cuda):
        llm.engine.add_request(PROMPTS[1], greedy(1))
        llm.engine.step()
        steps.append(llm.engine.runner.last_logits[0].cpu())
    torch.testing.assert_close(steps[1], steps[0], atol=1e-3, rtol=1e-3)
