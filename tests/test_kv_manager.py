"""Property-based, for every KV layout, with and without speculative decoding (its rollbacks, a draft's own pool):
random arrivals, lengths, aborts and tiny pools never leak, double free or deadlock, and prefix-cache hits still
happen."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, KVServeError
from tests.conftest import greedy

PREFIXES = [list(range(1, 13)), list(range(20, 32))]


LAYOUTS = ["float32", "int8", "int4", "kivi2", "sliding"]  # sliding: a full and a sliding (6-token window) group, float32


def check_invariants(engine) -> None:
    kv = engine.kv_manager
    owners: dict[int, int] = {}
    for seq in (s for seqs in engine.requests.values() for s in seqs):
        for table, window in zip(seq.block_tables.ids.tolist(), kv.windows):
            live = [b for b in table if b != -1]
            assert table[len(table) - len(live):] == live and (window or len(live) == len(table))  # NULLs only lead
            if window:  # the window's blocks and a step's tokens, no more
                assert len(live) <= -(-(window - 1 + kv.chunk_tokens) // kv.block_size) + 1
        for block_id in (b for table in seq.block_tables for b in table if b != -1):
            owners[block_id] = owners.get(block_id, 0) + 1
        if kv.residual:  # packed blocks lead, residual blocks follow
            kinds = [b in kv.residual for b in seq.block_tables[0]]
            assert kinds == [False] * seq.num_packed_blocks + [True] * (len(kinds) - seq.num_packed_blocks)
    for pool in [kv.pool] + ([kv.residual] if kv.residual else []):
        for block in pool.blocks:
            assert block.ref_count == owners.get(block.id, 0), f"block {block.id} ref count {block.ref_count}"
            assert (block.ref_count == 0) == (block.id in pool.free_ids)
        assert all(type(i) is int for i in pool.free_ids)  # no NumPy integer leaked from a block table
        assert pool.num_cached_free == sum(1 for i in pool.free_ids if pool.block(i).hash is not None)
        assert all(pool.block(i).hash == h for h, i in pool.cached.items())
    assert not kv.residual or not kv.residual.cached  # float residual blocks are never shared


def run_workload(engine, requests, abort_at: list[int], params, refused, after_step=lambda: None) -> None:
    """Drive an engine through requests arriving at their steps, (prefix index or 2 for none, extra tokens,
    max_tokens, arrival step, option), with aborts at the `abort_at` steps, until all are done; params(max_tokens,
    option) makes a request's SamplingParams, refused(prompt, max_tokens, option) checks a refusal was right."""
    pending, ids, step = list(requests), [], 0
    while pending or engine.has_unfinished_requests():
        for item in [r for r in pending if r[3] <= step]:
            pending.remove(item)
            which, extra, max_tokens, _, option = item
            prompt = (PREFIXES[which] if which < 2 else []) + [100 + (step * 7 + i) % 100 for i in range(extra)]
            try:
                ids.append(engine.add_request(prompt, params(max_tokens, option)))
            except KVServeError:
                refused(prompt, max_tokens, option)
        if step in abort_at and ids:
            engine.abort_request(ids[step % len(ids)])
        engine.step()
        check_invariants(engine)
        after_step()
        step += 1
        assert step < 2000, "no progress: deadlock"


request = st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 12), st.integers(0, 4), st.integers(1, 3))


@pytest.fixture(scope="module")
def engines(tiny_model_dir_d32, tiny_sliding_dir):
    cache = {}

    def get(num_blocks, budget, mode, prefix, layout, speculative):
        key = (num_blocks, budget, mode, prefix, layout, speculative)
        model = tiny_sliding_dir if layout == "sliding" else tiny_model_dir_d32
        layout = "float32" if layout == "sliding" else layout
        if key not in cache:
            cache[key] = LLM(str(model), num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                             max_num_seqs=4, preemption_mode=mode, enable_prefix_caching=prefix, kv_cache_dtype=layout,
                             kivi_residual=8, speculative=speculative).engine
        return cache[key]
    return get


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_blocks=st.sampled_from([4, 6, 10]), budget=st.sampled_from([3, 8, 64]), mode=st.sampled_from(["recompute", "swap"]),
       prefix=st.booleans(), layout=st.sampled_from(LAYOUTS), requests=st.lists(request, min_size=1, max_size=8),
       abort_at=st.lists(st.integers(0, 30), max_size=3),
       speculative=st.sampled_from([None, "ngram:k=3,min_n=1,min_acceptance=0,max_batch=64,min_speedup=0",
                                    "self:layers=1,k=2,min_acceptance=0,max_batch=64,min_speedup=0"]))
def test_random_workloads_never_leak_or_deadlock(engines, num_blocks, budget, mode, prefix, layout, requests, abort_at,
                                                 speculative):
    engine = engines(num_blocks, budget, mode, prefix, layout, speculative)

    def refused(prompt, max_tokens, n):  # only a request that cannot fit is refused
        assert len(prompt) + max_tokens > engine.max_request_tokens

    run_workload(engine, requests, abort_at, lambda max_tokens, n: greedy(max_tokens, n=n), refused)
    kv = engine.kv_manager
    assert kv.pool.num_used == 0 and all(b.ref_count == 0 for b in kv.pool.blocks)
    assert speculative is None or getattr(engine.proposer, "kv", kv).pool.num_used == 0  # a draft's shadows let go
    assert not kv.residual or kv.residual.num_used == 0
    assert not engine.requests


def test_block_table_grows_truncates_and_writes_through_its_rows():
    from kvserve.kv.block_table import NULL, BlockTable

    table = BlockTable(2)
    for i in range(40):  # past the first capacity, so the array grows while rows keep their values
        table.extend([[i], [100 + i]])
    assert len(table) == 40 and table[0].tolist() == list(range(40)) and table[1].tolist() == list(range(100, 140))
    table[1][0] = NULL  # a row is a view of the table
    assert table.ids[1, 0] == NULL and table.num_held() == 79
    assert table.truncate(38) == [[38, 39], [138, 139]] and len(table) == 38
    table.assign([[7, 8], [9, NULL]])
    assert table.ids.tolist() == [[7, 8], [9, NULL]] and [row.tolist() for row in table] == [[7, 8], [9, NULL]]
    assert table.truncate(0) == [[7, 8], [9, NULL]] and len(table) == 0 and table.num_held() == 0
