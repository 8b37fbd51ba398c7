"""matmul_dtype: a float32 model's linear weights kept in bf16 (where the CPU multiplies bf16 natively), and
what that costs in accuracy against fp32 on SmolLM2. The SmolLM2 engines built here run on the CPU even where
torch sees a GPU: the native kernels, their row limits and batch invariance are the CPU's."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, KVServeError, config
from kvserve.config import EngineConfig, cpu_has_native_bf16
from kvserve.kernels import native_ops
from kvserve.layers.linear import Linear
from tests.conftest import FP32, greedy
from tests.test_llama import prefill_logits


def test_bf16_weight_takes_fp32_in_and_out():
    layer = Linear(64, 32, bias=True)
    exact = layer(x := torch.randn(20, 64))
    layer.weight = torch.nn.Parameter(layer.weight.detach().bfloat16(), requires_grad=False)
    out = layer(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.bfloat16(), layer.weight).float() + layer.bias)
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()


def _weight_dtypes(llm: LLM) -> dict[str, torch.dtype]:
    model = llm.engine.runner.model
    return {"decoder": model.layers[0].mlp.down_proj.weight.dtype, "head": model.lm_head.weight.dtype,
            "embedding": model.embed_tokens.weight.dtype}


def test_matmul_dtype_setting(tiny_model_dir):
    fp32, bf16 = torch.float32, torch.bfloat16
    assert _weight_dtypes(LLM(str(tiny_model_dir), num_blocks=8, **FP32)) == {"decoder": fp32, "head": fp32, "embedding": fp32}
    assert _weight_dtypes(LLM(str(tiny_model_dir), num_blocks=8, matmul_dtype="bfloat16")) == \
        {"decoder": bf16, "head": bf16, "embedding": fp32}
    assert LLM(str(tiny_model_dir), num_blocks=8, matmul_dtype="bfloat16").engine.runner.model.describe_matmuls() == "bf16"
    auto = _weight_dtypes(LLM(str(tiny_model_dir), num_blocks=8))["decoder"]
    assert auto == (bf16 if cpu_has_native_bf16() and not torch.cuda.is_available() else fp32)
    with pytest.raises(KVServeError, match="matmul_dtype must be auto, float32 or bfloat16, got 'int8'"):
        LLM(str(tiny_model_dir), matmul_dtype="int8")


@pytest.fixture
def no_amx(monkeypatch):
    """A CPU without AMX, whatever this one has: int8 activations take the kernels' integer dot products at every
    step size, and prompts attend in fp32."""
    monkeypatch.setattr(config, "cpu_has_amx", lambda: False)
    ops = native_ops()
    amx = ops is not None and ops.kernel_isa() == "amx"
    if amx:
        ops.set_kernel_isa("avx512_vnni")
    yield
    if amx:
        ops.set_kernel_isa("amx")


def test_kernel_rows_by_activations():
    """fp32 activations: the kernels up to 16 rows, a GEMM over tiles past them. int8 activations: the kernels at any
    row count (on AMX, steps of 32 rows or more in bf16 tiles of their own)."""
    layer = Linear(64, 32, bias=False)
    assert layer.kernel_rows == 16
    layer.int8_activations = True
    assert layer.kernel_rows == sys.maxsize


def answered_prompt(smollm2: LLM) -> list[int]:
    """A chat prompt and the fp32 model's own 64-token greedy answer: the text the accuracy tests teacher-force."""
    prompt = smollm2.engine.tokenize(smollm2.apply_chat_template(
        [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]), add_special_tokens=False)
    return prompt + smollm2.generate(prompt, greedy(64), use_tqdm=False)[0].outputs[0].token_ids


