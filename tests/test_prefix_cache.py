"""Prefix caching: chained block hashes, cached_tokens, salts, and invalidation of a changed block."""
from __future__ import annotations

from kvserve import LLM
from tests.conftest import greedy

BS = 4


def _llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_blocks=64, block_size=BS)


def _cached(llm: LLM, prompt: list[int], **params) -> int:
    return llm.generate(prompt, greedy(3, **params), use_tqdm=False)[0].metrics.cached_tokens


def test_repeated_prompt_reports_cached_tokens(tiny_model_dir):
    llm, prompt = _llm(tiny_model_dir), list(range(1, 19))  # 18 tokens: 4 full blocks
    assert _cached(llm, prompt) == 0
    assert _cached(llm, prompt) == 16
    stats = llm.engine.scheduler.stats
    assert stats.prefix_queries == 36 and stats.prefix_hits == 16


def test_fully_cached_prompt_still_computes_its_last_token(tiny_model_dir):
    llm, prompt = _llm(tiny_model_dir), list(range(1, 17))  # exactly 4 blocks
    first = llm.generate(prompt, greedy(3), use_tqdm=False)[0]
    again = llm.generate(prompt, greedy(3), use_tqdm=False)[0]
    assert again.metrics.cached_tokens == 12 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_salt_separates_tenants(tiny_model_dir):
    llm, prompt = _llm(tiny_model_dir), list(range(1, 19))
    assert _cached(llm, prompt, cache_salt="alice") == 0
    assert _cached(llm, prompt, cache_salt="bob") == 0
    assert _cached(llm, prompt) == 0
    assert _cached(llm, prompt, cache_salt="alice") == 16


def test_changed_token_invalidates_its_block_and_all_after(tiny_model_dir):
    llm, prompt = _llm(tiny_model_dir), list(range(1, 19))
    _cached(llm, prompt)
    changed = list(prompt)
    changed[9] = 200  # inside the third block
    assert _cached(llm, changed) == 8
    changed_first = [250] + prompt[1:]
    assert _cached(llm, changed_first) == 0


def test_cached_output_matches_uncached(tiny_model_dir):
    llm, prompt = _llm(tiny_model_dir), list(range(3, 40))
    cold = llm.generate(prompt, greedy(8), use_tqdm=False)[0]
    warm = llm.generate(prompt, greedy(8), use_tqdm=False)[0]
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False).generate(prompt, greedy(8), use_tqdm=False)[0]
    assert warm.metrics.cached_tokens == 32 and cold.outputs[0].token_ids == warm.outputs[0].token_ids == plain.outputs[0].token_ids


def test_unreferenced_cached_blocks_are_evicted_lru(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_blocks=8, block_size=BS)
    a, b = list(range(1, 10)), list(range(100, 109))  # 2 full blocks each
    _cached(llm, a)
    _cached(llm, b)
    assert llm.engine.kv_usage()["cached_blocks"] >= 4
    _cached(llm, list(range(50, 75)))  # needs 7 blocks: evicts the oldest cached ones first
    assert _cached(llm, b) == 4  # the more recent prompt keeps its first block (its tail went before it)...
    assert _cached(llm, a) == 0  # ...the older one lost all of its


def test_quantized_blocks_are_shared_too(tiny_model_dir_d32):
    """int8 blocks hit like float ones; kivi2 shares only packed blocks (its float residual is never shared)."""
    prompt = list(range(3, 40))  # 37 tokens: 9 full blocks
    int8 = LLM(str(tiny_model_dir_d32), num_blocks=64, block_size=BS, kv_cache_dtype="int8")
    cold = int8.generate(prompt, greedy(8), use_tqdm=False)[0]
    warm = int8.generate(prompt, greedy(8), use_tqdm=False)[0]
    assert warm.metrics.cached_tokens == 32 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    kivi2 = LLM(str(tiny_model_dir_d32), num_blocks=64, block_size=BS, kv_cache_dtype="kivi2", kivi_residual=8)
    kivi2.generate(prompt, greedy(8), use_tqdm=False)  # 44 tokens computed: blocks older than the newest 8 are packed
    assert kivi2.generate(prompt, greedy(8), use_tqdm=False)[0].metrics.cached_tokens == 32
    kv = kivi2.engine.kv_manager
    assert kv.residual.num_used == 0 and not kv.residual.cached
