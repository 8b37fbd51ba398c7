"""The KV cache is exact (cached decode == full recomputation) and its size is what the formula says."""
from __future__ import annotations

import torch

from kvserve import LLM
from tests.conftest import FP32, greedy
from tests.test_llama import step_logits


def test_cached_decode_equals_recomputation(smollm2):
    prompt = smollm2.engine.tokenize(smollm2.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}]),
                                     add_special_tokens=False)
    recompute = LLM("smollm2-135m", use_kv_cache=False, max_num_batched_tokens=512, **FP32)
    cached_tokens, cached_logits = step_logits(smollm2, prompt, 32)  # recomputing costs O(tokens^2): 64 took 21 s
    full_tokens, full_logits = step_logits(recompute, prompt, 32)
    assert len(cached_tokens) == 32
    assert cached_tokens == full_tokens
    torch.testing.assert_close(cached_logits, full_logits, atol=5e-4, rtol=0)
    assert recompute.engine.kv_manager.pool.num_used == 0


def test_kv_bytes_match_formula_and_tensors(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_blocks=32, block_size=8, kv_cache_dtype="float32")
    cfg = llm.engine.checkpoint.config  # 2 layers, 2 KV heads, head_dim 16
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert llm.engine.layout.bytes_per_token == per_token == 2 * 2 * 2 * 16 * 4
    assert llm.engine.runner.kv_cache.nbytes == 32 * 8 * per_token
    assert llm.engine.kv_usage()["total_bytes"] == 32 * 8 * per_token
    out = llm.generate(list(range(1, 21)), greedy(5), use_tqdm=False)[0]
    assert out.metrics.kv_bytes == (20 + 5 - 1) * per_token  # the last sampled token has no K/V yet


def test_kv_usage_reports_used_and_free_while_running(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_blocks=32, block_size=8, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(list(range(1, 21)), greedy(4))
    engine.step()
    usage = engine.kv_usage()
    assert usage["used_blocks"] == 3 and usage["free_blocks"] == 29
    assert usage["used_bytes"] + usage["free_bytes"] == usage["total_bytes"]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_usage()["used_bytes"] == 0
