"""Speculative decoding: lossless verification, KV rollback, the ngram proposer, and its metrics."""
from __future__ import annotations

import json
import math
import random
import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, KVServeError, SamplingParams
from kvserve.kernels import native_ops
from kvserve.layers.sampler import SamplingBatch, sample
from kvserve.spec_decode import chain, depths, hidden_keys, path, verify
from kvserve.spec_decode.proposers import parse_speculative
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposer import WARM, Proposer
from tests.conftest import FP32, greedy
from tests.test_kv_manager import check_invariants

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold. Actions speak louder than words.")
COPY = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]


class OracleProposer(Proposer):
    """Guesses a reference continuation (by prompt); with an rng, wrong from a random point on, so that acceptance
    lengths are chosen."""

    def __init__(self, reference: dict[tuple, list[int]], k: int, rng: random.Random | None = None):
        super().__init__(k, min_acceptance=0, window=1, max_batch=64, min_speedup=0)  # batches verify guesses too
        self.reference, self.rng = reference, rng
        self.expected_accepted = self.proposed = 0

    def propose(self, seqs, limits: list[int]) -> list[list[int]]:
        return [self._propose(seq, limit) for seq, limit in zip(seqs, limits)]

    def _propose(self, seq, limit: int) -> list[int]:
        ref = self.reference[tuple(seq.token_ids[:seq.num_prompt_tokens])][len(seq.output_token_ids):]
        guesses = ref[:min(self.k, limit, len(ref))]
        right = self.rng.randint(0, len(guesses)) if self.rng else len(guesses)
        guesses = guesses[:right] + [(t + 1) % 256 for t in guesses[right:]]
        self.proposed += len(guesses)
        self.expected_accepted += right
        return guesses


def chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    """Two-sample chi-square homogeneity statistic over the categories either sample has, and its degrees of freedom."""
    counts = {}
    for i, sample_ in enumerate((a, b)):
        for x in sample_:
            counts.setdefault(x, [0, 0])[i] += 1
    stat = sum((x - y) ** 2 / (x + y) for x, y in counts.values())  # equal sample sizes
    return stat, len(counts) - 1