def divergence(name: str, exact: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the KL of approx's next-token distribution to exact's; and the share of positions whose greedy
    choices agree. Printed, as `name` vs fp32."""
    logp, logq = exact.float().log_softmax(-1), approx.float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = (exact.argmax(-1) == approx.argmax(-1)).float().mean()
    print(f"{name} vs fp32: mean KL {kl.mean():.2e}, max KL {kl.max():.2e}, greedy agreement {agree:.3f}")
    return kl, agree


def test_bf16_matmuls_track_fp32_on_smollm2(smollm2, monkeypatch):
    """Teacher-forced over the fp32 model's own answer: the per-token KL and the greedy agreement bound the cost of
    bf16 tiles (a quantized weight dequantized to bf16 for a GEMM past kernel_rows; stood in for here from 64 rows,
    so that this prompt of ~100 tokens crosses it)."""
    monkeypatch.setattr(Linear, "kernel_rows", property(lambda self: 64))
    bf16 = LLM("smollm2-135m", device="cpu", matmul_dtype="bfloat16", kv_cache_memory="64MiB")
    assert bf16.engine.runner.model.layers[0].mlp.down_proj.kernel_rows == 64
    text = answered_prompt(smollm2)
    assert len(text) > 64
    kl, agree = divergence("bf16 matmuls", *(prefill_logits(llm, text) for llm in (smollm2, bf16)))
    assert kl.mean() < 2e-3 and kl.max() < 2e-2
    assert agree >= 0.95


def test_bf16_prompt_attention_tracks_fp32_on_smollm2(smollm2, monkeypatch):
    """Where the CPU has AMX (stood in for here) the prompt tokens of a GGUF model's step of more than 192 tokens
    (such steps the kernels multiply in bf16 there) attend in bf16, unless matmul_dtype is float32; shorter steps, and decode,
    keep fp32. Its cost alone, with fp32 matmuls on both sides and every step taken as long, teacher-forced over the
    fp32 model's answer (measured on a Xeon with AMX: mean KL 9.8e-5, max 8.0e-4, the same greedy choice at every one
    of 105 positions; over a 1,564-token prompt 7.1e-5, 3.7e-3 and 99.7%)."""
    monkeypatch.setattr(config, "cpu_has_amx", lambda: True)
    assert EngineConfig(device="cpu", model="smollm2-135m").bf16_prompt_attention
    assert not EngineConfig(device="cpu", model="smollm2-135m", **FP32).bf16_prompt_attention
    assert not EngineConfig(device="cpu", model="/m/hf-model-dir").bf16_prompt_attention  # bf16 matmuls at every step
    text = answered_prompt(smollm2)
    exact = prefill_logits(smollm2, text)
    backend = smollm2.engine.runner.backend
    monkeypatch.setattr(backend, "bf16_past", len(text))  # not a long step: fp32, the same numbers
    assert torch.equal(prefill_logits(smollm2, text), exact)
    monkeypatch.setattr(backend, "bf16_past", 0)
    approx = prefill_logits(smollm2, text)
    assert not torch.equal(exact, approx)  # the bf16 path ran
    kl, agree = divergence("bf16 prompt attention", exact, approx)
    assert kl.mean() < 1e-3 and kl.max() < 1e-2
    assert agree >= 0.97


def chunked_logits(llm: LLM, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits at every prompt position, computed `chunk` tokens a step through the paged cache (decode-sized steps)."""
    from kvserve.engine.scheduler import ScheduledBatch
    from kvserve.engine.sequence import Sequence

    engine, rows = llm.engine, []
    seq = Sequence("chunked", None, prompt, greedy(1), len(engine.layout.groups))
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - start)
            assert engine.kv_manager.allocate_slots(seq, n)
            inputs = engine.runner.prepare(ScheduledBatch([seq], [n]))
            rows.append(engine.runner.model.compute_logits(engine.runner.model(inputs.input_ids, inputs.ctx)))
            seq.num_computed_tokens += n
    engine.kv_manager.free(seq)
    return torch.cat(rows)


