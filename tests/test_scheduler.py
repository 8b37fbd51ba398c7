"""Continuous batching: a request's greedy output does not depend on how it was scheduled."""
from __future__ import annotations

import pytest

from kvserve import LLM, KVServeError
from tests.conftest import FP32, greedy, parted_at_near_ties

PROMPTS = ["The capital of France is", ("Write a short story about a dragon who learns to program computers. The dragon lives in a cave "
            "high in the mountains and has never seen a computer before. Once upon"),
           "List three colors:", "In 1969, the first humans"]
NEW = 24


@pytest.fixture(scope="module")
def alone(smollm2):
    return [smollm2.generate(p, greedy(NEW), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def _run(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)
    engine = llm.engine
    assert engine.kv_manager.pool.num_used == 0 and all(b.ref_count == 0 for b in engine.kv_manager.pool.blocks)
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_alone(smollm2, alone):
    assert _run(smollm2) == alone


def test_chunked_prefill_mixed_with_decodes_equals_alone(alone):
    llm = LLM("smollm2-135m", max_num_batched_tokens=7, enable_prefix_caching=False, **FP32)
    assert _run(llm) == alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_equals_alone(alone, mode):
    llm = LLM("smollm2-135m", num_blocks=12, block_size=8, preemption_mode=mode, enable_prefix_caching=False, **FP32)
    assert _run(llm) == alone
    assert llm.engine.scheduler.stats.num_preemptions > 0


def test_static_batching_equals_alone(alone):
    llm = LLM("smollm2-135m", scheduler="static", **FP32)
    assert _run(llm) == alone


def test_prefix_cached_equals_alone(smollm2, alone):
    first = smollm2.generate(PROMPTS[1], greedy(NEW), use_tqdm=False)[0]
    again = smollm2.generate(PROMPTS[1], greedy(NEW), use_tqdm=False)[0]
    assert again.metrics.cached_tokens == 16  # of its 33 tokens: two blocks, less one so that two tokens are left to compute
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == alone[1]


def test_request_larger_than_pool_fails_and_others_continue(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_blocks=8, block_size=4)  # 32 token slots
    engine = llm.engine
    ids = [engine.add_request(list(range(1, 9)), greedy(6)) for _ in range(2)]
    engine.step()
    with pytest.raises(KVServeError, match="at most 32 tokens per request"):
        engine.add_request(list(range(1, 41)), greedy(4))
    with pytest.raises(KVServeError, match="max_tokens 30 is too large"):
        engine.add_request(list(range(1, 9)), greedy(30))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == sorted(ids) and all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    assert engine.kv_manager.pool.num_used == 0


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=7), dict(num_blocks=12, block_size=8, preemption_mode="recompute")],
                         ids=["chunked", "recompute"])
def test_int8_kv_scheduled_equals_alone(options):
    """int8 blocks hold the same values however a request was batched, chunked or recomputed, up to the last bits
    of batched matmuls (a recomputed token's K/V come from the prefill GEMM, not the decode kernel), which a step of
    the int8 grid can turn into a near-tie's flip: outputs agree, or part only where the alone run's top two were
    within 0.05 nats. (Swapped blocks are compared byte for byte in tests/test_kv_formats.py.)"""
    params = greedy(NEW, logprobs=2)
    alone_llm = LLM("smollm2-135m", kv_cache_dtype="int8", kv_cache_memory="64MiB", **FP32)
    alone = [alone_llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
    llm = LLM("smollm2-135m", kv_cache_dtype="int8", enable_prefix_caching=False, **{"kv_cache_memory": "64MiB", **options}, **FP32)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert llm.engine.kv_manager.pool.num_used == 0
    assert parted_at_near_ties(alone, outs, 0.05) <= 1
    if "preemption_mode" in options:
        assert llm.engine.scheduler.stats.num_preemptions > 0
