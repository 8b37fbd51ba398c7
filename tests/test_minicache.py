"""MiniCache (kv_policy minicache): layer pairs share one direction per token and head. Exact when every token is
retained; the cache's values equal a plain-torch reference of the paper's merge (SLERP of the pair's directions,
each layer's magnitudes, far tokens kept unmerged up to the block's retention slots) under random workloads with
chunked prefills, preemption, aborts and prefix hits; bytes as the layout says; bad parameters."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, KVServeError, SamplingParams
from kvserve.kv.policies.minicache import MergedStore
from tests.conftest import FP32, greedy, save_tiny_llama
from tests.test_kv_manager import run_workload

PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(60)]


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-4")
    save_tiny_llama(path, num_hidden_layers=4, head_dim=32)
    return path


def engine(path, policy, **kw):
    return LLM(str(path), **(dict(block_size=4, max_num_batched_tokens=64, kv_policy=policy, **FP32) | kw))


def test_retaining_every_token_is_exact(four_layers):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    base = engine(four_layers, None).generate([PROMPT, PROMPT[:17]], params, use_tqdm=False)
    llm = engine(four_layers, "minicache:start=0,threshold=0,retain=4")
    outs = llm.generate([PROMPT, PROMPT[:17]], params, use_tqdm=False)
    for a, b in zip(base, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert b.metrics.kv_policy == "minicache:start=0,t=0.6,threshold=0,retain=4"
    assert llm.engine.kv_manager.pool.num_used == 0


def test_cli_stats_line_names_the_layout(four_layers):
    from kvserve.entrypoints.cli import stats_line

    out = engine(four_layers, "minicache:start=2").generate([PROMPT], greedy(3), use_tqdm=False)[0]
    assert "(minicache:start=2,t=0.6,threshold=0.25,retain=2) |" in stats_line(out)


def test_merging_changes_the_output(four_layers):
    """Not a no-op: merging without retention moves the logits."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    base = engine(four_layers, None).generate([PROMPT], params, use_tqdm=False)[0].outputs[0].logprobs
    merged = engine(four_layers, "minicache:start=0,retain=0").generate([PROMPT], params, use_tqdm=False)[0].outputs[0].logprobs
    assert max(abs(x.logprob - y.logprob) for x, y in zip(base, merged)) > 1e-3


def _slerp(u, w, t):
    omega = torch.arccos((u * w).sum(-1, keepdim=True).clamp(-1, 1))
    return (torch.sin((1 - t) * omega) * u + torch.sin(t * omega) * w) / torch.sin(omega)


def _record(monkeypatch, written: dict) -> None:
    """Record in `written` the last vector each layer of a pair wrote at each slot: {(store, which): {slot: [heads, dim]}}."""
    original = MergedStore.write

    def write(self, which, x, slots):
        for slot, row in zip(slots.tolist(), x.float()):
            written.setdefault((id(self), which), {})[slot] = row.clone()
        original(self, which, x, slots)

    monkeypatch.setattr(MergedStore, "write", write)


def _check_against_reference(engine, written, policy) -> None:
    """Each running sequence's merged layers hold what the paper's merge of the written vectors gives."""
    cache, bs = engine.runner.kv_cache, engine.config.block_size
    for seq in (s for seqs in engine.requests.values() for s in seqs if s.status.value == "running"):
        for block_index, block in enumerate(seq.block_tables[0]):
            filled = min(bs, seq.num_slots - block_index * bs)
            if filled <= 0:
                continue
            slots = range(block * bs, block * bs + filled)
            for (a, b) in policy.pairs(engine.layout.num_layers):
                for store_index in (0, 1):  # K, V
                    store = cache.merged[a][store_index]
                    first = torch.stack([written[(id(store), 0)][s] for s in slots])  # [filled, heads, dim]
                    second = torch.stack([written[(id(store), 1)][s] for s in slots])
                    u, w = first / first.norm(dim=-1, keepdim=True), second / second.norm(dim=-1, keepdim=True)
                    far = torch.arccos((u * w).sum(-1).clamp(-1, 1)) / math.pi > policy.threshold  # [filled, heads]
                    kept = far & (far.long().cumsum(0) <= policy.retain)  # the first `retain` far tokens of each head
                    merged = _slerp(u, w, policy.t)
                    want_a = torch.where(kept[..., None], first, merged * first.norm(dim=-1, keepdim=True))
                    want_b = torch.where(kept[..., None], second, merged * second.norm(dim=-1, keepdim=True))
                    table = torch.tensor([[block]], device=cache.device)
                    got_a = cache.gather(a, table)[store_index][0, :filled]
                    got_b = cache.gather(b, table)[store_index][0, :filled]
                    torch.testing.assert_close(got_a, want_a, atol=1e-5, rtol=1e-4)
                    torch.testing.assert_close(got_b, want_b, atol=1e-5, rtol=1e-4)


request = st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 12), st.integers(0, 4), st.just(0))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=6), abort_at=st.lists(st.integers(0, 30), max_size=2),
       num_blocks=st.sampled_from([10, 64]), budget=st.sampled_from([5, 16]), prefix=st.booleans())