def critical(df: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.001 (z of the normal), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# --- the rule --------------------------------------------------------------------------------------------------

def test_verify_keeps_guesses_until_a_sample_differs():
    assert verify([], [], [7]) == ([7], [])
    assert verify([1, 2, 3], chain(3), [1, 2, 3, 9]) == ([1, 2, 3, 9], [0, 1, 2])
    assert verify([1, 2, 3], chain(3), [1, 5, 3, 9]) == ([1, 5], [0])
    assert verify([1, 2, 3], chain(3), [4, 2, 3, 9]) == ([4], [])


def test_verify_walks_a_tree_down_the_branch_its_samples_confirm():
    guesses, parents = [1, 2, 4, 6], [-1, 0, -1, 2]  # two branches under the newest token: 1 then 2, and 4 then 6
    assert verify(guesses, parents, [4, 0, 0, 6, 8]) == ([4, 6, 8], [2, 3])
    assert verify(guesses, parents, [1, 2, 0, 6, 8]) == ([1, 2, 0], [0, 1])
    assert verify(guesses, parents, [4, 2, 0, 7, 8]) == ([4, 7], [2])  # 2 is a guess, but not under 4
    assert verify(guesses, parents, [5, 2, 0, 6, 8]) == ([5], [])
    assert [path(parents, j) for j in range(4)] == [[0], [0, 1], [2], [2, 3]] and depths(parents) == [1, 2, 1, 2]
    assert hidden_keys(parents) == [0, 0, 0b11, 0b110]  # 4 skips 1 and 2; 6 skips them too, not 4
    assert hidden_keys(chain(5)) == [0] * 5


def test_rejection_rule_on_a_hand_made_distribution_equals_the_formula():
    """Guess x under target p: kept with probability min(1, p(x)/q(x)) = p(x) (q is a point mass); a rejection's
    token is distributed as max(0, p - q) normalized; with guesses side by side, p less all of them. Sampled
    through the engine's own sampler."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    x, n = 1, 20000
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=1)
    samples = sample(p.log().repeat(n, 1), SamplingBatch([params] * n, [gen] * n, [[]] * n, [0] * n, [[]] * n)).token_ids
    for guesses in ([x], [x, 3]):  # one guess; two, side by side (a tree): each kept with its own probability
        kept = [verify(guesses, [-1] * len(guesses), [s] + [0] * len(guesses))[0] for s in samples]
        for g in guesses:
            rate = sum(t == [g, 0] for t in kept) / n
            assert abs(rate - p[g].item()) < 4 * math.sqrt(p[g] * (1 - p[g]) / n)
        residual = (p - torch.nn.functional.one_hot(torch.tensor(guesses), 5).sum(0)).clamp(min=0)
        residual /= residual.sum()
        replaced = [t[0] for t in kept if len(t) == 1]
        stat = sum((replaced.count(i) - len(replaced) * residual[i].item()) ** 2 / (len(replaced) * residual[i].item())
                   for i in range(5) if residual[i] > 0)
        assert stat < critical(4 - len(guesses)) and not set(guesses) & set(replaced)


# --- the ngram proposer ----------------------------------------------------------------------------------------

class _Seq:
    """What a proposer reads of a sequence, for asking it outside the engine."""

    def __init__(self, tokens):
        self.token_ids, self.spec_state = tokens, None


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(k=3, n=3, min_n=1)
    propose = lambda seq, limit: proposer.propose([seq], [limit])[0]  # noqa: E731
    seq = _Seq([5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 0, 6, 7])
    assert propose(seq, 3) == [3, 4, 0]  # "6 7" last seen before "3 4 0"; no 3-gram "0 6 7" earlier
    seq.token_ids += [8]
    assert propose(seq, 3) == [9, 1, 2]  # "6 7 8" occurred: the longest n wins
    assert propose(seq, 2) == [9, 1]  # never past the limit
    assert propose(seq, 20) == [9, 1, 2, 6, 7, 3, 4, 0, 6, 7, 8]  # nor past the text
    assert propose(_Seq([1, 2, 3]), 4) == []


def test_a_sequence_whose_guesses_fail_is_paused():
    proposer = NgramProposer(k=4, n=1, min_n=1, min_acceptance=50, window=8)
    seq, other = _Seq([1, 2, 1, 2, 1]), _Seq([3, 3, 3])
    assert proposer.lookahead(seq) == 4
    proposer.record(seq, 4, 2)
    assert proposer.lookahead(seq) == 3  # one past the last accepted token; 2 of 4: too few guesses yet to judge
    proposer.record(seq, 4, 1)  # 3 of 8 accepted
    assert [proposer.lookahead(seq) for _ in range(9)] == [0] * 8 + [2]  # paused for the window, then tries again
    assert proposer.lookahead(other) == 4  # ngram: each sequence has its own gate
    proposer.record(seq, 8, 1)
    assert [proposer.lookahead(seq) > 0 for _ in range(17)] == [False] * 16 + [True]  # failing again: twice as long
    proposer.record(seq, 2, 2)
    assert proposer.lookahead(seq) == 4  # all kept: doubled (up to k)
    proposer.record(seq, 8, 4)
    assert proposer.lookahead(seq) > 0  # 50%: not below the bar
    proposer.record(seq, 8, 0)
    assert [proposer.lookahead(seq) > 0 for _ in range(9)] == [False] * 8 + [True]  # a good window reset the pauses


def test_a_model_drafts_gate_is_shared_by_all_sequences():
    from kvserve.spec_decode.draft import SelfProposer

    proposer = SelfProposer(layers=1, k=3, lookup=0, min_acceptance=50, window=6, min_speedup=0)  # the draft's acceptance gate alone
    first, second = _Seq([1]), _Seq([2])
    proposer.record(first, 3, 0)
    proposer.record(second, 3, 1)
    assert proposer.lookahead(first) == 0 and proposer.lookahead(_Seq([3])) == 0  # a new sequence waits too
    for _ in range(5):  # the pause counts steps, however many sequences ask in each
        proposer.begin_step(2)
        assert [proposer.lookahead(s) for s in (first, second)] == [0, 0]
    proposer.begin_step(2)
    assert proposer.lookahead(first) == 1 and proposer.lookahead(second) == 2


def test_the_cost_gate_shuts_guessing_that_gives_fewer_tokens_a_second():
    """Decode-only steps, timed by batch size: guessing needs two plain steps of its size timed first, each after two
    plain steps of that size in a row (those after a prompt's or a guessing step are not timed); every 16 guessing
    steps are judged against the faster of the last two timed plain ones (per token); a trial below 90% is judged again
    after two more timed plain steps, and if it still falls short, shuts guessing for as many steps as make its extra
    time a tenth of theirs, twice as many after each failing trial in a row before it; a probe of two timed plain steps after the first trial (the first plain steps, timed
    alone, can be slow) and every 128 guessing steps since keeps the plain timing current. min_speedup=0: no gate."""
    proposer = NgramProposer(k=4)
    gate = proposer.costs[0]
    for seconds in (0.050, 0.030, 0.010):  # the first two after the prompt's (none before them here): not timed
        assert not proposer.begin_step(1)
        gate.record(1, False, seconds, 1)
    assert not proposer.begin_step(1)
    gate.record(1, False, 0.012, 1)  # the faster: 10 ms a token
    assert list(gate.plain[1]) == [0.010, 0.012]
    assert proposer.begin_step(1) and not proposer.begin_step(2)  # each batch size is timed apart

    def trial(seconds: float, tokens: list[int]) -> None:
        for i in range(16):
            assert proposer.begin_step(1)
            gate.record(1, True, seconds, tokens[i % len(tokens)])

    def paused(steps: int, seconds: float = 0.011) -> None:
        for _ in range(steps):
            assert not proposer.begin_step(1)
            gate.record(1, False, seconds, 1)
        assert proposer.begin_step(1)

    trial(0.020, [2])  # 10 ms a token: pays
    paused(4)  # the probe after the first trial: two plain steps after the guessing ones, then two timed
    assert list(gate.plain[1]) == [0.011, 0.011]
    trial(0.024, [2])  # 12 ms: 0.92x, still above the bar
    trial(0.020, [1, 2])  # 13.3 ms: 0.825x, 16 steps took 3.4 steps' time more
    paused(4 + 34)  # two plain steps after the guessing ones, two timed at 11 ms, then the pause
    trial(0.040, [1])  # 0.275x: 42 steps more, a second failing trial in a row: twice the pause
    paused(4 + 2 * 422)
    trial(0.036, [2])  # 18 ms a token: 0.61x, but the machine slowed down: plain steps take 20 ms now
    paused(4, seconds=0.020)
    assert gate.paused == 0 and gate.strikes == 0  # it passed: the next failing trial's pause is its own again
    trial(1.0, [1])
    for seconds in (0.5, 0.5, 0.011, 0.011):  # the first two, after the guessing steps, are not timed
        assert not proposer.begin_step(1)
        gate.record(1, False, seconds, 1)
    assert gate.paused == 1024  # at most
    gate.paused = 0
    for _ in range(128 // 16):  # since the last timed plain step
        trial(0.020, [2])
    for seconds in (0.011, 0.011, 0.011, 0.030):  # 128 guessing steps since the last plain one: a probe, timed on its
        assert not proposer.begin_step(1)  # third and fourth steps (the fourth interrupted)
        gate.record(1, False, seconds, 1)
    assert proposer.begin_step(1) and proposer.begin_step(5) is False  # and never past max_batch
    gate.record(1, False, 0.011, 1, decode_only=False)  # a step with a prompt's tokens: never timed, nor the next two
    gate.record(1, False, 0.5, 1)
    gate.record(2, False, 0.5, 2)  # nor plain steps of a batch size other than the last step's
    gate.record(1, False, 0.5, 1)
    gate.record(1, False, 0.5, 1)
    assert list(gate.plain[1]) == [0.011, 0.030]
    trial(0.026, [2])  # 13 ms a token: 0.85x the faster of the probe's steps (their mean, 20.5 ms, would pass it)
    assert gate.failed
    off = NgramProposer(k=4, min_speedup=0)
    assert off.begin_step(1)
    for _ in range(40):
        off.costs[0].record(1, True, 1.0, 1)
    assert off.begin_step(1)


class WrongDraft(Proposer):
    """A model proposer's gates, with guesses that are never the model's (token 0) where prompt lookup finds none."""

    shared_gate = True

    def propose(self, seqs, limits: list[int]) -> list[list[int]]:
        return [[0] * limit for limit in limits]


def test_a_model_proposers_lookups_are_gated_apart_from_its_own_guesses():
    """Each source of guesses has its cost gate and its acceptance gate (a model's shared by all sequences, the
    lookups' each sequence's own, as ngram's): a draft whose guesses lose pauses alone, and prompt lookups go on
    copying. A step where only one source guessed is no plain step for the other."""
    proposer = WrongDraft(k=2, min_acceptance=50, window=4, lookup=4)
    own, lookups = proposer.costs
    copying, fresh, plain = _Seq([5, 6, 7, 8, 5, 6, 7]), _Seq([1, 2, 3]), _Seq([9])

    def step(seq, seconds: float, tokens: int) -> list[int]:
        """One decoding sequence's step, timed: the guesses it made."""
        limit = proposer.lookahead(seq) if proposer.begin_step(1) else 0
        seq.draft_token_ids = proposer.guesses([seq], [limit])[0] if limit else []
        proposer.timed([seq], seconds, tokens)
        return seq.draft_token_ids

    plain.draft_token_ids = []
    for _ in range(4):  # two settle, two are timed: 10 ms a token
        assert step(plain, 0.010, 1) == []
    for _ in range(16):  # the draft's trial: 30 ms a token
        assert step(fresh, 0.030, 1) == [0, 0]
    assert step(copying, 0.015, 5) == []  # the failing trial's second look takes plain steps, lookups' too
    assert own.failed and list(lookups.plain[1]) == [0.010, 0.010]  # (the step after a guessing one is not timed)
    for _ in range(3):
        assert step(plain, 0.010, 1) == []
    assert own.paused > 16
    for _ in range(16):  # lookups' trial: 3 ms a token, while the draft stays paused
        assert step(copying, 0.015, 5) == [8, 5, 6, 7] and proposer.state(copying).copied and proposer.open == [False, True]
    assert lookups.paused == 0 and not lookups.failed and own.paused > 0 and lookups.since_plain[1] == 16
    assert lookups.untimed[1] == 2 and step(copying, 0.015, 5) == []  # the lookups' first probe
    for _ in range(3):
        assert step(plain, 0.010, 1) == []
    assert step(fresh, 0.010, 1) == [] and proposer.open == [False, True]  # nothing to look up, and the draft paused

    proposer = WrongDraft(k=2, min_acceptance=50, window=4, lookup=4, min_speedup=0)
    copying, fresh = _Seq([5, 6, 7, 8, 5, 6, 7]), _Seq([1, 2, 3])
    assert proposer.guesses([copying], [4]) == [[8, 5, 6, 7]]
    proposer.record(copying, 4, 0)  # lookups that miss pause that sequence's lookups alone
    assert proposer.lookahead(copying) == 1 and proposer.lookahead(fresh) == 4 and proposer.shared.paused == 0
    assert proposer.guesses([fresh], [2]) == [[0, 0]] and not proposer.state(fresh).copied
    proposer.record(fresh, 2, 0)
    proposer.record(fresh, 2, 0)  # draft guesses that miss pause the draft for every sequence
    assert proposer.shared.paused == 4 and proposer.lookahead(_Seq([4, 4, 4, 4])) == 4  # lookups still may


@pytest.mark.parametrize("text, message", [
    ("medusa", "unknown speculative proposer 'medusa'"), ("ngram:k", "'k' is not name=value"),
    ("ngram:k=four", "option k must be an integer, got 'four'"), ("draft:k=2", "needs model=PATH"), ("ngram:depth=3", "ngram proposer has no option depth; it takes k, n, min_n, "),
    ("ngram:k=0", "1 <= k <= 16"), ("ngram:n=2,min_n=3", "min_n <= n"), ("draft:model=d,vocab=-5", "vocab must be >= 0"),
    ("draft:model=d,vocab=all", "option vocab must be an integer, got 'all'"), ("eagle:model=d,width=9", "got width=9, vocab=0"),
    ("eagle:model=d,lookup=-1", "min_speedup >= 0, got k=1, min_acceptance=15, window=32, max_batch=4, lookup=-1, min_speedup=90"),
    ("ngram:min_speedup=-5", "min_speedup=-5"), ("ngram:lookup=2", "no option lookup"),
    ("eagle:model=d,vocab=-2", "got width=1, vocab=-2"), ("ngram:k=2,k=3", "option k is given twice \\(2 and 3\\)"),
    ("eagle:model=d,depth=2", "eagle proposer has no option depth; it takes model, k, width, lookup, vocab, min_acceptance, window, max_batch, min_speedup"),
])
def test_bad_speculative_options_name_the_value(text, message):
    with pytest.raises(KVServeError, match=message):
        parse_speculative(text)


def test_static_scheduler_refuses_speculation(tiny_model_dir):
    with pytest.raises(KVServeError, match="continuous scheduler"):
        LLM(str(tiny_model_dir), speculative="ngram", scheduler="static")


# --- end to end: SmolLM2, greedy ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_ngram() -> LLM:
    return LLM("smollm2-135m", speculative="ngram:k=4", **FP32)


def test_greedy_copying_equals_plain_decoding(smollm2, smollm2_ngram):
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    plain, spec = smollm2.chat(COPY, params)[0], smollm2_ngram.chat(COPY, params)[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids and spec.outputs[0].text == plain.outputs[0].text
    m = spec.metrics
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens >= len(spec.outputs[0].token_ids) // 2  # it copies
    for a, b in zip(plain.outputs[0].logprobs, spec.outputs[0].logprobs):  # each kept token's own position's logprobs
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3 and a.top.keys() == b.top.keys()
    assert smollm2_ngram.engine.kv_manager.pool.num_used == 0


def test_guess_chains_run_whole_with_their_one_token_steps_numbers(smollm2, smollm2_ngram):
    """A decode step whose guesses form a chain runs whole (one native call: each guess a row through the layer
    stack and the head), and each kept token's logprobs are bit for bit the plain engine's one-token steps'."""
    backend, rows = smollm2_ngram.engine.runner.backend, []
    decode = backend.decode
    backend.decode = lambda tokens, positions, tables: rows.append(len(tokens)) or decode(tokens, positions, tables)
    try:
        params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
        plain, spec = smollm2.chat(COPY, params)[0], smollm2_ngram.chat(COPY, params)[0]
    finally:
        del backend.decode
    assert max(rows) == 5 and spec.metrics.num_accepted_tokens > 0  # the newest token and k=4 guesses
    assert len(rows) < len(spec.outputs[0].token_ids) - 1  # a step a token, less the guesses kept
    for a, b in zip(plain.outputs[0].logprobs, spec.outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == b.logprob and a.top == b.top


def test_guess_chains_past_the_rows_run_whole_take_the_general_path(smollm2, smollm2_ngram):
    """A step whose guesses make more rows than the backend runs whole is prepared by _prepare_any alone; the
    tokens are the plain engine's."""
    runner = smollm2_ngram.engine.runner
    backend, whole_rows, general = runner.backend, [], []
    decode, prepare_any, limit = backend.decode, runner._prepare_any, backend.decode_rows
    backend.decode = lambda tokens, positions, tables: whole_rows.append(len(tokens)) or decode(tokens, positions, tables)
    runner._prepare_any = lambda batch: general.append(sum(batch.num_tokens)) or prepare_any(batch)
    backend.decode_rows = 3
    try:
        params = SamplingParams(temperature=0, max_tokens=48)
        plain, spec = smollm2.chat(COPY, params)[0], smollm2_ngram.chat(COPY, params)[0]
    finally:
        del backend.decode, runner._prepare_any
        backend.decode_rows = limit
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids and spec.metrics.num_accepted_tokens > 0
    assert max(whole_rows) <= 3 and 5 in general  # k=4 guesses and the newest token: 5 rows, past 3 (and the prompt's step)
    assert smollm2_ngram.engine.kv_manager.pool.num_used == 0


def test_greedy_batched_with_prefix_hits_and_stops_equals_plain_decoding(smollm2, smollm2_ngram):
    prompts = [smollm2.apply_chat_template(COPY), "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(",
               "Once upon a time", smollm2.apply_chat_template(COPY)]  # the last one hits the first one's blocks
    params = [greedy(40), greedy(24), greedy(30, stop=["."]), greedy(33)]
    plain = smollm2.generate(prompts, params, use_tqdm=False)
    spec = smollm2_ngram.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert a.outputs[0].text == b.outputs[0].text
    assert len(spec[1].outputs[0].token_ids) == 24 and spec[2].outputs[0].text.endswith(".") is False
    assert spec[3].metrics.cached_tokens > 0 and spec[0].metrics.num_accepted_tokens > 0
    assert smollm2_ngram.engine.kv_manager.pool.num_used == 0


@pytest.mark.parametrize("speculative", ["self:layers=20", "draft:model=smollm2-135m,k=3,lookup=0"])
def test_model_drafts_keep_greedy_outputs(smollm2, speculative):
    prompts = ["Once upon a time", "def fib(n):", smollm2.apply_chat_template(COPY)]
    params = [greedy(40), greedy(24), greedy(30)]
    llm = LLM("smollm2-135m", speculative=speculative, **FP32)
    plain, spec = smollm2.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts[2], params[2], use_tqdm=False)[0]  # its prompt's blocks are cached now
    assert again.metrics.cached_tokens > 0 and again.outputs[0].token_ids == plain[2].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    proposed, accepted = (sum(getattr(o.metrics, f) for o in spec) for f in ("num_draft_tokens", "num_accepted_tokens"))
    assert accepted > 0
    if speculative.startswith("draft"):  # the target as its own draft (no lookups): every guess is right
        assert accepted == proposed
    assert llm.engine.kv_manager.pool.num_used == 0 and llm.engine.proposer.kv.pool.num_used == 0  # shadows let go


def test_a_drafts_steps_past_the_prompt_run_in_the_native_layer_stack(tiny_model_dir):
    """The draft's layers are fused before its runner stacks them, and its catch-up on several tokens past the
    prompt (accepted guesses, then the target's token) attends as decodes: every step after the prompt is one
    native call for all layers."""
    llm = LLM(str(tiny_model_dir), device="cpu", speculative=f"draft:model={tiny_model_dir},k=3,lookup=0,min_acceptance=0,min_speedup=0", **FP32)
    backend = llm.engine.proposer.runner.backend
    assert backend.stack is not None
    steps, run_layers = [], backend.run_layers

    def spy(x, *args):
        out = run_layers(x, *args)
        steps.append((x.shape[0], out is not None))
        return out

    backend.run_layers = spy
    out = llm.generate([[5, 9, 14, 3, 77, 21]], greedy(24), use_tqdm=False)[0]
    assert out.metrics.num_accepted_tokens > 0
    assert steps[0] == (len(out.prompt_token_ids) + 1, False)  # the prompt and the target's first token: a prefill
    assert all(native for _, native in steps[1:]) and any(rows > 1 for rows, _ in steps[1:])
    bf16 = LLM(str(tiny_model_dir), device="cpu", speculative=f"draft:model={tiny_model_dir}", matmul_dtype="bfloat16").engine.proposer.runner
    assert bf16.backend.stack is not None  # Q8_0 layers whose many-row steps multiply bf16 tiles, as the target's
    assert all(layer.mlp.down_proj.qweight is not None and layer.mlp.down_proj.gemm_dtype == torch.bfloat16
               for layer in bf16.model.layers)


def test_a_draft_needs_the_targets_vocabulary(tiny_model_dir, tmp_path):
    from tests.conftest import save_tiny_llama

    save_tiny_llama(tmp_path, vocab_size=300)
    with pytest.raises(KVServeError, match=r"draft's vocabulary \(300 tokens\) is not the target's \(256\)"):
        LLM(str(tiny_model_dir), speculative=f"draft:model={tmp_path}")
    with pytest.raises(KVServeError, match="self:layers must be in 1..1"):
        LLM(str(tiny_model_dir), speculative="self:layers=2")


# --- rollback: random acceptance lengths ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir_d32):
    options = dict(num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, **FP32)
    return LLM(str(tiny_model_dir_d32), **options).engine, LLM(str(tiny_model_dir_d32), speculative="ngram:min_speedup=0", **options).engine


def _run(engine, prompts, params, poison=False) -> dict[tuple, list[int]]:
    outputs = {}
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[tuple(out.prompt_token_ids)] = out.outputs[0].token_ids
        check_invariants(engine)
        for seq in engine.scheduler.running:
            assert len(seq.block_tables[0]) <= -(-(seq.num_computed_tokens + 1) // 4)  # rejected guesses' blocks returned
            if poison:
                _poison_past_computed(engine, seq)
    assert engine.kv_manager.pool.num_used == 0
    return outputs


def _poison_past_computed(engine, seq) -> None:
    """Huge K and V in every slot past the computed tokens: attention that read a rejected guess would show it."""
    cache, bs = engine.runner.kv_cache, 4
    slots = [seq.block_tables[0][p // bs] * bs + p % bs for p in range(seq.num_computed_tokens, len(seq.block_tables[0]) * bs)]
    for store in cache.k + cache.v:
        store["data"].flatten(0, 1)[slots] = 1e4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), k=st.integers(1, 6), lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5))
def test_random_acceptance_lengths_keep_outputs_and_blocks(tiny_pair, seed, k, lengths):
    plain, spec = tiny_pair
    prompts = [[(seed + 31 * i + 7 * j) % 256 for j in range(3 + 5 * i)] for i in range(len(lengths))]
    params = [greedy(n) for n in lengths]
    reference = _run(plain, prompts, params)
    spec.proposer = OracleProposer(reference, k, random.Random(seed))
    accepted_before = spec.scheduler.stats.num_accepted_tokens
    assert _run(spec, prompts, params, poison=True) == reference
    assert spec.proposer.proposed > 0 or max(lengths) <= 2  # room for a guess and the token after it
    assert spec.scheduler.stats.num_accepted_tokens - accepted_before == spec.proposer.expected_accepted


class TreeOracleProposer(OracleProposer):
    """Guesses a random tree with the reference continuation down one random branch (of random length) and wrong
    tokens elsewhere: the kept branch lies anywhere in the tree, so its K/V moves."""

    def _propose(self, seq, limit: int) -> list[int]:
        ref = self.reference[tuple(seq.token_ids[:seq.num_prompt_tokens])][len(seq.output_token_ids):]
        rng, depth = self.rng, min(self.k, limit, len(ref))
        if depth == 0:
            return []
        parents, size = [-1], rng.randint(1, self.k + 2)
        while len(parents) < size:
            node = rng.randrange(-1, len(parents))
            if node < 0 or len(path(parents, node)) < depth:
                parents.append(node)
        right = set(path(parents, rng.randrange(len(parents))))
        right = {n for n in right if rng.random() < 0.8 or n == min(right)} if rng.random() < 0.5 else right
        kept, guesses = [], []
        for j, parent in enumerate(parents):  # a node on the right branch below a kept one: the reference's token
            d = len(path(parents, j)) - 1
            ok = j in right and (parent < 0 or parent in kept)
            kept += [j] if ok else []
            guesses.append(ref[d] if ok else (ref[d] + 1 + j) % 256)
        self.trees[seq] = parents
        self.proposed += len(guesses)
        self.expected_accepted += len(kept)
        return guesses

    def parents(self, seq, count: int) -> list[int]:
        return self.trees[seq][:count]


@pytest.fixture(scope="module")
def tiny_pair_sdpa(tiny_model_dir_d32):
    options = dict(num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, native_kernels=False, **FP32)
    return LLM(str(tiny_model_dir_d32), **options).engine, LLM(str(tiny_model_dir_d32), speculative="ngram:min_speedup=0", **options).engine


@pytest.mark.parametrize("pair", ["tiny_pair", "tiny_pair_sdpa"])  # the native kernel skips other branches' keys; SDPA masks them
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), k=st.integers(1, 4), lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4))
def test_random_trees_of_guesses_keep_outputs_and_blocks(request, pair, seed, k, lengths):
    """Whichever branch of a tree the samples confirm, outputs are the plain engine's, no other branch's K/V is
    read (poisoned after each step: a kept branch must have moved next to the newest token), and blocks balance."""
    plain, spec = request.getfixturevalue(pair)
    prompts = [[(seed + 31 * i + 7 * j) % 256 for j in range(3 + 5 * i)] for i in range(len(lengths))]
    params = [greedy(n) for n in lengths]
    reference = _run(plain, prompts, params)
    spec.proposer = TreeOracleProposer(reference, k, random.Random(seed))
    spec.proposer.trees = {}
    accepted_before = spec.scheduler.stats.num_accepted_tokens
    assert _run(spec, prompts, params, poison=True) == reference
    assert spec.scheduler.stats.num_accepted_tokens - accepted_before == spec.proposer.expected_accepted


@pytest.mark.parametrize("kv", ["int8", "int4", "fp8_e4m3", "kivi2"])
def test_a_kept_branch_moves_in_every_kv_format(tiny_model_dir_d32, kv):
    """The kept branch's K/V moves as stored (a quantized format's codes and scales; kivi2's float residual
    blocks): outputs stay the plain engine's in that format."""
    options = dict(num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_dtype=kv, **FP32)
    if kv == "kivi2":
        options["kivi_residual"] = 8
    plain = LLM(str(tiny_model_dir_d32), **options).engine
    spec = LLM(str(tiny_model_dir_d32), speculative="ngram:min_speedup=0", **options).engine
    prompts, params = [[(7 * i + 3 * j) % 256 for j in range(5 + 4 * i)] for i in range(3)], [greedy(n) for n in (17, 9, 14)]
    reference = _run(plain, prompts, params)
    spec.proposer = TreeOracleProposer(reference, 3, random.Random(1))
    spec.proposer.trees = {}
    assert _run(spec, prompts, params) == reference
    assert spec.scheduler.stats.num_accepted_tokens == spec.proposer.expected_accepted > 0


@pytest.mark.parametrize("native", [True, False])
def test_a_tree_in_a_sliding_window_layer_counts_the_keys_each_guess_sees(tiny_sliding_dir, native):
    """A 6-token window over a tree of up to 5 guesses: each guess's window is its branch's, as in the one-token
    step it stands for (and the group's blocks that slid out go back as usual)."""
    options = dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, native_kernels=native, **FP32)
    plain = LLM(str(tiny_sliding_dir), **options).engine
    spec = LLM(str(tiny_sliding_dir), speculative="ngram:min_speedup=0", **options).engine
    prompts, params = [[(11 * i + 5 * j) % 256 for j in range(6 + 5 * i)] for i in range(3)], [greedy(n) for n in (20, 13, 17)]
    reference = _run(plain, prompts, params)
    for seed in range(3):
        spec.proposer = TreeOracleProposer(reference, 3, random.Random(seed))
        spec.proposer.trees = {}
        accepted = spec.scheduler.stats.num_accepted_tokens
        assert _run(spec, prompts, params) == reference
        assert spec.scheduler.stats.num_accepted_tokens - accepted == spec.proposer.expected_accepted > 0


