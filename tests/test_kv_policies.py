"""KV eviction policies (kvserve.kv.policies): exact with a budget that holds everything, the kept tokens' K/V
moved correctly (a one-layer model, whose K/V depend on nothing but the token and its position, checked against a
plain-torch forward that attends to the kept tokens only), selections equal to the papers' rules computed from
transformers' own attention probabilities, block accounting under random workloads, bad parameters."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, KVServeError, SamplingParams
from kvserve.kv.policies import parse_policy
from tests.conftest import FP32, greedy, save_tiny_llama
from tests.test_kv_manager import run_workload

PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(60)]


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    path = tmp_path_factory.mktemp("one-layer")
    model = save_tiny_llama(path, num_hidden_layers=1, head_dim=32, attn_implementation="eager")
    with torch.no_grad():  # sharper attention than random init's, so heads weigh tokens differently
        for proj in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj):
            proj.weight.mul_(4)
    model.save_pretrained(path)
    return path, model


def engine(path, policy, **kw):
    options = dict(block_size=4, max_num_batched_tokens=64, kv_policy=policy, **FP32) | kw
    return LLM(str(path), **options)


@pytest.mark.parametrize("policy", ["streaming:sinks=4,window=400", "h2o:budget=1000", "h2o:budget=0.999", "snapkv:budget=1000"])
def test_a_budget_that_holds_everything_is_exact(tiny_model_dir, policy):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    base = engine(tiny_model_dir, None).generate([PROMPT, PROMPT[:17]], params, use_tqdm=False)
    llm = engine(tiny_model_dir, policy)
    outs = llm.generate([PROMPT, PROMPT[:17]], params, use_tqdm=False)
    for a, b in zip(base, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert b.metrics.num_evicted_tokens == 0
    assert llm.engine.kv_manager.pool.num_used == 0


def _track(policy_obj):
    """Wrap a policy's keep: record, for the step before each call, which token positions each KV head's cache held
    (the keys the step's last query attended to, itself included)."""
    state = {"maps": None, "seen": 0, "log": []}
    keep = policy_obj.keep

    def tracked(seq, votes):
        if state["maps"] is None:
            state["maps"] = [[] for _ in range(8)]
        maps = [m + list(range(state["seen"], seq.num_computed)) for m in state["maps"]]
        state["seen"] = seq.num_computed
        assert all(len(m) == seq.slots for m in maps)
        state["log"].append((seq.num_computed, [list(m) for m in maps]))
        kept = keep(seq, votes)
        if kept is not None:
            index = kept[0].expand(len(maps), -1) if kept.shape[1] == 1 else kept[0]
            maps = [[m[i] for i in index[h % len(index)].tolist()] for h, m in enumerate(maps)]
        state["maps"] = maps
        return kept

    object.__setattr__(policy_obj, "keep", tracked)
    return state


def _reference_logits(model, tokens: list[int], visible: list[list[int]], positions: list[list[int]] | None) -> torch.Tensor:
    """The one-layer transformers model's logits for the last token when each KV head attends only to `visible` token
    indices (at their positions, or at `positions`: slots, StreamingLLM)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, layer = model.model, model.model.layers[0]
    attn, cfg = layer.self_attn, model.config
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    with torch.no_grad():
        x = m.embed_tokens(torch.tensor([tokens]))
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, -1, heads, d).transpose(1, 2)
        k = attn.k_proj(h).view(1, -1, kv_heads, d).transpose(1, 2)
        v = attn.v_proj(h).view(1, -1, kv_heads, d).transpose(1, 2)
        out = torch.zeros(heads, d)
        for kvh in range(kv_heads):
            idx = torch.tensor(visible[kvh])
            pos = torch.tensor(positions[kvh] if positions is not None else visible[kvh])
            cos, sin = m.rotary_emb(x, pos[None])  # the query is the last visible token
            qh = apply_rotary_pos_emb(q[:, :, -1:], q[:, :, -1:], cos[:, -1:], sin[:, -1:])[0]
            kh = apply_rotary_pos_emb(k[:, :, idx], k[:, :, idx], cos, sin)[0]
            for r in range(heads // kv_heads):
                head = kvh * heads // kv_heads + r
                scores = (qh[0, head] @ kh[0, kvh].T) * d**-0.5
                out[head] = scores.softmax(-1) @ v[0, kvh, idx]
        x = x[:, -1] + attn.o_proj(out.reshape(1, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(m.norm(x))[0]


@pytest.mark.parametrize("policy", ["streaming:sinks=3,window=12", "streaming:sinks=0,window=12", "h2o:budget=0.5,recent=0.25",
                                    "h2o:budget=0.3", "snapkv:budget=16,window=6"])
def test_kept_tokens_are_the_ones_attended(one_layer, policy):
    """After evictions, the last decode step's logits equal attention over exactly the kept tokens."""
    path, model = one_layer
    llm = engine(path, policy, max_num_batched_tokens=16)
    llm.engine.kv_policy = llm.engine.resolve_policy(policy)
    state = _track(llm.engine.kv_policy)
    out = llm.generate([PROMPT], greedy(20), use_tqdm=False)[0]
    tokens = PROMPT + out.outputs[0].token_ids[:-1]
    assert out.metrics.num_evicted_tokens > 0
    computed, maps = state["log"][-1]
    assert computed == len(tokens)
    kv_heads = model.config.num_key_value_heads
    visible = maps[:kv_heads]
    positions = [list(range(len(m))) for m in visible] if policy.startswith("streaming") else None
    expected = _reference_logits(model, tokens, visible, positions)
    torch.testing.assert_close(llm.engine.runner.last_logits[-1].cpu(), expected, atol=2e-4, rtol=1e-4)
    if not policy.startswith("streaming"):  # heads kept different tokens
        assert visible[0] != visible[1]
    else:
        sinks = int(policy.split("sinks=")[1].split(",")[0])
        assert visible[0][:sinks] == list(range(sinks)) and visible[0][sinks:] == list(range(len(tokens) - len(visible[0]) + sinks, len(tokens)))


def _hf_attentions(model, tokens: list[int]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [a[0] for a in model(torch.tensor([tokens]), output_attentions=True).attentions]  # per layer [H, T, T]


def _per_kv_head(attn: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return attn.view(kv_heads, -1, *attn.shape[1:]).sum(1)  # [KVH, T, T]


def _votes_seen(llm):
    seen = []
    keep = llm.engine.kv_policy.keep

    def spy(seq, votes):
        kept = keep(seq, votes)
        seen.append((None if votes is None else votes.clone(), kept))
        return kept

    object.__setattr__(llm.engine.kv_policy, "keep", spy)
    return seen


def test_snapkv_selection_equals_the_papers_rule(tmp_path):
    model = save_tiny_llama(tmp_path, attn_implementation="eager")
    llm = engine(tmp_path, "snapkv:budget=20,window=8,kernel=5")
    seen = _votes_seen(llm)
    llm.generate([PROMPT], greedy(1), use_tqdm=False)
    votes, kept = seen[0]
    T, w, kv_heads = len(PROMPT), 8, model.config.num_key_value_heads
    for layer, attn in enumerate(_hf_attentions(model, PROMPT)):
        window_votes = _per_kv_head(attn, kv_heads)[:, -w:, :].sum(1)  # the observation window's attention
        torch.testing.assert_close(votes[layer], window_votes, atol=1e-5, rtol=1e-4)
        pooled = F.avg_pool1d(window_votes[:, None, :T - w], 5, stride=1, padding=2)[:, 0]
        for h in range(kv_heads):
            expected = sorted(pooled[h].topk(20 - w).indices.tolist() + list(range(T - w, T)))
            assert kept[layer, h].tolist() == expected


def test_h2o_selection_equals_the_papers_rule(tmp_path):
    model = save_tiny_llama(tmp_path, attn_implementation="eager")
    llm = engine(tmp_path, "h2o:budget=20,recent=0.5")
    seen = _votes_seen(llm)
    llm.generate([PROMPT], greedy(1), use_tqdm=False)
    votes, kept = seen[0]  # after the prefill: every prompt query has voted
    T, kv_heads = len(PROMPT), model.config.num_key_value_heads
    for layer, attn in enumerate(_hf_attentions(model, PROMPT)):
        accumulated = _per_kv_head(attn, kv_heads).sum(1)  # each key's attention from every query
        torch.testing.assert_close(votes[layer], accumulated, atol=1e-4, rtol=1e-4)
        for h in range(kv_heads):
            heavy = accumulated[h, : T - 10].topk(10).indices.tolist()
            assert kept[layer, h].tolist() == sorted(heavy + list(range(T - 10, T)))


def test_streaming_runs_three_times_past_the_context_window_in_bounded_blocks(tiny_model_dir):
    llm = engine(tiny_model_dir, "streaming:sinks=4,window=64", max_model_len=128, max_num_batched_tokens=32)
    eng = llm.engine
    eng.add_request(PROMPT, greedy(3 * 128))
    most = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        most = max(most, eng.kv_manager.pool.num_used)
    out = outs[0]
    assert len(out.outputs[0].token_ids) == 3 * 128 and out.outputs[0].finish_reason == "length"
    assert most <= -(-(4 + 64 + 4 - 1 + 32) // 4) + 1
    assert out.metrics.num_evicted_tokens >= len(PROMPT) + 3 * 128 - 4 - 64 - 4
    assert eng.kv_manager.pool.num_used == 0


def test_streaming_scores_a_prompt_longer_than_the_model(tiny_model_dir):
    llm = engine(tiny_model_dir, "streaming:sinks=4,window=32", max_model_len=96, max_num_batched_tokens=16)
    long = [(i * 13) % 250 + 1 for i in range(400)]
    out = llm.generate([long], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 400 and out.metrics.num_evicted_tokens > 300
    with pytest.raises(KVServeError, match="exceed"):
        engine(tiny_model_dir, None, max_model_len=96).generate([long[:90]], greedy(10), use_tqdm=False)


def test_a_request_picks_its_own_policy(tiny_model_dir):
    llm = engine(tiny_model_dir, None)
    params = dict(temperature=0, max_tokens=40, ignore_eos=True)
    plain, evicting = llm.generate([PROMPT, PROMPT], [SamplingParams(**params), SamplingParams(**params, kv_policy="h2o:budget=24")],
                                   use_tqdm=False)
    assert plain.metrics.num_evicted_tokens == 0 and plain.metrics.kv_policy is None
    assert evicting.metrics.num_evicted_tokens > 0 and evicting.metrics.kv_policy == "h2o:budget=24,recent=0.5"
    assert evicting.metrics.kv_bytes < plain.metrics.kv_bytes
    llm = engine(tiny_model_dir, "h2o:budget=24")
    out = llm.generate([PROMPT], SamplingParams(**params, kv_policy="none"), use_tqdm=False)[0]
    assert out.metrics.num_evicted_tokens == 0


def test_a_voting_request_leaves_the_others_attention_alone(tiny_model_dir, monkeypatch):
    """h2o's queries vote with their attention probabilities, which only the dense path computes; the requests beside
    one went through it too (a batch of 800-token contexts ran 12x slower, and their greedy tokens changed)."""
    from kvserve.attention.sdpa import SDPABackend

    voting_batches = []
    attend_voting = SDPABackend.attend_voting

    def spy(self, g, j, q, group, *args):
        voting_batches.append(len(group.block_tables[g]))
        return attend_voting(self, g, j, q, group, *args)

    monkeypatch.setattr(SDPABackend, "attend_voting", spy)
    llm = engine(tiny_model_dir, None)
    prompts = [PROMPT[i:i + 30] for i in range(0, 24, 8)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24), use_tqdm=False)]
    outs = llm.generate(prompts + [PROMPT], [greedy(24)] * 3 + [greedy(24, kv_policy="h2o:budget=24")], use_tqdm=False)
    assert outs[-1].metrics.num_evicted_tokens > 0 and voting_batches and set(voting_batches) == {1}
    assert [o.outputs[0].token_ids for o in outs[:3]] == plain


def test_shared_prefix_blocks_are_never_overwritten(tiny_model_dir):
    """A request's compaction replaces blocks the prefix cache holds; a later request hitting them gets plain K/V."""
    llm = engine(tiny_model_dir, None)
    base = llm.generate([PROMPT], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    evicting = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, kv_policy="snapkv:budget=16,window=8")
    llm.generate([PROMPT], evicting, use_tqdm=False)
    again = llm.generate([PROMPT], greedy(8), use_tqdm=False)[0]
    assert again.metrics.cached_tokens > 0 and again.outputs[0].token_ids == base


@pytest.mark.parametrize("policy", ["streaming:sinks=2,window=8", "h2o:budget=0.5", "snapkv:budget=8,window=4,kernel=3"])
def test_what_a_request_keeps_does_not_depend_on_what_shares_its_steps(tiny_model_dir, policy):
    """Alone, a 45-token prompt is read in 16-token chunks and evicts where each ends; beside requests that take part of
    each step's budget (and a prefix cached by a plain request) its chunks end elsewhere, yet it evicts at the same
    places and reuses no more of the prefix than it computes alike, so its greedy tokens are the same."""
    prompt, params = PROMPT[:45], greedy(12, kv_policy=policy)
    alone = engine(tiny_model_dir, None, max_num_batched_tokens=16).generate([prompt], params, use_tqdm=False)[0]
    llm = engine(tiny_model_dir, None, max_num_batched_tokens=16)
    llm.generate([prompt[:44]], greedy(1), use_tqdm=False)  # cached, for every policy's prefix lookup
    others = [[(i * 13 + 7) % 250 + 1 for i in range(n)] for n in (5, 9, 23)]
    outs = llm.generate(others + [prompt], [greedy(20)] * 3 + [params], use_tqdm=False)
    assert alone.metrics.num_evicted_tokens > 0
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[-1].metrics.num_evicted_tokens == alone.metrics.num_evicted_tokens
    reusable = parse_policy(policy).reusable_prefix(len(prompt), 16, 4)
    assert outs[-1].metrics.cached_tokens == reusable // 4 * 4  # 12 (first eviction at 16), 0 (h2o: every query votes), 40
    assert llm.engine.kv_manager.pool.num_used == 0


@pytest.mark.parametrize("policy, message", [
    ("h2o:budget=0", "budget must be > 0"), ("snapkv:budget=0", "budget must be > 0"),
    ("streaming:sinks=8,window=4", "sinks .8. must not be larger than the window"),
    ("streaming:sinks=1,window=2", "smaller than a block"), ("lru:budget=3", "unknown kv_policy"),
    ("h2o:size=3", "h2o takes budget=, recent="), ("h2o:budget=lots", "budget must be a number"),
    ("snapkv:budget=8,window=16", "must hold the window"), ("h2o:budget=0.2,budget=0.3", "option budget is given twice"),
])
def test_bad_parameters_get_one_clear_error(tiny_model_dir, policy, message):
    with pytest.raises(KVServeError, match=message):
        engine(tiny_model_dir, policy)
    llm = engine(tiny_model_dir, None)
    with pytest.raises(KVServeError, match=message):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, kv_policy=policy), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_policies_refuse_layouts_they_cannot_serve(tiny_sliding_dir, tiny_model_dir_d32, tiny_model_dir):
    with pytest.raises(KVServeError, match="needs full-attention layers"):
        LLM(str(tiny_sliding_dir), kv_policy="h2o:budget=8")
    with pytest.raises(KVServeError, match="kivi2"):
        LLM(str(tiny_model_dir_d32), kv_policy="h2o:budget=8", kv_cache_dtype="kivi2", block_size=4, kivi_residual=8)
    with pytest.raises(KVServeError, match="n = 1"):
        engine(tiny_model_dir, "h2o:budget=8").generate([PROMPT], SamplingParams(max_tokens=4, n=2), use_tqdm=False)


def test_a_quantized_cache_evicts_too(tiny_model_dir_d32):
    llm = engine(tiny_model_dir_d32, "streaming:sinks=4,window=16", kv_cache_dtype="int8")
    out = llm.generate([PROMPT], greedy(30), use_tqdm=False)[0]
    assert out.metrics.num_evicted_tokens > 0 and len(out.outputs[0].token_ids) == 30
    assert llm.engine.kv_manager.pool.num_used == 0


POLICIES = [None, "streaming:sinks=2,window=8", "h2o:budget=12", "h2o:budget=0.5", "snapkv:budget=8,window=4"]
request = st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 16), st.integers(0, 4), st.sampled_from(POLICIES))


