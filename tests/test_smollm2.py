"""The real SmolLM2 GGUF: kvserve's greedy tokens equal transformers' reading the same file."""
from __future__ import annotations

import torch

from kvserve import SamplingParams
from tests.conftest import greedy

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "Explain what a KV cache is in one sentence."]


def test_greedy_matches_transformers_from_gguf(smollm2, hf_smollm2):
    hf = hf_smollm2
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = smollm2.chat(conversations, greedy(32))
    for conversation, out in zip(conversations, outputs):
        ids = smollm2.engine.tokenize(smollm2.apply_chat_template(conversation), add_special_tokens=False)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[0, len(ids):]
        assert out.outputs[0].token_ids == expected.tolist(), (out.outputs[0].text, smollm2.tokenizer.decode(expected))


def test_chat_answer_is_sensible(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=40))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    m = out.metrics
    assert m.ttft > 0 and m.num_output_tokens == len(out.outputs[0].token_ids) and m.kv_bytes > 0