def test_a_self_draft_in_a_busy_small_pool_keeps_outputs_and_frees_its_blocks(tiny_model_dir_d32):
    options = dict(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, **FP32)
    plain = LLM(str(tiny_model_dir_d32), **options).engine
    spec = LLM(str(tiny_model_dir_d32), speculative="self:layers=1,k=3,lookup=0,min_acceptance=0,min_speedup=0", **options).engine
    prompts, params = [[(5 * i + j) % 256 for j in range(4 + 3 * i)] for i in range(5)], [greedy(n) for n in (9, 14, 5, 12, 7)]
    assert _run(spec, prompts, params, poison=True) == _run(plain, prompts, params)
    assert spec.scheduler.stats.num_draft_tokens > 0 and spec.proposer.kv.pool.num_used == 0
    ids = [spec.add_request(p, greedy(20)) for p in prompts[:3]]
    for _ in range(4):
        spec.step()
    for request_id in ids:
        spec.abort_request(request_id)
    assert spec.kv_manager.pool.num_used == 0 and spec.proposer.kv.pool.num_used == 0
    draft = spec.kv_usage()["draft"]  # reported beside the target's pool
    assert draft["used_bytes"] == 0 and draft["total_bytes"] == spec.proposer.kv.layout.block_bytes() * draft["num_blocks"] > 0