@pytest.fixture(scope="module")
def engines(tiny_model_dir_d32):
    cache = {}

    def get(num_blocks, budget, mode, prefix, dtype):
        key = (num_blocks, budget, mode, prefix, dtype)
        if key not in cache or cache[key].requests:  # a failed example leaves requests behind: start afresh
            cache[key] = LLM(str(tiny_model_dir_d32), num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                             max_num_seqs=4, preemption_mode=mode, enable_prefix_caching=prefix, kv_cache_dtype=dtype).engine
        return cache[key]
    return get


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_blocks=st.sampled_from([8, 12, 20]), budget=st.sampled_from([4, 8, 64]), mode=st.sampled_from(["recompute", "swap"]),
       prefix=st.booleans(), dtype=st.sampled_from(["float32", "int8"]), requests=st.lists(request, min_size=1, max_size=8),
       abort_at=st.lists(st.integers(0, 30), max_size=3))
def test_random_workloads_with_eviction_never_leak(engines, num_blocks, budget, mode, prefix, dtype, requests, abort_at):
    engine = engines(num_blocks, budget, mode, prefix, dtype)
    assert not engine.requests and engine.kv_manager.pool.num_used == 0  # a failed example would leave it dirty

    def refused(prompt, max_tokens, policy):  # only a request that cannot fit is refused
        rule = parse_policy(policy)
        peak = rule.max_slots(len(prompt) + max_tokens, budget, 4) if rule else 0
        assert len(prompt) + max_tokens > engine.request_limit(rule) or engine.kv_manager.blocks_for(peak) > num_blocks

    def within_bounds():
        for seq in (s for seqs in engine.requests.values() for s in seqs):
            assert seq.swapped_kinds is not None or len(seq.block_tables[0]) * 4 >= seq.num_slots
            if seq.policy is not None and seq.status.value == "running" and not prefix:  # (shared blocks: see compact)
                bound = seq.policy.max_slots(seq.num_computed_tokens, budget, 4)
                assert seq.num_slots <= max(bound, seq.num_prompt_tokens)

    run_workload(engine, requests, abort_at, lambda max_tokens, policy: greedy(max_tokens, kv_policy=policy), refused, within_bounds)
    assert engine.kv_manager.pool.num_used == 0 and not engine.requests


def test_a_request_whose_kept_tokens_outgrow_the_pool_is_refused(tiny_model_dir):
    """streaming lifts the per-request token limit, not the pool's: a window and a step bigger than the pool is one error."""
    llm = engine(tiny_model_dir, "streaming:sinks=4,window=64", num_blocks=8)
    with pytest.raises(KVServeError, match="holds up to .* tokens at once .* more than the KV pool's 8 blocks"):
        llm.generate([PROMPT], greedy(100), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_manager.pool.num_used == 0
