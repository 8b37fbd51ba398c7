"""Shared fixtures: tiny random Llama models built with transformers, and the real SmolLM2."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve import LLM
from kvserve.kernels import native_ops

# `make test` runs a worker a core (pytest-xdist): more threads than cores would leave OpenMP's threads spinning
# at their barriers for a core the other worker holds (2 workers x 2 threads on 2 cores: no faster than 1 process).
# The processes a test starts (a server's engine process, the CLI) take the worker's share too: with two threads of
# its own beside the other worker, a server test's 32 streams took 29 s where they take 9 with one.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, torch.get_num_threads() // workers))
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())

if not torch.cuda.is_available():  # the CUDA backend's Triton kernels run (slowly, exactly) on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

ALL_ISAS = ["avx2", "avx512_vnni", "amx"]  # each one's CPUs run those before it
ISAS = ALL_ISAS[:ALL_ISAS.index(native_ops().kernel_isa() if native_ops() is not None else "avx2") + 1]


@pytest.fixture(params=ISAS)
def isa(request):
    """Each kernel instruction set this CPU runs (the lesser ones forced)."""
    before = native_ops().kernel_isa()
    native_ops().set_kernel_isa(request.param)
    yield request.param
    native_ops().set_kernel_isa(before)


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
# Tests that compare outputs across batch shapes, chunkings or implementations run fp32 matmuls: bf16 ones
# (matmul_dtype "auto" on CPUs with AVX512-BF16) round differently per kernel; tests/test_linear.py bounds that.
FP32 = dict(matmul_dtype="float32")


def save_tiny_llama(path, **overrides):
    """A random transformers Llama saved as config.json + safetensors; returns the transformers model."""
    return save_tiny(path, "llama", **overrides)


def save_tiny(path, arch: str, **overrides):
    """A random transformers model of an architecture ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "deepseek_v3")
    saved as config.json + safetensors; returns the transformers model."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma3",
             "deepseek_v3": "DeepseekV3"}
    config_class = getattr(transformers, names[arch] + ("TextConfig" if arch == "gemma3_text" else "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, names[arch] + "ForCausalLM")(config_class(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # random init leaves norms at 1 (Gemma's at 0) and biases at 0; perturb them so neither can be wrong
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir_d32(tmp_path_factory):
    """head_dim 32: quantized KV formats scale groups of 32 values."""
    path = tmp_path_factory.mktemp("tiny-llama-d32")
    save_tiny_llama(path, head_dim=32)
    return path


@pytest.fixture(scope="session")
def tiny_sliding_dir(tmp_path_factory):
    """A Qwen2 whose second layer slides over 6 tokens: one full and one sliding KV group (head_dim 32)."""
    path = tmp_path_factory.mktemp("tiny-sliding")
    save_tiny(path, "qwen2", head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    return path


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    return LLM("smollm2-135m", **FP32)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own reading of the SmolLM2 GGUF (dequantized to fp32): the reference model."""
    from kvserve.models.loader import transformers_model
    from kvserve.models.registry import resolve_model_path

    return transformers_model(resolve_model_path("smollm2-135m")).eval()


def greedy(max_tokens: int | None, **kw):
    from kvserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)



def parted_at_near_ties(reference: list, outputs: list, margin: float) -> int:
    """How many outputs part from their reference's greedy tokens (completions asked with logprobs=2), each only
    where the reference's top two were within `margin` nats (a near-tie a rounding can flip)."""
    parted = 0
    for a, b in zip(reference, outputs):
        at = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if at is not None:
            first, second = sorted(a.logprobs[at].top.values(), reverse=True)[:2]
            assert first - second < margin, f"parted at token {at} without a near-tie ({first:.3f} vs {second:.3f})"
            parted += 1
    return parted


def assert_fused_paths_agree(llm: LLM, prompts: list, params, tolerance: float) -> None:
    """The same requests with the decode steps as one native call for the whole step (embedding to logits), as one
    for the layer stack, as fused native ops per layer, and as modules (the engine put back as it was after each):
    the first three give the same numbers (the same calls, from C++ instead of Python), the modules the same tokens
    and logprobs within `tolerance`."""
    layers, backend = llm.engine.runner.model.layers, llm.engine.runner.backend
    assert all(layer.fused is not None for layer in layers) and layers[0].fused_rows > 1 and backend.stack is not None
    assert backend.decode_rows > 1
    whole = llm.generate(prompts, params, use_tqdm=False)
    backend.decode_rows, decode_rows = 0, backend.decode_rows
    stacked = llm.generate(prompts, params, use_tqdm=False)
    stack, backend.stack = backend.stack, None
    fused = llm.generate(prompts, params, use_tqdm=False)
    rows = [layer.fused_rows for layer in layers]
    for layer in layers:
        layer.fused_rows = 0
    modules = llm.generate(prompts, params, use_tqdm=False)
    for layer, n in zip(layers, rows):
        layer.fused_rows = n
    backend.stack, backend.decode_rows = stack, decode_rows
    for w, a, b, c in zip(whole, stacked, fused, modules):
        assert w.outputs[0].token_ids == a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        for v, x, y, z in zip(w.outputs[0].logprobs, a.outputs[0].logprobs, b.outputs[0].logprobs, c.outputs[0].logprobs):
            assert v.logprob == x.logprob == y.logprob and list(v.top) == list(x.top) == list(y.top)
            assert x.logprob == pytest.approx(z.logprob, abs=tolerance) and list(x.top) == list(z.top)