@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_int8_activations_track_fp32_on_smollm2(smollm2, chunk, no_amx):
    """The default matmul_dtype multiplies the GGUF blocks by int8-quantized activations, in steps of a few tokens
    and in a whole prompt's (1024: one step); teacher-forced over the fp32 model's answer, the KL and the greedy
    agreement bound the cost (measured on AVX-512: mean KL 5.1e-3 / 4.6e-3 / 4.6e-3, max 4.1e-2 / 4.0e-2 / 4.0e-2,
    agreement 95% / 96% / 96% for 1- / 4- / 1024-token steps, the last two equal as a row's numbers do not depend on
    its step's size; the Q4_1 weights themselves cost far more against the original model)."""
    fast = LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB")
    assert fast.engine.runner.model.describe_matmuls() == "int8 activations"
    assert smollm2.engine.runner.model.describe_matmuls() == "fp32"
    text = answered_prompt(smollm2)
    kl, agree = divergence(f"int8 activations ({chunk}-token steps)", *(chunked_logits(llm, text, chunk) for llm in (smollm2, fast)))
    assert kl.mean() < 1e-2 and kl.max() < 0.1
    assert agree >= 0.95


def test_rms_norm_under_bf16_autocast_normalizes_in_the_inputs_dtype():
    """Training a feature draft under bf16 autocast hands the norm bf16 rows: no dtype-mismatch fallback (torch
    warns), and the result is the fp32 norm's to bf16 rounding."""
    import warnings

    from kvserve.layers.norm import RMSNorm

    torch.manual_seed(0)
    norm, linear = RMSNorm(64, 1e-5), torch.nn.Linear(32, 64)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(linear(x))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), norm(linear(x)), atol=0.05, rtol=0.02)


def assert_same_alone_and_batched(llm: LLM, prompts: list, params) -> list:
    """Each prompt's tokens and logprobs generated alone equal those generated beside the others; the batch's outputs."""
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    for a, b in zip(alone, together):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    return together


def test_a_request_decodes_the_same_alone_and_batched(no_amx):
    """int8 activations at every step size: a row's numbers never depend on the rows beside it, so a prompt gets the
    same tokens and logprobs alone as batched. Alone, the short prompt's prefill is a step of a few rows and the long
    one's of ~70; batched, ~80 (before, past 64 rows a GEMM of bf16 or fp32 tiles took the step, and four chat
    prompts' first logprobs moved by up to 0.16, one answer from its first token)."""
    llm = LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB")
    prompts = ["The capital of France is", "Once upon a time, in a village between two rivers, there lived " * 5]
    params = greedy(24, logprobs=0)
    together = assert_same_alone_and_batched(llm, prompts, params)
    assert 64 < sum(len(out.prompt_token_ids) for out in together) < 2 * 64


def test_batch_invariant_prompts_compute_the_same_however_they_are_chunked():
    """batch_invariant: a prompt's tokens attend as decode queries (the decode kernel's arithmetic, which depends on
    each query's context alone), so a prompt's logits are bit for bit the same in one step, in chunks of any size,
    and one token a step, and a request's output the same alone or beside another that splits its prompt's chunks
    differently. Without it, SDPA's blocking made chunks of 5, 33 or 60 of a 65-token prompt differ, and such a
    prompt answer differently alone (a 64-token chunk, then one) and batched. On a CPU with AMX its kernels keep int8
    rows where a plain engine's steps of 32 rows or more multiply in bf16 on the tiles."""
    llm = LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=64, batch_invariant=True)
    assert llm.engine.runner.backend.batch_invariant
    prompt = llm.engine.tokenize("Once upon a time, in a village between two rivers, there lived " * 6, add_special_tokens=False)[:65]
    whole = chunked_logits(llm, prompt, 1024)
    for chunk in (1, 5, 33, 60):
        assert torch.equal(chunked_logits(llm, prompt, chunk), whole), chunk
    prompts, params = [prompt[30:60], prompt], greedy(24, logprobs=0)
    assert_same_alone_and_batched(llm, prompts, params)


def test_prompt_chunks_compute_the_same_however_they_are_chunked(no_amx):
    """Without batch_invariant too, a prompt's logits are bit for bit the same in one step and in chunks of 5, 33 or
    60 tokens: the native prompt attention sums each query's keys 16 at a time from key 0 in its own online softmax,
    whatever rows share its tile, and with int8 activations no matmul's row depends on its step's size (SDPA's
    blocking made such chunks differ)."""
    llm = LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB", enable_prefix_caching=False)
    assert not llm.engine.config.batch_invariant
    prompt = llm.engine.tokenize("Once upon a time, in a village between two rivers, there lived " * 6, add_special_tokens=False)[:65]
    whole = chunked_logits(llm, prompt, 1024)
    for chunk in (5, 33, 60):
        assert torch.equal(chunked_logits(llm, prompt, chunk), whole), chunk


