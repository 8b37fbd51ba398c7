"""Each architecture against transformers on tiny random models (fp32, 1e-4): every step's logits, greedy
tokens, and the same tokens batched, in small prefill chunks and with prefix-cache hits, where sliding-window
layers keep only their window's blocks."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, KVServeError
from tests.conftest import FP32, greedy, save_tiny
from tests.test_llama import prefill_logits, step_logits

WINDOW = 12  # shorter than the prompts
GEMMA = dict(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
MLA = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=4,
           first_k_dense_replace=2, num_key_value_heads=4)
CASES = {
    "mistral-sliding": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2-sliding-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3-bias": ("qwen3", dict(head_dim=16, attention_bias=True)),
    "gemma3": ("gemma3_text", GEMMA),
    "gemma3-gqa-tied": ("gemma3_text", dict(GEMMA, num_key_value_heads=2, tie_word_embeddings=True)),
    "deepseek-mla": ("deepseek_v3", MLA),
    "deepseek-mla-q-proj": ("deepseek_v3", dict(MLA, q_lora_rank=None)),
}


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    hf = save_tiny(tmp_path, arch, **overrides)
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", block_size=4, **FP32)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, logits = step_logits(llm, prompt, 12)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + tokens])).logits[0]
    torch.testing.assert_close(prefill_logits(llm, prompt), expected[: len(prompt)], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, expected[len(prompt) - 1: -1], atol=1e-4, rtol=0)
    assert tokens == expected[len(prompt) - 1: -1].argmax(-1).tolist()
    assert llm.engine.kv_manager.pool.num_used == 0


@pytest.mark.parametrize("case", ["mistral-sliding", "qwen2-sliding-layers", "qwen3", "gemma3", "deepseek-mla"])
def test_batched_chunked_and_prefix_hits_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    hf = save_tiny(tmp_path, arch, **overrides)
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 256, (30,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 17)]
    expected = [_hf_greedy(hf, p, 10) for p in prompts]
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=8, **FP32)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], greedy(10), use_tqdm=False)] == expected[:1]
    stats = llm.engine.scheduler.stats
    hits = stats.prefix_hits
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(10), use_tqdm=False)] == expected
    assert stats.prefix_hits - hits >= 3 * 24  # each prompt found the shared prefix's blocks (a window's, when sliding)
    assert llm.engine.kv_manager.pool.num_used == 0


def test_sliding_groups_hold_only_their_window(tiny_sliding_dir):
    """After a long request, a sliding group's table holds the window and one step's tokens, the rest NULL."""
    llm = LLM(str(tiny_sliding_dir), kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=8, **FP32)
    engine, kv = llm.engine, llm.engine.kv_manager
    windows = [g.spec.window for g in engine.layout.groups]
    assert sorted(windows, key=str) == [6, None]
    engine.add_request(list(range(1, 100)), greedy(20))
    held, freed = [], []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in (s for seqs in engine.requests.values() for s in seqs):
            for table, window in zip(seq.block_tables.ids.tolist(), windows):
                live = [b for b in table if b != -1]
                assert table[len(table) - len(live):] == live  # NULLs only lead
                if window:
                    held.append(len(live))
                    freed.append(len(table) - len(live))
                    assert len(live) <= -(-(window - 1 + 8) // 4) + 1
                else:
                    assert len(live) == len(table)
    assert max(held) >= 2 and max(freed) >= (99 + 19 - 6) // 4 - 1 and kv.pool.num_used == 0


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(KVServeError, match="unsupported model_type 'gpt2'; supported: llama, mistral, qwen2"):
        LLM(str(tmp_path))


def test_gemma3_in_float16_is_refused(tmp_path):
    """Gemma 3 270M in float16 overflowed to NaN logits (an empty answer) where bf16 and fp32 answered; vLLM refuses it too."""
    save_tiny(tmp_path, "gemma3_text", **GEMMA)
    with pytest.raises(KVServeError, match="model type gemma3_text does not run in float16: .* use dtype bfloat16 or float32"):
        LLM(str(tmp_path), dtype="float16")
    assert LLM(str(tmp_path), dtype="bfloat16", num_blocks=16).generate([[1, 2]], use_tqdm=False)[0].outputs[0].token_ids


def test_mla_caches_the_latent_only_as_the_planner_says(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from kvserve.memory import kv_bytes_per_token, load_spec, mha_factor
    from tests.conftest import TINY

    DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, **MLA})).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", block_size=4, **FP32)
    layout, spec = llm.engine.layout, load_spec(str(tmp_path))
    assert layout.bytes_per_token == 2 * (32 + 8) * 4 == kv_bytes_per_token(spec, "fp32")  # 2 layers x (rank + rope) x fp32
    assert mha_factor(spec) == pytest.approx(4 * (16 + 8 + 24) / (32 + 8))  # what full MHA would cache instead
    out = llm.generate([list(range(1, 30))], greedy(8), use_tqdm=False)[0]
    assert out.metrics.kv_bytes == (29 + 8 - 1) * layout.bytes_per_token
    assert LLM(str(tmp_path), kv_cache_memory="4MiB", kv_cache_dtype="fp8_e4m3", **FP32).generate([list(range(1, 30))], greedy(8), use_tqdm=False)


def test_deepseek_moe_layers_are_one_clear_error(tmp_path):
    from transformers import DeepseekV3Config

    from tests.conftest import TINY

    DeepseekV3Config(**{**TINY, **MLA, "n_routed_experts": 4, "first_k_dense_replace": 1}).save_pretrained(tmp_path)
    with pytest.raises(KVServeError, match="mixture-of-experts layers are not supported"):
        LLM(str(tmp_path))
