"""The KV cache is exact (cached decode == full recomputation) and its size is what the formula says."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve import LLM
from kvserve.attention import sdpa
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


def test_chunk_after_cached_keys_equals_one_masked_pass():
    """Scores over the cached keys and the chunk's own, merged, are SDPA's over all of them with the chunk's mask
    (GQA; keys past the chunk, the rest of its last block, unseen)."""
    g = torch.Generator().manual_seed(0)
    cached, n, length = 37, 20, 64
    q, k, v = (torch.randn(1, heads, rows, 16, generator=g) for heads, rows in ((6, n), (2, length), (2, length)))
    mask = torch.arange(length)[None, :] <= cached + torch.arange(n)[:, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(sdpa._after_cached(q, k, v, cached, 0.25), expected, atol=1e-6, rtol=0)


def test_chunked_prompt_matches_one_pass(tiny_model_dir, monkeypatch):
    prompt = torch.randint(1, 200, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    options = dict(block_size=4, enable_prefix_caching=False, **FP32)
    whole = step_logits(LLM(str(tiny_model_dir), max_num_batched_tokens=64, **options), prompt, 4)
    calls = []
    split = sdpa._after_cached
    monkeypatch.setattr(sdpa, "_after_cached", lambda *a: calls.append(a[3]) or split(*a))
    chunked = step_logits(LLM(str(tiny_model_dir), max_num_batched_tokens=16, **options), prompt, 4)
    assert sorted(set(calls)) == [16, 32]  # the second and third chunks, in every layer
    assert chunked[0] == whole[0]
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-5, rtol=0)


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