def test_the_cache_holds_the_papers_merge(four_layers, monkeypatch, requests, abort_at, num_blocks, budget, prefix):
    """Random arrivals, chunked prefills, recompute preemption (blocks reused: stale retention slots), aborts and
    prefix hits: after every step the merged layers equal the reference, and no block leaks."""
    policy_text = "minicache:start=1,threshold=0.45,retain=2"
    key = (num_blocks, budget, prefix)
    if key not in ENGINES:  # an engine and what was written into its cache, kept across examples (prefix hits)
        ENGINES[key] = engine(four_layers, policy_text, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=3,
                              enable_prefix_caching=prefix).engine, {}
    eng, written = ENGINES[key]
    _record(monkeypatch, written)
    policy = eng.layout.merge
    assert policy.pairs(4) == [(1, 2)]

    def refused(prompt, max_tokens, option):
        assert len(prompt) + max_tokens > eng.max_request_tokens

    run_workload(eng, requests, abort_at, lambda max_tokens, option: greedy(max_tokens), refused,
                 lambda: _check_against_reference(eng, written, policy))
    assert eng.kv_manager.pool.num_used == 0 and not eng.requests


ENGINES: dict = {}


def test_swap_preemption_keeps_the_merged_cache(four_layers):
    """Swapped-out blocks come back with their retention slots: the same tokens as a pool that never preempts."""
    prompts = [PROMPT[:30], PROMPT[10:40], PROMPT[20:50]]
    policy = "minicache:start=2,threshold=0.45,retain=2"
    want = engine(four_layers, policy).generate(prompts, greedy(20), use_tqdm=False)
    llm = engine(four_layers, policy, num_blocks=30, preemption_mode="swap", enable_prefix_caching=False)
    got = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4", "fp8_e4m3"])
def test_bytes_follow_the_layout(four_layers, dtype):
    base = engine(four_layers, None, kv_cache_dtype=dtype, num_blocks=20).engine
    eng = engine(four_layers, "minicache:start=2,retain=1", kv_cache_dtype=dtype, num_blocks=20).engine
    assert eng.runner.kv_cache.nbytes == 20 * eng.layout.block_bytes()
    # the last two layers cache one direction (+ magnitudes and one retained token a block) instead of two vectors
    assert 0.6 < eng.layout.bytes_per_token / base.layout.bytes_per_token < 0.87
    assert "1 merged layer pairs" in eng.layout.describe()


def test_the_middle_layer_is_the_default_start(four_layers):
    eng = engine(four_layers, "minicache").engine
    assert eng.layout.merge.start == 2 and str(eng.layout.merge) == "minicache:start=2,t=0.6,threshold=0.25,retain=2"


@pytest.mark.parametrize("policy, options, message", [
    ("minicache:start=3", {}, r"start must be a layer in \[0, 2\]"),
    ("minicache:t=1.5", {}, r"t is a SLERP weight in \[0, 1\]"),
    ("minicache:threshold=-0.1", {}, "threshold is an angular distance"),
    ("minicache:retain=5", {}, r"retain \(5\) is more than a block's 4 tokens"),
    ("minicache:retain=-1", {}, "retain must be >= 0"),
    ("minicache:start=0", {"kv_cache_dtype": "kivi2"}, "needs a per-token KV dtype"),
    ("minicache:start=0", {"speculative": "ngram:k=3"}, "cannot run with speculative decoding"),
])
def test_bad_settings_are_one_clear_error(four_layers, policy, options, message):
    with pytest.raises(KVServeError, match=message):
        engine(four_layers, policy, **options)


def test_a_two_layer_model_names_the_default_start(tiny_model_dir, tmp_path):
    """The middle layer of two is the last: no pair follows it, and the error says the start was the default. One
    layer has no pair at all."""
    with pytest.raises(KVServeError, match=r"start must be a layer in \[0, 0\] .*got the default, the middle layer \(1\)"):
        engine(tiny_model_dir, "minicache")
    assert engine(tiny_model_dir, "minicache:start=0").engine.layout.merge.start == 0
    save_tiny_llama(tmp_path, num_hidden_layers=1)
    with pytest.raises(KVServeError, match="merges pairs of layers; this model has 1"):
        engine(tmp_path, "minicache:start=0")


def test_sliding_layers_cannot_merge(tiny_sliding_dir):
    with pytest.raises(KVServeError, match="minicache merges full-attention layers; .* has sliding ones"):
        engine(tiny_sliding_dir, "minicache:start=0")


def test_a_request_cannot_change_the_layout(four_layers):
    plain = engine(four_layers, None)
    with pytest.raises(KVServeError, match="changes the KV layout: choose it per engine"):
        plain.generate([PROMPT], greedy(2, kv_policy="minicache:start=0"), use_tqdm=False)
    merged = engine(four_layers, "minicache:start=2")
    with pytest.raises(KVServeError, match="merges layers .* cannot add kv_policy h2o"):
        merged.generate([PROMPT], greedy(2, kv_policy="h2o:budget=0.5"), use_tqdm=False)
    out = merged.generate([PROMPT], greedy(2, kv_policy="minicache:start=2"), use_tqdm=False)  # its own: fine
    assert len(out[0].outputs[0].token_ids) == 2
    assert not merged.engine.has_unfinished_requests() and merged.engine.kv_manager.pool.num_used == 0
