"""prompt_logprobs: each prompt token's log-probability, through the paged cache and chunked prefill, equals
transformers' log-softmax over the same prompt (SmolLM2, fp32)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, KVServeError, SamplingParams
from tests.conftest import FP32

TEXT = ("The KV cache keeps the keys and values of every token a model has seen, so that each new token attends to "
        "them without recomputing the prefix. Its size grows with the context length and the batch. ") * 2


@pytest.fixture(scope="module")
def expected(smollm2, hf_smollm2):
    hf = hf_smollm2
    ids = smollm2.engine.tokenize(TEXT)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    return ids, logprobs


def _score(llm: LLM, ids: list[int], top: int = 3):
    return llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top), use_tqdm=False)[0].prompt_logprobs


@pytest.mark.parametrize("chunk", [512, 17], ids=["one-chunk", "many-chunks"])
def test_prompt_logprobs_equal_transformers(smollm2, expected, chunk):
    ids, logprobs = expected
    llm = smollm2 if chunk == 512 else LLM("smollm2-135m", max_num_batched_tokens=chunk, **FP32)
    scored = _score(llm, ids)
    assert scored[0] is None and len(scored) == len(ids)
    got = torch.tensor([s.logprob for s in scored[1:]])
    want = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    for position, s in enumerate(scored[1:], start=1):
        row = logprobs[position - 1]
        assert s.token_id == ids[position] and len(s.top) == 3
        assert all(abs(value - row[t].item()) < 1e-3 for t, value in s.top.items())  # the right values...
        assert min(s.top.values()) >= row.topk(3).values[-1].item() - 1e-3  # ...of the top 3 tokens


def test_prompt_logprobs_after_a_prefix_cache_hit(smollm2, expected):
    """A scoring request reads no cached prefix (it needs every position's logits), so a cached prompt scores the same."""
    ids, logprobs = expected
    smollm2.generate(ids, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # caches the prompt's blocks
    out = smollm2.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.metrics.cached_tokens == 0
    want = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor([s.logprob for s in out.prompt_logprobs[1:]]), want, atol=1e-3, rtol=0)


def test_prompt_logprobs_bounds():
    with pytest.raises(KVServeError, match="prompt_logprobs must be in \\[0, 20\\], got 21"):
        SamplingParams(prompt_logprobs=21)
