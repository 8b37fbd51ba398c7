"""Property-based: random arrivals, lengths, aborts and tiny pools never leak, double free or deadlock."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, KVServeError
from tests.conftest import greedy

PREFIXES = [list(range(1, 13)), list(range(20, 32))]


def check_invariants(engine) -> None:
    bm = engine.block_manager
    owners: dict[int, int] = {}
    for seq in engine.sequences.values():
        for block_id in seq.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.id, 0), f"block {block.id} ref count {block.ref_count}"
        assert (block.ref_count == 0) == (block.id in bm.free_ids)
    assert bm.num_cached_free == sum(1 for i in bm.free_ids if bm.blocks[i].hash is not None)
    assert all(bm.blocks[i].hash == h for h, i in bm.cached.items())


request = st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(1, 12), st.integers(0, 4))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    cache = {}

    def get(num_blocks, budget, mode, prefix):
        key = (num_blocks, budget, mode, prefix)
        if key not in cache:
            cache[key] = LLM(str(tiny_model_dir), num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                             max_num_seqs=4, preemption_mode=mode, enable_prefix_caching=prefix).engine
        return cache[key]
    return get


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_blocks=st.sampled_from([4, 6, 10]), budget=st.sampled_from([3, 8, 64]), mode=st.sampled_from(["recompute", "swap"]),
       prefix=st.booleans(), requests=st.lists(request, min_size=1, max_size=8), abort_at=st.lists(st.integers(0, 30), max_size=3))
def test_random_workloads_never_leak_or_deadlock(engines, num_blocks, budget, mode, prefix, requests, abort_at):
    engine = engines(num_blocks, budget, mode, prefix)
    pending = list(requests)  # (prefix index or 2 for none, extra tokens, max_tokens, arrival step)
    ids, finished, step = [], set(), 0
    while pending or engine.has_unfinished_requests():
        for item in [r for r in pending if r[3] <= step]:
            pending.remove(item)
            which, extra, max_tokens, _ = item
            prompt = (PREFIXES[which] if which < 2 else []) + [100 + (step * 7 + i) % 100 for i in range(extra)]
            try:
                ids.append(engine.add_request(prompt, greedy(max_tokens)))
            except KVServeError:
                assert len(prompt) + max_tokens > num_blocks * 4  # only a request that cannot fit is refused
        if step in abort_at and ids:
            engine.abort_request(ids[step % len(ids)])
        finished |= {o.request_id for o in engine.step() if o.finished}
        check_invariants(engine)
        step += 1
        assert step < 2000, "no progress: deadlock"
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.sequences
