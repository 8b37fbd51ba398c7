"""The model runner's step inputs: a step of plain decodes takes prepare's short cut, which must build exactly what
the general path builds for it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import QueryGroup
from kvserve.engine.model_runner import _plain_decodes
from tests.conftest import FP32


def assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, QueryGroup):
        for f in dataclasses.fields(QueryGroup):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a is b or a == b, f"{where}: {a} != {b}"


@pytest.mark.parametrize("model, options", [("tiny_model_dir", {}), ("tiny_sliding_dir", {}),
                                            ("tiny_model_dir", dict(max_num_batched_tokens=4))])
def test_plain_decode_steps_get_the_general_paths_inputs(request, model, options):
    """Sequences crossing blocks, a sliding window's group, and (with 4 tokens a step) prompts fed a token at a time
    beside decodes, where a step's rows do not all sample."""
    llm = LLM(str(request.getfixturevalue(model)), kv_cache_memory="4MiB", block_size=4, **FP32, **options)
    runner, compared, partial = llm.engine.runner, [], []
    shortcut = runner.prepare

    def prepare(batch, whole=False):  # (no whole steps: these models' layers are not packed, so none is stacked)
        inputs = shortcut(batch)
        if _plain_decodes(batch):
            general = runner._prepare_any(batch)
            rows = len(batch.seqs)
            if inputs.logits_index is None:  # None: every row, in order
                assert_same(general.logits_index, torch.arange(rows), "logits_index")
            else:
                assert_same(inputs.logits_index, general.logits_index, "logits_index")
                partial.append(batch)
            for name in ("input_ids", "sampling_rows", "prompt_rows", "group_rows"):
                assert_same(getattr(inputs, name), getattr(general, name), name)
            for name in ("positions", "slot_mappings", "groups", "backend", "votes", "step_arguments"):
                assert_same(getattr(inputs.ctx, name), getattr(general.ctx, name), f"ctx.{name}")
            compared.append(rows)
        return inputs

    runner.prepare = prepare
    prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate((1, 2, 3, 14))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert max(compared) == len(prompts)
    assert bool(partial) == ("max_num_batched_tokens" in options)


def test_a_budget_of_one_token_a_step_feeds_prompts_a_token_at_a_time(tiny_model_dir):
    """A step whose one row is a prompt's token before its last samples nothing: its empty logits_index was a float
    tensor, and indexing with it an IndexError."""
    prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate((1, 5, 9))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one, whole = (LLM(str(tiny_model_dir), max_num_batched_tokens=budget, **FP32).generate(prompts, params, use_tqdm=False)
                  for budget in (1, None))
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in whole]
