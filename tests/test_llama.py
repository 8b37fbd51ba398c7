"""kvserve's model code against transformers on tiny random Llama-family models (fp32, 1e-4)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.engine.scheduler import ScheduledBatch
from kvserve.engine.sequence import Sequence
from tests.conftest import FP32, greedy, save_tiny_llama

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}
CASES = {
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "mqa-untied": dict(num_key_value_heads=1, tie_word_embeddings=False),
    "gqa-llama3-rope": dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    "mha-linear-rope": dict(num_key_value_heads=4, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}),
    "mistral-head-dim": dict(num_key_value_heads=2, head_dim=32, model_type_override="mistral"),
}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _save(path, overrides):
    overrides = dict(overrides)
    if overrides.pop("model_type_override", None) == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        from tests.conftest import TINY

        torch.manual_seed(0)
        model = MistralForCausalLM(MistralConfig(**{**TINY, **overrides}, sliding_window=None)).eval()
        model.save_pretrained(path)
        return model
    return save_tiny_llama(path, **overrides)


def step_logits(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of every step (prefill's last position, then each decode step)."""
    engine, tokens, logits = llm.engine, [], []
    engine.add_request(prompt, greedy(new_tokens))
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].new_token_ids
            logits.append(engine.runner.last_logits[0].to("cpu", copy=True))  # its own copy, as the steps go on
    return tokens, torch.stack(logits)


def prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill pass through the paged cache."""
    engine = llm.engine
    seq = Sequence("prefill", None, prompt, greedy(1), len(engine.layout.groups))
    assert engine.kv_manager.allocate_slots(seq, len(prompt))
    batch = ScheduledBatch([seq], [len(prompt)])
    with torch.inference_mode():
        inputs = engine.runner.prepare(batch)
        logits = engine.runner.model.compute_logits(engine.runner.model(inputs.input_ids, inputs.ctx))
    engine.kv_manager.free(seq)
    return logits.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case, device):
    hf = _save(tmp_path, CASES[case]).to(device)
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", device=device, **FP32)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, logits = step_logits(llm, prompt, 12)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + tokens], device=device)).logits[0].cpu()
    torch.testing.assert_close(prefill_logits(llm, prompt), expected[: len(prompt)], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, expected[len(prompt) - 1: -1], atol=1e-4, rtol=0)
    assert tokens == expected[len(prompt) - 1: -1].argmax(-1).tolist()
    assert llm.engine.kv_manager.pool.num_used == 0