def test_guesses_on_the_last_prompt_token_do_not_leak_into_forked_completions(tiny_model_dir_d32):
    """Prefill in chunks of 3 leaves a 7-token prompt's last token alone in a step, so it is guessed past; the
    prompt's other completions fork from its blocks in that step and must get the prompt only."""
    options = dict(num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=3, **FP32)
    plain = LLM(str(tiny_model_dir_d32), **options).engine
    spec = LLM(str(tiny_model_dir_d32), speculative="ngram:min_speedup=0", **options).engine
    prompt = [9, 8, 7, 6, 5, 4, 3]
    reference = _run(plain, [prompt], [greedy(10)])
    spec.proposer = OracleProposer(reference, 3)
    spec.add_request(prompt, greedy(10, n=3))
    outs = []
    while spec.has_unfinished_requests():
        outs += [o for o in spec.step() if o.finished]
        check_invariants(spec)
    assert spec.scheduler.stats.num_accepted_tokens > 0
    assert [c.token_ids for c in outs[0].outputs] == [reference[tuple(prompt)]] * 3
    assert spec.kv_manager.pool.num_used == 0


# --- sampling: the distribution is unchanged ------------------------------------------------------------------------

def test_sampled_tokens_are_distributed_as_without_speculation(tiny_pair, monkeypatch):
    plain, spec = tiny_pair
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 1500
    reference = _run(plain, [prompt], [greedy(4)])

    def draws(engine, first_seed: int) -> list[tuple[int, ...]]:
        ids = [engine.add_request(prompt, SamplingParams(temperature=0.05, top_k=4, max_tokens=4, ignore_eos=True, seed=first_seed + i))
               for i in range(n)]
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return [tuple(outs[i]) for i in ids]

    spec.proposer = OracleProposer(reference, 3)  # the greedy path's next tokens, a deterministic guess
    accepted_before = spec.scheduler.stats.num_accepted_tokens
    without, with_ = draws(plain, 0), draws(spec, 10**6)
    assert spec.scheduler.stats.num_accepted_tokens - accepted_before > n // 4, "too few guesses kept to test"
    for position in (1, 2, 3):  # ...and each verified position's tokens come out as without them
        stat, df = chi_square([t[position] for t in without], [t[position] for t in with_])
        assert stat < critical(df), (position, stat, df)
    stat, df = chi_square([t[:2] for t in without], [t[:2] for t in with_])
    assert stat < critical(df)

    # the test has power: a rule that keeps every guess shifts the distribution far past the bound
    monkeypatch.setattr("kvserve.engine.model_runner.verify",
                        lambda guesses, parents, samples: (guesses + [samples[len(guesses)]], list(range(len(guesses)))))
    biased = draws(spec, 2 * 10**6)
    stat, df = chi_square([t[1] for t in without], [t[1] for t in biased])
    assert stat > critical(df)


# --- metrics --------------------------------------------------------------------------------------------------------

