"""Sampling options and stop conditions, end to end through the engine."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, KVServeError, SamplingParams
from tests.conftest import greedy

PROMPT = "Once upon a time"


def test_seed_reproducible_and_different_seeds_differ(smollm2):
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in (7, 7, 8)]
    a, b, c = (smollm2.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].token_ids for p in params)
    assert a == b
    assert a != c


def test_top_k_1_and_tiny_top_p_are_greedy(smollm2):
    expected = smollm2.generate(PROMPT, greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    for params in (SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True, seed=1),
                   SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16, ignore_eos=True, seed=2)):
        assert smollm2.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_logit_bias_bans_and_forces_tokens(smollm2):
    """OpenAI's logit_bias: -100 keeps the greedy answer's tokens out of it, +100 makes one token the answer; a
    token past the vocabulary is a clear error."""
    expected = smollm2.generate(PROMPT, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    banned = smollm2.generate(PROMPT, greedy(8, logit_bias={t: -100 for t in expected}), use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(expected)
    forced = smollm2.generate(PROMPT, SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True, logit_bias={42: 100}),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [42] * 4
    with pytest.raises(KVServeError, match="past the vocabulary"):
        smollm2.generate(PROMPT, greedy(2, logit_bias={10**6: 1.0}), use_tqdm=False)


def test_max_tokens_and_length_reason(smollm2):
    out = smollm2.generate(PROMPT, greedy(5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_no_max_tokens_runs_to_the_requests_limit(tiny_model_dir):
    """vLLM's max_tokens=None: up to the context window (it was an error); min_tokens past that room is refused before
    any prompt of the call is queued."""
    llm = LLM(str(tiny_model_dir), max_model_len=40, num_blocks=16)
    outs = llm.generate([[1, 2, 3], list(range(1, 31))], greedy(None, n=2), use_tqdm=False)
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[37, 37], [10, 10]]
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)
    with pytest.raises(KVServeError, match="min_tokens 20 is more than max_tokens .none given: the 10 tokens left"):
        llm.generate([[1, 2], list(range(1, 31))], greedy(None, min_tokens=20), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_stop_string_cuts_text(smollm2):
    full = smollm2.generate(PROMPT, greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = full.split()[3]
    out = smollm2.generate(PROMPT, greedy(24, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == full[: full.index(stop)]


def test_stop_token_id(smollm2):
    full = smollm2.generate(PROMPT, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    out = smollm2.generate(PROMPT, greedy(12, stop_token_ids=[full[4]]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == full[: full.index(full[4]) + 1] and out.outputs[0].finish_reason == "stop"


def test_eos_stops_unless_ignored(smollm2):
    messages = [{"role": "user", "content": "Say hi."}]
    stopped = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=64))[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].token_ids[-1] in smollm2.engine.eos_token_ids
    ignored = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=len(stopped.outputs[0].token_ids) + 3, ignore_eos=True))[0]
    assert ignored.outputs[0].finish_reason == "length" and len(ignored.outputs[0].token_ids) == len(stopped.outputs[0].token_ids) + 3


def test_min_tokens_holds_off_eos_stop_tokens_and_strings(smollm2):
    """vLLM's min_tokens: the greedy answer that ended with EOS goes on past it, neither EOS, a stop token nor a
    stop string ends it early; the stops work again from min_tokens on."""
    messages = [{"role": "user", "content": "Say hi."}]
    stopped = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    length, eos = len(stopped.token_ids), smollm2.engine.eos_token_ids
    longer = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=64, min_tokens=length + 4))[0].outputs[0]
    assert longer.token_ids[:length - 1] == stopped.token_ids[:-1] and len(longer.token_ids) >= length + 4
    assert not set(longer.token_ids[:length + 4]) & eos
    # a stop string (not a banned token: the tokens stay the same) is not looked for before min_tokens
    kept = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=length + 4, min_tokens=length + 4, stop=[longer.text[:3]]))[0]
    assert kept.outputs[0].token_ids == longer.token_ids[:length + 4] and kept.outputs[0].finish_reason == "length"
    assert len(smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=64, stop=[longer.text[:3]]))[0].outputs[0].token_ids) < 3
    # a stop token is banned before min_tokens, and stops the output after it
    j = next(i for i in range(length + 4, len(longer.token_ids)) if longer.token_ids[i] not in longer.token_ids[:i])
    held = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=64, min_tokens=length + 4,
                                                 stop_token_ids=[longer.token_ids[j]]))[0].outputs[0]
    assert held.token_ids == longer.token_ids[:j + 1] and held.finish_reason == "stop"


def test_logprobs_equal_transformers(smollm2, hf_smollm2):
    """The chosen token's and the top 3's log-probabilities at each step, against transformers' log-softmax (fp32)."""
    out = smollm2.generate(PROMPT, SamplingParams(temperature=0.7, seed=1, max_tokens=6, logprobs=3), use_tqdm=False)[0]
    hf = hf_smollm2
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)[len(out.prompt_token_ids) - 1: -1]
    for lp, token, row in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, expected):
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        values, top = row.topk(3)
        assert list(lp.top) == top.tolist() and list(lp.top.values()) == pytest.approx(values.tolist(), abs=1e-4)


