"""The real Gemma 3 270M (Q4_K_M GGUF from its chunk packages): greedy tokens equal transformers' reading the
same file, and its sliding-window layers hold only their window's blocks at long context."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.layers.linear import Linear
from kvserve.models.loader import transformers_model
from kvserve.models.registry import resolve_model_path
from tests.conftest import FP32, assert_fused_paths_agree, greedy


@pytest.fixture(scope="module")
def gemma3() -> LLM:
    return LLM("gemma3-270m", kv_cache_memory="256MiB", **FP32)


def test_its_q4_k_m_weights_stay_packed(gemma3):
    """Q5_0 q/k/gate/up, Q8_0 v and the tied embedding, Q4_K and Q6_K o/down: every linear layer reads its file's own
    types (a fused q/k/v keeps a part per type), and the weights hold about the file's size."""
    model = gemma3.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.qweight is not None and m.weight is None for m in layers)
    assert model.layers[0].self_attn.qkv_proj.qweight.types == ["Q5_0", "Q8_0"]
    assert {t for m in layers for t in m.qweight.types} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert model.lm_head.qweight is model.embed_tokens.qweight
    size = resolve_model_path("gemma3-270m").stat().st_size
    assert 0.97 * size < model.weight_bytes() < 1.03 * size


def test_greedy_matches_transformers_from_gguf(gemma3):
    hf = transformers_model(resolve_model_path("gemma3-270m")).eval()
    chat = gemma3.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    assert chat.startswith("<bos><start_of_turn>user\nName three colors.<end_of_turn>\n<start_of_turn>model\n")
    prompts = [gemma3.engine.tokenize(p) for p in ("The capital of France is", "def fibonacci(n):")]
    prompts.append(gemma3.engine.tokenize(chat, add_special_tokens=False))
    outputs = gemma3.generate(prompts, greedy(32), use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(ids):]
        assert out.outputs[0].token_ids == expected.tolist(), (out.outputs[0].text, gemma3.tokenizer.decode(expected))


def test_local_layers_hold_the_window_at_4k_context(gemma3):
    engine, kv = gemma3.engine, gemma3.engine.kv_manager
    layout = engine.layout
    sliding = [g for g, group in enumerate(layout.groups) if group.spec.window]
    assert len(sliding) == 5 and layout.groups[sliding[0]].spec.window == 512
    prompt = (list(range(1000, 5000)))
    engine.add_request(prompt, greedy(4))
    seq = engine.requests[next(iter(engine.requests))][0]
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished and seq.num_computed_tokens >= len(prompt):  # decoding: the window plus one block
            held = [int((seq.block_tables[g] != -1).sum()) for g in sliding]
            assert max(held) <= 512 // layout.block_size + 1
            pool_bytes = kv.pool.num_used * layout.block_bytes()
            planned = layout.bytes_held(seq.num_computed_tokens)  # the planner's figure
            assert planned <= pool_bytes <= planned + len(layout.groups) * layout.block_bytes()
            full_only = layout.block_bytes() * -(-seq.num_computed_tokens // layout.block_size)
            assert pool_bytes < 1.2 * full_only + 5 * (512 // layout.block_size + 1) * layout.block_bytes()
    assert kv.pool.num_used == 0


def test_fused_decode_layers_give_the_module_paths_logits():
    """Gemma 3's decode steps (q/k norms, norms over the attention's and the MLP's outputs, GELU-tanh, sliding and
    global layers with their own RoPE) as one native call for the layer stack, as fused ops per layer, and as modules;
    one prompt is past the 512-token window. No prefix caching: each run computes its prompts in the same chunks."""
    llm = LLM("gemma3-270m", kv_cache_memory="128MiB", enable_prefix_caching=False, **FP32)
    long = llm.engine.tokenize("Once upon a time, " * 120)
    assert len(long) > 600
    prompts = [llm.engine.tokenize(p) for p in ("The capital of France is", "def fibonacci(n):")] + [long]
    assert_fused_paths_agree(llm, prompts, greedy(24, logprobs=3), tolerance=1e-5)