def test_a_drafts_misses_pause_its_own_guesses_and_not_its_lookups(tiny_pair):
    """End to end, by acceptance (timing off): where the output repeats itself (this model loops), lookups guess and
    are kept, while the draft's own guesses, never kept, are paused by their own gate (when the lookups shared it,
    their hits held it open: no pause); outputs are the plain engine's."""
    plain, spec = tiny_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = _run(plain, [prompt], [greedy(120)])[tuple(prompt)]

    class Wrong(WrongDraft):
        def propose(self, seqs, limits):
            return [[(t + 1) % 256 for t in reference[len(seq.output_token_ids):][:limit]] for seq, limit in zip(seqs, limits)]

    spec.proposer = proposer = Wrong(k=2, min_acceptance=50, window=8, lookup=4, min_speedup=0)
    accepted = spec.scheduler.stats.num_accepted_tokens
    assert _run(spec, [prompt], [greedy(120)])[tuple(prompt)] == reference
    assert spec.scheduler.stats.num_accepted_tokens - accepted >= 40  # lookups' tokens: the draft's are never kept
    assert proposer.shared.strikes >= 2  # the draft's windows of 8 tokens failed, paused longer each time


def test_guessing_that_costs_more_time_than_it_saves_is_switched_off(tiny_pair):
    """End to end, with the default cost gate: guesses that are never kept and take 20 ms to make (a step of this
    model takes a few) are made in the first trial only, whose cost pauses them past the output's end, and the
    output is unchanged;
    guesses that are always kept go on (at min_acceptance 0, the acceptance gate is out of it)."""
    plain, spec = tiny_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = _run(plain, [prompt], [greedy(120)])

    class SlowWrong(OracleProposer):
        steps = 0

        def propose(self, seqs, limits):
            self.steps += 1
            time.sleep(0.02)
            return [[(t + 1) % 256 for t in guesses] for guesses in super().propose(seqs, limits)]

    for proposer, kept in ((SlowWrong(reference, 2), False), (OracleProposer(reference, 3), True)):
        proposer.costs = NgramProposer().costs  # the default gate
        spec.proposer = proposer
        accepted = spec.scheduler.stats.num_accepted_tokens
        assert _run(spec, [prompt], [greedy(120)]) == reference
        if kept:  # k guesses a step (within max_tokens), every one kept
            assert spec.scheduler.stats.num_accepted_tokens - accepted == proposer.proposed and proposer.proposed // proposer.k >= 25
        else:
            # WARM guessing steps after the prompt's, untimed; 2 plain steps to settle and 2 timed, a trial of 16 guessing
            # steps, then a pause past the end
            assert proposer.steps == WARM + 16 and proposer.costs[0].paused > 0


def test_cli_stats_line_reports_acceptance(smollm2_ngram):
    from kvserve.entrypoints.cli import stats_line

    out = smollm2_ngram.chat(COPY, SamplingParams(temperature=0, max_tokens=24))[0]
    m = out.metrics
    assert m.num_draft_tokens > 0
    assert f"speculative: {m.num_accepted_tokens}/{m.num_draft_tokens} accepted ({m.acceptance_rate:.0%})" in stats_line(out)


def test_server_reports_speculation_in_usage_and_metrics():
    import httpx

    from tests.server_utils import running_server

    with running_server("smollm2-135m", speculative="ngram:k=4", **FP32) as (url, _):
        body = {"messages": COPY, "max_tokens": 32, "temperature": 0}
        usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        spec = usage["speculative"]
        assert spec["draft_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
        assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
        metrics = {line.split("{")[0]: float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                   if line.startswith("kvserve:spec_decode")}
        assert metrics["kvserve:spec_decode_num_draft_tokens_total"] == spec["draft_tokens"]
        assert metrics["kvserve:spec_decode_num_accepted_tokens_total"] == spec["accepted_tokens"]


# --- kvserve distill --------------------------------------------------------------------------------------------------

def test_distill_stops_when_training_diverges(tmp_path):
    """At a learning rate of 1e30 the loss became NaN, and the NaN draft was saved and its acceptance measured."""
    from tests.conftest import save_tiny_llama

    from kvserve.spec_decode.distill import DistillSettings, distill

    save_tiny_llama(tmp_path / "target", num_hidden_layers=2)
    settings = DistillSettings(model=str(tmp_path / "target"), out=str(tmp_path / "draft"), layers=1, steps=5, batch=2, seq_len=16,
                               lr=1e30, eval_windows=1, acceptance_prompts=1)
    with pytest.raises(KVServeError, match=r"the loss became nan at step \d: training diverged \(lower --lr, now 1e\+30\)"):
        distill(settings, token_ids=list(range(200)) * 3, progress=False)
    assert not (tmp_path / "draft" / "model.safetensors").exists()


def test_distill_refuses_a_step_larger_than_free_memory(tmp_path):
    """--batch 100000 scored the teacher's distributions until memory ran out; now it is refused up front."""
    from tests.conftest import save_tiny_llama

    from kvserve.spec_decode.distill import DistillSettings, distill

    save_tiny_llama(tmp_path / "target", num_hidden_layers=2)
    settings = DistillSettings(model=str(tmp_path / "target"), out=str(tmp_path / "draft"), layers=1, batch=10**9, seq_len=64)
    with pytest.raises(KVServeError, match=r"--batch 1000000000 x --seq-len 64 needs at least 30517.6 GiB a step .* lower --batch"):
        distill(settings, token_ids=list(range(200)) * 6, progress=False)


def test_distill_prunes_trains_and_saves_a_draft_that_loads(tmp_path):
    from tests.conftest import save_tiny_llama

    from kvserve.spec_decode.distill import DistillSettings, distill

    save_tiny_llama(tmp_path / "target", num_hidden_layers=4, initializer_range=0.2)  # peaked distributions to learn
    rng = random.Random(0)
    text = [rng.randrange(256) for _ in range(3000)]
    settings = DistillSettings(model=str(tmp_path / "target"), out=str(tmp_path / "draft"), layers=2, mlp=96, steps=80, batch=4,
                               seq_len=32, lr=3e-3, eval_windows=4, acceptance_prompts=2, vocab=200)
    report = distill(settings, token_ids=text, progress=False)
    assert report["kept_layers"] == [0, 3]
    listed = json.loads((tmp_path / "draft" / "draft_vocab.json").read_text())["token_ids"]
    assert len(listed) == len(set(listed)) == 200 and all(0 <= t < 256 for t in listed)
    assert report["after"]["kl_mean"] < 0.8 * report["before"]["kl_mean"]  # closer to the target on held-out text
    assert sum(report["losses"][-5:]) < sum(report["losses"][:5])
    assert (tmp_path / "draft" / "loss.png").stat().st_size > 0
    assert report["acceptance"]["draft_tokens"] > 0
    draft = LLM(str(tmp_path / "draft"))
    assert draft.engine.checkpoint.config.num_layers == 2 and draft.engine.checkpoint.config.intermediate_size == 96
    target = LLM(str(tmp_path / "target"), **FP32)
    spec = LLM(str(tmp_path / "target"), speculative=f"draft:model={tmp_path / 'draft'},min_acceptance=0,min_speedup=0", **FP32)
    prompts = [text[:20], text[100:110]]
    plain_out, spec_out = target.generate(prompts, greedy(24), use_tqdm=False), spec.generate(prompts, greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec_out] == [o.outputs[0].token_ids for o in plain_out]
    assert sum(o.metrics.num_accepted_tokens for o in spec_out) > 0
    head = spec.engine.proposer.runner.model.lm_head  # the draft proposes its 200 listed tokens only
    assert head.head.out_features == 200 and sorted(head.ids.tolist()) == sorted(listed)
    fewer = LLM(str(tmp_path / "target"), speculative=f"draft:model={tmp_path / 'draft'},vocab=50", **FP32)
    assert fewer.engine.proposer.runner.model.lm_head.ids.tolist() == listed[:50]  # the 50 most frequent


def test_distill_eagle_trains_a_feature_draft_whose_guesses_verify(tmp_path):
    """A feature draft learns the target's next hidden state; serving, it reads the state that gave each new token
    (the guess row's where guesses were kept) and greedy output stays the target's."""
    from tests.conftest import save_tiny_llama

    from kvserve.spec_decode.distill import DistillSettings, distill

    save_tiny_llama(tmp_path / "target", num_hidden_layers=2, initializer_range=0.2)
    target = LLM(str(tmp_path / "target"), **FP32)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(4)] for _ in range(100)]  # the text: the target's greedy answers
    plain_out = target.generate(prompts, greedy(28), use_tqdm=False)
    text = [t for p, o in zip(prompts, plain_out) for t in p + o.outputs[0].token_ids]  # one answer a 32-token window
    settings = DistillSettings(model=str(tmp_path / "target"), out=str(tmp_path / "draft"), eagle=True, mlp=96, steps=120,
                               batch=8, seq_len=32, lr=3e-3, eval_windows=4, acceptance_prompts=2, vocab=200)
    report = distill(settings, token_ids=text, progress=False)
    assert report["after"]["kl_mean"] < 0.8 * report["before"]["kl_mean"]  # on held-out answers
    assert sum(report["losses"][-5:]) < sum(report["losses"][:5]) and report["acceptance"]["draft_tokens"] > 0
    config = json.loads((tmp_path / "draft" / "eagle.json").read_text())
    assert config["intermediate_size"] == 96 and config["depth"] == 2  # trained two steps ahead, by default
    assert LLM(str(tmp_path / "target"), speculative=f"eagle:model={tmp_path / 'draft'}", **FP32).engine.proposer.k == 2  # k: its depth
    spec = LLM(str(tmp_path / "target"), speculative=f"eagle:model={tmp_path / 'draft'},k=3,min_acceptance=0,min_speedup=0", **FP32)
    seen = []
    spec.engine.observe_features(lambda seqs, states, rows: seen.extend((s.token_ids[-1], states[r].clone()) for s, r in zip(seqs, rows)))
    spec_out = spec.generate(prompts[10:14], greedy(28), use_tqdm=False)  # answers it trained on
    assert [o.outputs[0].token_ids for o in spec_out] == [o.outputs[0].token_ids for o in plain_out[10:14]]
    assert sum(o.metrics.num_accepted_tokens for o in spec_out) > 0
    logits = spec.engine.runner.model.compute_logits(torch.stack([f for _, f in seen]))
    assert logits.argmax(-1).tolist() == [token for token, _ in seen]  # each state is the one that gave its token
    assert spec.engine.proposer.head.head.out_features == 200


@pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
def test_a_feature_drafts_native_guesses_are_its_modules_guesses(tmp_path, smollm2):
    """On a GGUF target (embedding and head packed) a feature draft's steps run as one native op: its guesses are
    the module path's, token for token, and greedy output stays the target's."""
    from kvserve.spec_decode.eagle import FeatureDraft

    torch.manual_seed(0)
    draft, listed = FeatureDraft(576, 128, 1e-5), list(range(3, 49152, 16))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    draft.save(tmp_path, listed)
    cpu = dict(FP32, device="cpu")  # the native op is the CPU's
    llm = LLM("smollm2-135m", speculative=f"eagle:model={tmp_path},k=3,min_acceptance=0,min_speedup=0", **cpu)
    proposer = llm.engine.proposer
    fused, tokens = proposer.fused, torch.randint(0, 49152, (4,)).tolist()
    states, rows = [torch.randn(3, 576), torch.randn(2, 576)], [2, 0, 1, 1]  # each sequence's state: a row of its step's
    states = [states[0], states[1], states[0], states[1]]
    assert fused is not None
    guesses = proposer.guess(tokens, states, rows, 5)
    proposer.fused = None
    assert proposer.guess(tokens, states, rows, 5) == guesses
    assert torch.tensor(guesses).shape == (4, 5) and set(sum(guesses, [])) <= set(listed) and len(set(sum(guesses, []))) > 2
    assert proposer.guess(tokens[:1], [states[0][2:]], [0], 5) == guesses[:1]  # the state, not where it lies
    proposer.width = 3  # a tree: the chain, then the first guess's two runners-up
    wide = proposer.guess(tokens, states, rows, 2)
    flat = fused.propose(tokens, states, rows, 2, 3)
    assert wide == [flat[i * 4:(i + 1) * 4] for i in range(4)]
    assert [row[:2] for row in wide] == [row[:2] for row in guesses]
    assert all(len({row[0], row[2], row[3]}) == 3 for row in wide) and proposer.parents(_Seq([]), 4) == [-1, 0, -1, -1]
    proposer.fused = fused
    assert proposer.guess(tokens, states, rows, 2) == wide
    proposer.width = 1
    prompts, params = ["Once upon a time", smollm2.apply_chat_template(COPY)], greedy(16)
    target = smollm2 if smollm2.engine.runner.device.type == "cpu" else LLM("smollm2-135m", **cpu)
    plain = [o.outputs[0].token_ids for o in target.generate(prompts, params, use_tqdm=False)]
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == plain
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    tree = LLM("smollm2-135m", speculative=f"eagle:model={tmp_path},k=2,width=3,min_acceptance=0,min_speedup=0", **cpu)
    tree = tree.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tree] == plain
    assert sum(o.metrics.num_draft_tokens for o in tree) > sum(o.metrics.num_draft_tokens for o in spec)
    with pytest.raises(RuntimeError, match="past the embedding"):
        fused.propose([49152], states[:1], [0], 1, 1)
    with pytest.raises(RuntimeError, match="a state is row < 3"):
        fused.propose([5], states[:1], [3], 1, 1)


def test_model_proposers_guess_by_lookup_where_the_text_repeats(tmp_path, smollm2):
    """A random feature draft and the model's first layer guess badly; with lookup, where the text's last 3 tokens
    occurred before, they guess what followed them there (a chain, beside a tree's draft guesses elsewhere):
    copying, many more guesses are kept and greedy output stays the model's."""
    from kvserve.spec_decode.eagle import FeatureDraft

    torch.manual_seed(0)
    FeatureDraft(576, 128, 1e-5).save(tmp_path, list(range(0, 49152, 4)))
    prompts, params = [smollm2.apply_chat_template(COPY), "Once upon a time"], greedy(48)
    plain = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    for proposer in (f"eagle:model={tmp_path},k=1,width=2", "self:layers=1,k=1"):
        kept = {}
        for lookup in (0, 4):
            llm = LLM("smollm2-135m", speculative=f"{proposer},lookup={lookup},min_acceptance=0,min_speedup=0", **FP32)
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == plain
            kept[lookup] = outs[0].metrics.num_accepted_tokens
        assert kept[4] >= 15 and kept[4] > 2 * kept[0], (proposer, kept)
    proposer, seq = llm.engine.proposer, _Seq([5, 6, 7, 8, 5, 6, 7])
    assert proposer.guesses([seq], [4]) == [[8, 5, 6, 7]] and proposer.parents(seq, 4) == [-1, 0, 1, 2]


def test_a_feature_draft_runs_in_the_models_dtype(tmp_path, tiny_model_dir):
    """A bfloat16 model's states and embeddings are bfloat16: the draft (saved in float32) runs in that dtype, and
    greedy output stays the model's."""
    from kvserve.spec_decode.eagle import FeatureDraft

    torch.manual_seed(0)
    FeatureDraft(64, 64, 1e-5).save(tmp_path, None)
    prompts, params = [[5, 9, 14, 3, 5, 9], [7, 7, 2]], greedy(12)
    plain = LLM(str(tiny_model_dir), dtype="bfloat16").generate(prompts, params, use_tqdm=False)
    spec = LLM(str(tiny_model_dir), dtype="bfloat16", speculative=f"eagle:model={tmp_path},k=2,lookup=0,min_acceptance=0,min_speedup=0")
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.proposer.draft.fc.weight.dtype == torch.bfloat16 and sum(o.metrics.num_draft_tokens for o in outs) > 0


def _spied_eagle(tmp_path, tiny_model_dir, gate: str) -> tuple[LLM, list[bool], list[bool]]:
    """An engine with a random feature draft (one guess a step, no lookups, the acceptance gate off, `gate` the cost
    gate's option), and for each of its steps: whether it kept the hidden states, and whether it verified guesses."""
    from kvserve.spec_decode.eagle import FeatureDraft

    torch.manual_seed(0)
    FeatureDraft(64, 64, 1e-5).save(tmp_path, None)
    spec = LLM(str(tiny_model_dir), speculative=f"eagle:model={tmp_path},k=1,lookup=0,min_acceptance=0,{gate}")
    runner, kept, guessed = spec.engine.runner, [], []

    def spy(batch, execute=runner.execute, keep_features=False):
        kept.append(keep_features)
        guessed.append(bool(batch.seqs[0].draft_token_ids))
        return execute(batch, keep_features)

    runner.execute = spy
    return spec, kept, guessed


@pytest.mark.parametrize("gate, first_guess", [("cost", 6), ("acceptance", 5)])
def test_a_paused_feature_draft_keeps_no_hidden_states(tmp_path, tiny_model_dir, gate, first_guess):
    """While a gate pauses the feature draft past the next step, steps pick no hidden states for it (that cost a
    paused draft's steps 4% on a 2-core Xeon); the step before the first it may guess in keeps them, and it guesses
    there; greedy output stays the model's."""
    prompt, params = [5, 9, 14, 3, 5, 9], greedy(16)
    plain = LLM(str(tiny_model_dir)).generate([prompt], params, use_tqdm=False)[0]
    spec, kept, guessed = _spied_eagle(tmp_path, tiny_model_dir, "min_speedup=0")
    proposer = spec.engine.proposer
    if gate == "cost":
        proposer.costs[0].paused = 6  # each step's start counts it down, the prompt's step's too: guesses from step 7
    else:
        proposer.shared.paused = 6  # counted down at each step's start too, and read after it: guesses from step 6
    out = spec.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert guessed.index(True) == first_guess and kept[:first_guess + 1] == [False] * (first_guess - 1) + [True, True]


