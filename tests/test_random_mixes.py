"""Random mixes of requests (shared prefixes, n > 1, seeded sampling, penalties, stop tokens, logprobs) in a small pool
under a small step budget (and a RAM tier past it): every request's tokens equal its own run alone in a roomy engine with the same settings,
whatever shares its steps, preempts it or is cached; with aborts mid-way, the pool ends empty."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import FP32

SETTINGS = {
    "recompute": {},
    "swap": dict(preemption_mode="swap"),
    "ngram": dict(speculative="ngram:k=3"),  # seeded samples may differ (guesses take draws): greedy ones compared
    "swap-ngram": dict(preemption_mode="swap", speculative="ngram:k=3"),
    "cpu-tier": dict(kv_tiers=["cpu:1MiB"]),  # evicted prefixes come back from RAM
    "int8": dict(kv_cache_dtype="int8"),
    "streaming": dict(kv_policy="streaming:sinks=2,window=8"),
    "h2o": dict(kv_policy="h2o:budget=0.5"),
}


def random_mix(seed: int, n_allowed: bool) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    mix = []
    for _ in range(rng.randint(6, 12)):
        base = rng.choice(prefixes)
        prompt = base[:rng.randint(1, len(base))] + [rng.randrange(256) for _ in range(rng.randint(0, 20))]
        kw = dict(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.7, temperature=0.0)
        if rng.random() < 0.5:
            kw.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randint(0, 1000), top_k=rng.choice([-1, 5]))
            kw["n"] = rng.randint(2, 3) if n_allowed and rng.random() < 0.3 else 1
        if rng.random() < 0.2:
            kw["logprobs"] = 2
        if rng.random() < 0.2:
            kw["repetition_penalty"] = 1.3
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.randrange(256)]
        mix.append((prompt, SamplingParams(**kw)))
    return mix


def run(llm: LLM, mix, abort_at: dict[int, str] | None = None) -> dict[str, list]:
    engine, done, steps = llm.engine, {}, 0
    for i, (prompt, params) in enumerate(mix):
        engine.add_request(prompt, params, request_id=f"r{i}")
    while engine.has_unfinished_requests():
        done |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
        steps += 1
        if abort_at and abort_at.get(steps) in engine.requests:
            engine.abort_request(abort_at[steps])
    return done


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("seed", range(4))
def test_a_random_mix_equals_each_request_alone(tiny_model_dir_d32, name, seed):
    settings = SETTINGS[name]
    rng = random.Random(seed)
    common = dict(block_size=4, max_model_len=128, max_num_batched_tokens=rng.choice([16, 32]), **FP32, **settings)
    mix = random_mix(seed, n_allowed="kv_policy" not in settings)
    small = LLM(str(tiny_model_dir_d32), num_blocks=rng.choice([24, 32]), max_num_seqs=rng.choice([2, 4, 8]), **common)
    roomy = LLM(str(tiny_model_dir_d32), num_blocks=1024, max_num_seqs=1, **common)
    got = run(small, mix)
    for i, (prompt, params) in enumerate(mix):
        if params.temperature == 0 or "speculative" not in settings:
            assert got[f"r{i}"] == run(roomy, [(prompt, params)])["r0"], f"request {i}: {params}"
    assert small.engine.kv_manager.pool.num_used == 0
    run(small, mix, abort_at={rng.randint(1, 10): f"r{rng.randrange(len(mix))}" for _ in range(3)})
    assert small.engine.kv_manager.pool.num_used == 0