def test_a_prompt_never_leaves_one_token_to_compute_alone(no_amx):
    """81 tokens with 80 cached, or split 80 + 1 or 16 x 5 + 1 by the step's budget, left one token: a decode query
    with the decode kernel's arithmetic, which int8 activations amplified (the first logprob -0.8246, fresh in one
    step -0.7886). A prefix hit now leaves two tokens or more, and a chunk never leaves a single one behind."""
    def logprobs(llm: LLM, prompt: list[int]) -> list[tuple[int, float]]:
        return [(t.token_id, t.logprob) for t in llm.generate([prompt], greedy(8, logprobs=1), use_tqdm=False)[0].outputs[0].logprobs]

    llm = LLM("smollm2-135m", num_blocks=64)
    prompt = llm.engine.tokenize("Once upon a time " * 20)[:81]
    fresh = logprobs(llm, prompt)
    assert logprobs(llm, prompt) == fresh and llm.engine.scheduler.stats.prefix_hits == 64
    for budget in (80, 16):
        assert logprobs(LLM("smollm2-135m", num_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=budget), prompt) == fresh


def test_batch_invariant_needs_the_stacked_int8_kernels_no_kv_policy_and_no_kivi2():
    with pytest.raises(KVServeError, match="batch_invariant needs a GGUF model's layers stacked on the native CPU kernels"):
        LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB", batch_invariant=True, **FP32)
    with pytest.raises(KVServeError, match="kv_policy h2o cannot run with batch_invariant"):
        LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB", batch_invariant=True, kv_policy="h2o:budget=0.5")
    with pytest.raises(KVServeError, match="batch_invariant cannot run with a kivi2 cache"):  # its tokens were packed per step
        LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB", batch_invariant=True, cache_type_k="kivi2")
    # a CPU with AMX multiplies a plain engine's steps of 32 rows or more in bf16 on its tiles: batch_invariant keeps int8 rows
    plain = LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB").engine.runner
    assert plain.backend.batch_invariant == (native_ops().kernel_isa() != "amx")


def test_batch_invariant_with_speculative_decoding_keeps_the_tokens():
    """A draft only guesses, so its runner needs no batch_invariant; the target's tokens stay the plain engine's."""
    params = greedy(24)
    plain = LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB", batch_invariant=True).generate(["The capital of France is"], params,
                                                                                                    use_tqdm=False)
    spec = LLM("smollm2-135m", device="cpu", kv_cache_memory="64MiB", batch_invariant=True,
               speculative="self:layers=10,min_acceptance=0,min_speedup=0")
    out = spec.generate(["The capital of France is"], params, use_tqdm=False)[0]
    assert not spec.engine.proposer.runner.config.batch_invariant and out.metrics.num_draft_tokens > 0
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_batch_invariant_verifies_many_guesses_as_one_token_steps():
    """Four copying prompts guessing up to 10 tokens each make verifying steps of up to 44 rows, which a CPU with AMX
    multiplied in bf16 on its tiles: greedy tokens kept, logprobs not. batch_invariant keeps them on int8 rows."""
    text = "The quick brown fox jumps over the lazy dog near the river bank while the farmer watches from his old house. "
    prompts, params = [f"Repeat this paragraph {i} times exactly: " + text * 3 for i in range(4)], greedy(48, logprobs=0)
    plain = LLM("smollm2-135m", kv_cache_memory="64MiB", batch_invariant=True).generate(prompts, params, use_tqdm=False)
    spec = LLM("smollm2-135m", kv_cache_memory="64MiB", batch_invariant=True, speculative="ngram:k=10,min_acceptance=0,min_speedup=0")
    out = spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.scheduler.stats.num_accepted_tokens > 4 * 24
    assert [[lp.logprob for lp in o.outputs[0].logprobs] for o in out] == [[lp.logprob for lp in o.outputs[0].logprobs] for o in plain]