def test_the_steps_a_cost_gate_times_keep_no_hidden_states(tmp_path, tiny_model_dir):
    """The plain steps a cost gate times run as a plain engine's would, picking no hidden states; so the draft cannot
    guess in the step after the last of them, which keeps its states and is not timed, and guesses from the one
    after. No step is timed within WARM steps after one with prompt tokens, nor made plain to be timed: timings
    wait there, while guessing goes on."""
    spec, kept, guessed = _spied_eagle(tmp_path, tiny_model_dir, "min_speedup=90")
    spec.generate([[5, 9, 14, 3, 5, 9]], greedy(WARM + 8), use_tqdm=False)
    # the prompt's step and WARM guessing ones, two plain steps to settle and two timed, one that keeps states
    assert kept[:WARM + 7] == [True] * (WARM + 1) + [False] * 4 + [True, True]
    assert guessed[:WARM + 7] == [False] + [True] * WARM + [False] * 5 + [True]
    gate = spec.engine.proposer.costs[0]
    assert len(gate.plain[1]) == 2 and not gate.needs_plain(1)
    gate.untimed[1], first = 2, list(gate.plain[1])  # a probe is due: after a prompt's step it waits, and the draft guesses on
    kept.clear(), guessed.clear()
    spec.generate([[5, 9, 14, 3, 5, 9, 2]], greedy(WARM + 8), use_tqdm=False)
    assert guessed[:WARM + 7] == [False] + [True] * WARM + [False] * 5 + [True] and len(gate.plain[1]) == 2
    assert not set(gate.plain[1]) & set(first)  # both timed anew
    gate.record(1, False, 9.0, 1, features=True)  # a plain step that kept them: not timed
    gate.record(1, False, 9.0, 1, features=True)
    gate.record(1, False, 9.0, 1, features=True)
    assert len(gate.plain[1]) == 2 and max(gate.plain[1]) < 9.0
    proposer = spec.engine.proposer
    assert proposer.begin_step(1) and proposer.may_guess_next()
    assert not proposer.begin_step(5) and not proposer.may_guess_next()  # past max_batch: the next step guesses no more
    proposer.timed([], 0.01, 1, decode_only=False)  # a step with prompt tokens: WARM steps after it are not timed
    gate.untimed[1] = 2
    assert proposer.begin_step(1) and proposer.warming == WARM  # a probe due waits
    gate.failed[1] = [1.0, 1, 2]
    assert not proposer.begin_step(1)  # a failing trial's second look does not


def test_an_eagle_draft_must_match_the_model(tmp_path, tiny_model_dir):
    from kvserve.spec_decode.eagle import FeatureDraft

    with pytest.raises(KVServeError, match="is not a feature draft"):
        LLM(str(tiny_model_dir), speculative=f"eagle:model={tmp_path}")
    FeatureDraft(32, 64, 1e-5).save(tmp_path / "other", None)
    with pytest.raises(KVServeError, match="reads hidden states of 32 values, the model's have 64"):
        LLM(str(tiny_model_dir), speculative=f"eagle:model={tmp_path / 'other'}")
    with pytest.raises(KVServeError, match="needs model=DIR"):
        LLM(str(tiny_model_dir), speculative="eagle")
    FeatureDraft(64, 64, 1e-5).save(tmp_path / "listed", [9, 4, 200, 7])
    head = LLM(str(tiny_model_dir), speculative=f"eagle:model={tmp_path / 'listed'},vocab=2").engine.proposer.head
    assert head.ids.tolist() == [9, 4] and head.head.out_features == 2  # the draft's two most frequent tokens


@pytest.mark.parametrize("file,text,message", [
    ("eagle.json", "{x", "cannot read .*eagle.json: Expecting property name"),
    ("eagle.json", "[1]", r"eagle.json is not a feature draft's settings: \[1\]"),
    ("eagle.json", '{"hidden_size": "64", "intermediate_size": 64, "rms_norm_eps": 1e-05}', "not a feature draft's settings"),
    ("eagle.json", '{"hidden_size": 64, "intermediate_size": 64, "rms_norm_eps": 1e-05, "depth": 0}', "not a feature draft's settings"),
    ("eagle.json", '{"hidden_size": 64, "intermediate_size": 64, "rms_norm_eps": 1e-05, "heads": 2}', "not a feature draft's settings"),
    ("eagle.json", '{"hidden_size": 64, "intermediate_size": 32, "rms_norm_eps": 1e-05}', r"cannot load the feature draft's .*Error\(s\) in loading state_dict"),
    ("eagle.safetensors", "\0" * 50, "cannot load the feature draft's .*eagle.safetensors: Error while deserializing header"),
    ("draft_vocab.json", "{nope", "cannot read .*draft_vocab.json: JSONDecodeError"),
    ("draft_vocab.json", '{"token_ids": []}', "token_ids must be a non-empty list of token ids"),
    ("draft_vocab.json", '{"token_ids": [1, -2]}', "token_ids must be a non-empty list of token ids"),
])
def test_a_damaged_eagle_draft_is_a_clear_error(tmp_path, tiny_model_dir, file, text, message):
    """A JSONDecodeError, a TypeError, torch's or safetensors' own error before, or (token -2) a crash mid-step."""
    from kvserve.spec_decode.eagle import FeatureDraft

    FeatureDraft(64, 64, 1e-5).save(tmp_path, [1, 2, 3])
    (tmp_path / file).write_text(text)
    with pytest.raises(KVServeError, match=message):
        LLM(str(tiny_model_dir), speculative=f"eagle:model={tmp_path}")


def test_narrowing_an_mlp_keeps_its_most_active_neurons(tmp_path):
    from tests.conftest import save_tiny_llama

    from kvserve.spec_decode.distill import narrow_mlp

    model = save_tiny_llama(tmp_path)  # 128 intermediate neurons
    window = list(range(3, 40))
    seen = []
    mlp = model.model.layers[1].mlp
    hook = mlp.down_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        model(torch.tensor([window]))
    hook.remove()
    keep = seen[0].abs().sum((0, 1)).topk(40).indices
    x = torch.randn(5, 64)
    with torch.no_grad():
        inner = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        dropped = torch.ones(128, dtype=torch.bool)
        dropped[keep] = False
        want = mlp.down_proj(inner.masked_fill(dropped, 0))  # the full MLP without the 88 least active neurons
        narrow_mlp(model, 40, [window])
        got = model.model.layers[1].mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert model.config.intermediate_size == 40 and model.model.layers[0].mlp.up_proj.weight.shape == (40, 64)
    with pytest.raises(KVServeError, match=r"--mlp must be below the model's MLP width \(40\), got 40"):
        narrow_mlp(model, 40, [window])


def test_vocab_subset_head_gives_the_full_heads_logits_at_its_ids():
    from kvserve.layers.linear import Linear, VocabSubset
    from kvserve.models.base import _q8

    torch.manual_seed(0)
    full = Linear(64, 300, bias=False)
    ids = torch.tensor([7, 0, 299, 42])
    x = torch.randn(3, 64)
    for quantized in (False, True):
        if quantized:
            full.use_quantized(_q8(full.weight))
            full.int8_activations = True
        subset = VocabSubset(full, ids)
        want, got = full(x), subset(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got[:, ids], want[:, ids], rtol=0, atol=1e-5)
        others = torch.ones(300, dtype=torch.bool)
        others[ids] = False
        assert torch.isneginf(got[:, others]).all()


def test_distill_answers_are_the_models_chat_answers(smollm2):
    from kvserve.spec_decode.distill import answers

    ids = answers(smollm2, 2, seed=0, max_tokens=8).ids
    chat = smollm2.engine.tokenize(smollm2.apply_chat_template([{"role": "user", "content": "x"}]), add_special_tokens=False)
    assert ids.count(chat[0]) == 2 * chat.count(chat[0])  # two conversations, each a chat prompt and its answer
    assert 2 * len(chat) < len(ids) <= 2 * (len(chat) + 40 + 8)


def test_distill_answers_with_states_are_the_states_that_generated_them(smollm2):
    """For a feature draft: each answer from its prompt's last token on, with the hidden state the target generated
    the next token from at each position; the engine stops recording afterwards."""
    from kvserve.spec_decode.distill import answers

    plain = answers(smollm2, 2, seed=0, max_tokens=8).ids
    text = answers(smollm2, 2, seed=0, max_tokens=8, states=True)
    assert len(text.ids) == len(text.states) == len(text.starts) and int(text.starts.sum()) == 2
    chat = smollm2.engine.tokenize(smollm2.apply_chat_template([{"role": "user", "content": "x"}]), add_special_tokens=False)
    begin = [i for i in range(len(text.ids)) if text.starts[i]]
    assert all(text.ids[i] == chat[-1] for i in begin)  # the prompt's last token (the template's)
    stretches = [text.ids[a:b] for a, b in zip(begin, begin[1:] + [len(text.ids)])]
    assert all(" ".join(map(str, s[1:])) in " ".join(map(str, plain)) for s in stretches)  # the same greedy answers
    tokens = smollm2.engine.runner.model.compute_logits(text.states.to(smollm2.engine.runner.device)).argmax(-1).tolist()
    assert [t for i, t in enumerate(tokens[:-1]) if not text.starts[i + 1]] == [t for i, t in enumerate(text.ids[1:]) if not text.starts[i + 1]]
    assert not smollm2.engine.feature_observers
    runner, steps = smollm2.engine.runner, []
    runner.execute = lambda batch, execute=runner.execute, **kw: steps.append(execute(batch, **kw)) or steps[-1]
    try:
        smollm2.generate([chat], greedy(2), use_tqdm=False)
    finally:
        del runner.execute
    assert steps and all(step.features is None for step in steps)  # no step keeps hidden states any more