def test_logprobs_are_reported(smollm2):
    out = smollm2.generate(PROMPT, greedy(4, logprobs=3), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 4
    for lp, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob, abs=1e-5)  # greedy picks the top token


@pytest.mark.parametrize("bad", [dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0),
                                 dict(top_k=0), dict(repetition_penalty=0.0), dict(stop=[""]), dict(temperature=float("inf")),
                                 dict(seed=2**64), dict(seed=1.5), dict(logit_bias={1: 101.0}), dict(logit_bias={-1: 1.0}),
                                 dict(logit_bias={1: float("nan")}), dict(max_tokens=2.5), dict(n=2.0), dict(top_k=True), dict(min_p=1.5), dict(min_tokens=20),
                                 dict(temperature="0.5"), dict(logprobs=1.0), dict(stop=5), dict(stop_token_ids=3),  # were TypeErrors
                                 dict(cache_salt=5), dict(stop_token_ids=[True])])  # True was token 1
def test_invalid_sampling_values(bad):
    field = next(iter(bad))
    with pytest.raises(KVServeError, match=field):
        SamplingParams(**bad)


def test_streaming_yields_each_token(smollm2):
    outs = list(smollm2.stream(PROMPT, greedy(6)))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert "".join(o.outputs[0].new_text for o in outs) == outs[-1].outputs[0].text
    assert outs[-1].finished and not outs[0].finished


def _filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The distribution temperature, min-p, top-k and top-p define, written out with a full sort."""
    probs = (logits / temperature).softmax(-1)
    ordered, order = probs.sort(descending=True)
    ordered = torch.where(ordered >= min_p * ordered[0], ordered, 0.0)
    ordered = ordered / ordered.sum()
    keep = (torch.arange(len(probs)) < (top_k if top_k > 0 else len(probs))) & (ordered > 0)
    keep &= (ordered.cumsum(0) - ordered) < top_p
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = ordered[keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.8, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (1.0, 50, 0.8, 0.0),
                                                         (1.0, -1, 0.97, 0.0), (1.0, -1, 1.0, 0.05), (1.5, 6, 0.9, 0.2)])
def test_sampled_tokens_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    """Draws against the rule written out with a full sort: never a token the filters drop, the likeliest tokens'
    shares and the rest's within 4 sigma. The logits have a long flat tail, so top_p 0.97 needs more candidates than
    the sampler first looks at (its fallback)."""
    from kvserve.layers.sampler import TOP_P_CANDIDATES, SamplingBatch, sample

    logits = torch.cat([torch.tensor([6.0, 5.5, 5.0, 4.0, 3.0, 2.5, 2.0, 1.0]), torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 0.1])
    expected = _filtered(logits, temperature, top_k, top_p, min_p)
    if (temperature, top_p) == (1.0, 0.97):
        assert int((expected > 0).sum()) > max(TOP_P_CANDIDATES)
    if min_p:  # min_p drops tokens here that the other filters keep
        assert int((expected > 0).sum()) < int((_filtered(logits, temperature, top_k, top_p, 0.0) > 0).sum())
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=0)
    generator = torch.Generator().manual_seed(1)
    n = 20000
    tokens = torch.tensor([sample(logits[None], SamplingBatch([params], [generator], [[]], [0], [[]])).token_ids[0] for _ in range(n)])
    assert bool((expected[tokens] > 0).all())
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    for share, want in [(counts[:8] / n, expected[:8].double()), (counts[8:].sum()[None] / n, expected[8:].sum().double()[None])]:
        sigma = (want * (1 - want) / n).sqrt()
        assert bool(((share - want).abs() <= 4 * sigma + 1e-9).all()), (share, want)


def test_a_seeded_rows_draws_do_not_depend_on_the_rows_beside_it():
    """Sampling rows draw in one batch; each row's tokens, from its own generator, are the ones it draws alone,
    whatever the others' filters: none, min-p, top-k, top-p past the first candidates, a top-k past them, greedy."""
    from kvserve.layers.sampler import SamplingBatch, sample

    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=1.2, min_p=0.1), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.97), SamplingParams(temperature=0), SamplingParams(temperature=1.1, top_k=2000, top_p=0.99)]

    def draws(rows: list[int]) -> list[list[int]]:
        batch = SamplingBatch([params[i] for i in rows], [torch.Generator().manual_seed(10 + i) for i in rows], [[]] * len(rows),
                              [0] * len(rows), [[]] * len(rows))
        return [sample(logits[rows], batch).token_ids for _ in range(40)]

    together = draws([2, 0, 3, 4, 5, 1])
    for column, i in enumerate([2, 0, 3, 4, 5, 1]):
        alone = [tokens[0] for tokens in draws([i])]
        assert [tokens[column] for tokens in together] == alone
        assert len(set(alone)) > 1 or not params[i].temperature  # a sampling row's draws vary