def test_feature_loss_leaves_out_pairs_across_answers():
    """A pair of positions that `follows` does not join (the next answer's first) adds nothing to the loss."""
    from kvserve.spec_decode.distill import feature_loss
    from kvserve.spec_decode.eagle import FeatureDraft

    torch.manual_seed(0)
    draft, head = FeatureDraft(16, 32, 1e-5), torch.randn(40, 16)
    embedded, features = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    follows = torch.ones(2, 5, dtype=torch.bool)
    assert torch.allclose(feature_loss(draft, embedded, features, head, noise=0.0, follows=follows),
                          feature_loss(draft, embedded, features, head, noise=0.0))
    follows[1] = False
    assert torch.allclose(feature_loss(draft, embedded, features, head, noise=0.0, follows=follows),
                          feature_loss(draft, embedded[:1], features[:1], head, noise=0.0))
    follows[0, 2:] = False
    assert torch.allclose(feature_loss(draft, embedded, features, head, noise=0.0, follows=follows),
                          feature_loss(draft, embedded[:1, :3], features[:1, :3], head, noise=0.0))


def test_feature_loss_at_depth_two_goes_on_from_the_drafts_own_prediction():
    """Depth 2 adds the loss of the draft's second step, taken from its own first prediction (not the target's
    state there) and the token after; it leaves out chains that cross an answer's start."""
    from kvserve.spec_decode.distill import feature_loss
    from kvserve.spec_decode.eagle import FeatureDraft

    torch.manual_seed(0)
    draft, head = FeatureDraft(16, 32, 1e-5), torch.randn(40, 16)
    embedded, features = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    loss = lambda e, f, **kw: feature_loss(draft, e, f, head, noise=0.0, **kw)  # noqa: E731
    assert torch.allclose(loss(embedded[:, :2], features[:, :2], depth=2), loss(embedded[:, :2], features[:, :2]))  # no room for a second step
    first = draft(embedded[:, 1:3], features[:, :2])  # three positions: two first steps, one second step (from first[:, 0])
    second = loss(embedded[:, 1:3], torch.stack([first[:, 0], features[:, 2]], 1))  # its loss, as a first step from that state
    assert torch.allclose(2 * loss(embedded[:, :3], features[:, :3], depth=2) - loss(embedded[:, :3], features[:, :3]), second, atol=1e-6)
    assert not torch.allclose(second, loss(embedded[:, 1:3], features[:, 1:3]), atol=1e-3)  # not the step from the target's state
    follows = torch.ones(2, 5, dtype=torch.bool)
    follows[1], follows[0, 2:] = False, False
    assert torch.allclose(loss(embedded, features, follows=follows, depth=2), loss(embedded[:1, :3], features[:1, :3], depth=2))


def test_distill_answers_past_the_prompts_are_sampled_rounds(smollm2, monkeypatch):
    from kvserve.spec_decode import distill

    monkeypatch.setattr(distill, "TOPICS", ["the moon"])
    monkeypatch.setattr(distill, "TASKS", ["Write a short poem about {}."])
    chat = smollm2.engine.tokenize(smollm2.apply_chat_template([{"role": "user", "content": "Write a short poem about the moon."}]),
                                   add_special_tokens=False)
    ids = distill.answers(smollm2, 3, seed=0, max_tokens=12).ids
    starts = [i for i in range(len(ids)) if ids[i:i + len(chat)] == chat]
    rounds = [ids[a + len(chat):b] for a, b in zip(starts, starts[1:] + [len(ids)])]
    assert len(rounds) == 3  # one prompt, answered three times
    assert rounds[0] == smollm2.generate([chat], greedy(12), use_tqdm=False)[0].outputs[0].token_ids[:len(rounds[0])]
    assert len({tuple(r) for r in rounds}) == 3  # the sampled rounds differ from the greedy one and from each other
    text = distill.answers(smollm2, 3, seed=0, max_tokens=12, states=True)  # each round's answer keeps its own states
    tokens = smollm2.engine.runner.model.compute_logits(text.states.to(smollm2.engine.runner.device)).argmax(-1).tolist()
    follows = [i for i in range(len(text.ids) - 1) if not text.starts[i + 1]]
    assert int(text.starts.sum()) == 3 and len(text.states) == len(text.ids)
    assert [tokens[i] for i in follows[:11]] == text.ids[1:12]  # the greedy round: each state gave the next token


def test_distill_self_prompts_are_user_messages_the_model_wrote(smollm2):
    """--prompts self: distinct messages, each what the model samples after its chat template's user turn opens
    (seeded: the same seed, the same messages); answers() asks them in the chat template."""
    from kvserve.spec_decode.distill import answers, self_prompts

    prompts = self_prompts(smollm2, 3, seed=0, max_tokens=48)
    assert len(set(prompts)) == 3 and all(p and p == p.strip() for p in prompts)
    assert self_prompts(smollm2, 3, seed=0, max_tokens=48) == prompts
    assert self_prompts(smollm2, 3, seed=1, max_tokens=48) != prompts
    template = smollm2.apply_chat_template([{"role": "user", "content": "\x00"}])
    start = smollm2.engine.tokenize(template[:template.index("\x00")], add_special_tokens=False)
    written = smollm2.generate([start], SamplingParams(temperature=1.0, max_tokens=48, seed=0), use_tqdm=False)[0].outputs[0]
    if written.finish_reason == "stop":  # the first sample is the first prompt unless it ran past max_tokens
        assert prompts[0] == written.text.strip()
    ids = answers(smollm2, 1, seed=0, max_tokens=4, prompts=prompts[1:]).ids
    chat = smollm2.engine.tokenize(smollm2.apply_chat_template([{"role": "user", "content": prompts[1]}]), add_special_tokens=False)
    assert ids[:len(chat)] == chat and len(ids) == len(chat) + 4
    with pytest.raises(KVServeError, match=r"wrote 0 different finished user messages in 1 rounds, not 2"):
        self_prompts(smollm2, 2, seed=0, max_tokens=1, rounds=1)  # no message ends within one token


def test_distill_rejects_an_unknown_prompt_source():
    from kvserve.spec_decode.distill import DistillSettings, distill

    with pytest.raises(KVServeError, match="--prompts must be one of builtin, self, got 'web'"):
        distill(DistillSettings(answers=4, prompts="web"))


def _bench():
    """bench/speculative.py as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_speculative", Path(__file__).parents[1] / "bench" / "speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_distill_prompts_are_distinct_and_not_the_benchmarks():
    """--answers N up to the prompts' number are N greedy answers to N different prompts, none on a topic of the
    benchmark's open generation."""
    from kvserve.spec_decode.distill import TOPICS, chat_prompts

    bench = _bench()
    prompts = chat_prompts()
    assert len(set(prompts)) == len(prompts) == 4312
    assert not set(bench.OPEN) & set(prompts)
    open_text = " ".join(bench.OPEN).lower()
    assert not [topic for topic in TOPICS if re.search(rf"\b{re.escape(topic.lower().removeprefix('the ').removeprefix('a '))}\b", open_text)]


def test_speculative_benchmark_takes_a_step_apart(tiny_model_dir):
    """bench/speculative.py's split of a decode step: the forward pass and the proposer's guessing, timed around
    the engine's methods, are within the step's time, and its clocks count one forward pass for the prompt and one
    for each decode step."""
    bench = _bench()
    llm = LLM(str(tiny_model_dir), speculative="ngram:min_acceptance=0,min_speedup=0", **FP32)
    clocks = bench.timers(llm)
    rate, outputs, drafted, kept, step, forward, propose, attention = bench.run(llm, False, [[5, 6, 7, 8] * 8], 24, clocks)
    steps = len(outputs[0]) - 1 - kept
    assert drafted > kept > 0 and len(clocks[0].calls) == len(clocks[2].calls) == 1 + steps
    assert 0 < forward and 0 < propose and forward + propose <= step and 0 <= attention <= forward


def test_no_guesses_in_a_step_of_more_than_max_batch_decodes(tiny_model_dir):
    """ngram:max_batch=1: two requests decoding together get no guesses; one alone does (its text repeats)."""
    llm = LLM(str(tiny_model_dir), speculative="ngram:max_batch=1", **FP32)
    prompt = [5, 6, 7, 8] * 8
    alone = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    together = llm.generate([prompt, prompt[1:]], greedy(16), use_tqdm=False)
    assert alone.metrics.num_draft_tokens > 0
    assert sum(o.metrics.num_draft_tokens for o in together) == 0
    with pytest.raises(KVServeError, match="max_batch >= 1"):
        LLM(str(tiny_model_dir), speculative="ngram:max_batch=0")


def test_a_draft_pruned_from_a_gguf_file_saves_and_loads(smollm2, tmp_path):
    """transformers marks a model read from GGUF as quantized, which bars save_pretrained: the draft is saved plain."""
    from kvserve.spec_decode.distill import prune, save

    save(prune(smollm2, 2), smollm2, tmp_path / "draft", vocab=[5, 6, 7])
    draft = LLM(str(tmp_path / "draft"), **FP32)
    assert draft.engine.checkpoint.config.num_layers == 2 and draft.engine.tokenizer is not None