def test_penalties_apply_to_each_rows_history():
    """Repetition penalty over the prompt and the output (logits above 0 divided, below multiplied); frequency and
    presence penalties over the output only, a row's guesses before it counted as output; logit biases added before
    the penalties; rows without either and the logits passed in untouched."""
    from kvserve.layers.sampler import SamplingBatch, _adjust_logits

    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]]).repeat(3, 1)
    history = [0, 1, 2, 2]  # prompt [0, 1], output [2, 2]
    params = [SamplingParams(repetition_penalty=2.0, logit_bias={4: 1.0, 1: 3.0}),
              SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), SamplingParams()]
    batch = SamplingBatch(params, [None] * 3, [history] * 3, [2] * 3, [[], [3], []])
    out = _adjust_logits(logits, batch)
    # min_tokens bans a row's early stops while its output (guesses before the row included) is shorter
    banned = SamplingBatch([SamplingParams(min_tokens=3, max_tokens=4)] * 2, [None] * 2, [history] * 2, [2] * 2, [[], [4]], [[1, 4]] * 2)
    assert torch.equal(_adjust_logits(logits[:2], banned), torch.tensor([[2.0, -torch.inf, 1.0, 0.5, -torch.inf], [2.0, -2.0, 1.0, 0.5, 3.0]]))
    assert torch.equal(out[0], torch.tensor([1.0, 0.5, 0.5, 0.5, 4.0]))  # token 1: (-2 + 3) / 2; token 4 unseen: 3 + 1
    assert torch.equal(out[1], torch.tensor([2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 3.0]))  # token 2 twice, 3 once
    assert torch.equal(out[2], logits[2]) and torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]]).repeat(3, 1))


def test_extreme_temperatures_and_penalties_draw_real_tokens():
    """Temperature 1e-45 made logits / temperature inf, and a repetition penalty of 1e-40 divided logits to inf: NaN
    probabilities, whose draw was the vocabulary's last token. A temperature under 1e-5 is greedy (vLLM's rule)."""
    from kvserve.layers.sampler import SamplingBatch, sample

    logits = torch.tensor([[1.0, 4.0, 2.0, -1.0, 0.5, 3.0]])

    def draw(params: SamplingParams, history: list[int]) -> int:
        return sample(logits, SamplingBatch([params], [torch.Generator().manual_seed(0)], [history], [len(history)], [[]])).token_ids[0]

    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    for temperature in (1e-45, 1e-6, 1e-4):
        assert draw(SamplingParams(temperature=temperature, seed=0), []) == 1
    # the penalty lifts the seen positive logits 2 and 3 to the same (largest finite) value: the first of them wins
    assert draw(SamplingParams(temperature=0, repetition_penalty=1e-40), [2, 5]) == 2
    assert draw(SamplingParams(temperature=1.0, repetition_penalty=1e-40), [2]) == 2
