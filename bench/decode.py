"""Batch-1 decode speed: kvserve with its KV cache, kvserve recomputing everything (no_cache), transformers.

kvserve runs twice with the cache: with its native kernels (the default: decode reads a GGUF file's own
4/8-bit blocks and the paged KV in place) and as plain torch (`native_kernels=False`: fp32 copies of the
same weights, the ones transformers reads).

All three run in this process on the same weights (transformers loads kvserve's converted copy of the
GGUF), so the ratios printed at the end are measured under the same machine load. The roofline lines divide
kvserve's ms per token (after the prompt, and after --long-context tokens) by the time it takes to read the
model file's bytes once (`torch.ones(n // 4).sum()`), timed just before and after that decode: decode reads every
weight once a token, so 1.0 is the memory limit (llama.cpp reaches ~2.3 on a 2-core AVX2 EPYC; issue 16's target is
1.5). Beside each, the median step's overhead: its wall time minus the time inside the matmul and attention kernels.
A step reads its context's K and V too (46 MB at 2,000 tokens, half the weights), and a set of bytes that outgrows
the CPU's cache reads slower, so a second line divides by the time to read the weights and that KV together, with
the attention kernel's share of the step.

    python bench/decode.py [--model smollm2-135m] [--prompt-len 128] [--new-tokens 128] [--long-context 2000]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kernels import cpu_description, native_ops
from kvserve.models.loader import transformers_model
from kvserve.models.registry import resolve_model_path

DEVICE = EngineConfig().torch_device  # kvserve's default device: transformers runs on the same one
LLAMA_CPP_2K = 35  # llama.cpp's SmolLM2 Q4_1 decode at 2,000 tokens of context, tok/s, as quoted in issue 16


@dataclass
class Decode:
    tokens_per_s: float
    step_times: list[float]  # each step's wall time, by position in the output
    overheads: list[float]  # the part of each spent outside the memory-bound kernels (quantized matmuls, attention)
    attention: list[float]  # the part of each spent in decode attention


def kvserve_decode(llm: LLM, prompt: list[int], new_tokens: int) -> Decode:
    """Decode `new_tokens` greedily after `prompt`; the kernels' times are 0 without them."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ops = native_ops() if llm.engine.runner.native else None
    kernel_seconds = (lambda: (ops.kernel_seconds(), ops.attention_seconds())) if ops is not None else lambda: (0.0, 0.0)
    decode, last = Decode(0.0, [], [], []), None
    for out in llm.stream(prompt, params):
        now, (kernels, attention) = time.perf_counter(), kernel_seconds()
        if last is not None:
            decode.step_times.append(now - last[0])
            decode.overheads.append(now - last[0] - (kernels - last[1]))
            decode.attention.append(attention - last[2])
        last = now, kernels, attention
    decode.tokens_per_s = out.metrics.decode_tokens_per_s
    return decode


@dataclass
class Cached:
    tokens_per_s: float
    overhead: float  # the median step's, seconds
    attention: float  # the median step's time in decode attention, seconds
    kv_bytes: int  # the KV a step reads, halfway through the decode
    read: float  # ms to read the weights once
    read_with_kv: float  # ms to read the weights and kv_bytes more once


def _cached_decode(model: str, prompts: list[list[int]], new_tokens: int, native_kernels: bool, nbytes: int) -> tuple[str, list[Cached]]:
    """The KV cache's dtype, and each prompt's decode. The reads are timed just before and just after each decode
    (the mean of the two): memory bandwidth on a shared machine drifts within seconds, so a read timed elsewhere in
    the run can be far from the one the decode had."""
    llm = LLM(model, native_kernels=native_kernels)
    kvserve_decode(llm, prompts[0], 8)  # warm-up
    results = []
    for p in prompts:
        kv = int(llm.engine.layout.bytes_held(len(p) + new_tokens // 2))
        before = read_ms(nbytes), read_ms(nbytes + kv)
        d = kvserve_decode(llm, p, new_tokens)
        results.append(Cached(d.tokens_per_s, statistics.median(d.overheads), statistics.median(d.attention), kv,
                              (before[0] + read_ms(nbytes)) / 2, (before[1] + read_ms(nbytes + kv)) / 2))
    return llm.engine.layout.dtype_name, results


def read_ms(nbytes: int) -> float:
    """Milliseconds to read `nbytes` of memory once (median of 20 sums of a float tensor that size)."""
    x = torch.ones(nbytes // 4)
    times = []
    for _ in range(21):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000


def weight_bytes(path) -> int:
    """The model file's bytes (a directory: its safetensors)."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))


def transformers_decode(path, prompt: list[int], new_tokens: int) -> float:
    model = transformers_model(path).to(DEVICE).eval()
    ids = torch.tensor([prompt], device=DEVICE)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return (new_tokens - 1) / (total - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-context", type=int, default=2000,
                        help="also decode after a prompt this long (kvserve, cached; 0: skip)")
    args = parser.parse_args()
    if args.prompt_len < 1 or args.new_tokens < 2 or args.long_context < 0:
        parser.error("--prompt-len must be >= 1, --new-tokens >= 2 and --long-context >= 0")
    prompts = [[1000 + (i * 37) % 20000 for i in range(n)] for n in (args.prompt_len, args.long_context) if n]

    path = resolve_model_path(args.model)
    nbytes = weight_bytes(path)
    (kv, cached), (_, (plain,)) = (_cached_decode(args.model, prompts, args.new_tokens, True, nbytes),
                                   _cached_decode(args.model, prompts[:1], args.new_tokens, False, nbytes))
    with_cache, fp32_weights = cached[0].tokens_per_s, plain.tokens_per_s
    recompute = LLM(args.model, use_kv_cache=False, max_num_batched_tokens=args.prompt_len + args.new_tokens)
    recomputed = kvserve_decode(recompute, prompts[0], args.new_tokens)
    no_cache, steps = recomputed.tokens_per_s, recomputed.step_times
    del recompute
    hf = transformers_decode(path, prompts[0], args.new_tokens)

    print(f"\nbatch-1 decode, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, {DEVICE}, "
          f"KV cache {kv}")
    print(f"CPU: {cpu_description()}")
    print(f"  kvserve (KV cache)      {with_cache:8.1f} tok/s")
    print(f"  kvserve (plain torch)   {fp32_weights:8.1f} tok/s")
    print(f"  kvserve (no_cache)      {no_cache:8.1f} tok/s")
    print(f"  transformers generate   {hf:8.1f} tok/s")
    print("no_cache step time by output position (the whole sequence is recomputed each step; median of 5 steps):")
    for pos in (16, 64, 128):  # steps[i] is the gap before output token i + 2
        window = steps[max(0, pos - 6):pos - 1]
        if window:
            print(f"  position {pos:4d}: {statistics.median(window) * 1000:7.1f} ms")
    print(f"ratio kvserve cache / transformers: {with_cache / hf:.2f}x")
    print(f"ratio kvserve cache / no_cache:     {with_cache / no_cache:.2f}x")
    print(f"ratio native kernels / plain torch: {with_cache / fp32_weights:.2f}x")
    for context, c in zip((args.prompt_len, args.long_context), cached):
        ms = 1000 / c.tokens_per_s
        print(f"roofline at {context:5d} tokens of context: {ms:6.2f} ms/token ({c.tokens_per_s:5.1f} tok/s) = "
              f"{ms / c.read:.2f}x the weight read (reading the model's {nbytes / 1e6:.0f} MB once: {c.read:.2f} ms, "
              f"timed around this decode; target <= 1.5); per-step overhead outside the kernels {c.overhead * 1000:.2f} ms (target < 1.5)")
        print(f"  with its KV ({c.kv_bytes / 1e6:.0f} MB halfway, {kv}): {ms / c.read_with_kv:.2f}x reading the weights and the KV once "
              f"({(nbytes + c.kv_bytes) / 1e6:.0f} MB: {c.read_with_kv:.2f} ms); decode attention {c.attention * 1000:.2f} ms of the step")
    if args.model == "smollm2-135m" and args.long_context == 2000:  # the context llama.cpp's figure was measured at
        long_rate = cached[1].tokens_per_s
        print(f"at {args.long_context} tokens: {long_rate:.1f} tok/s beside llama.cpp's {LLAMA_CPP_2K} tok/s quoted in issue 16 "
              f"(a 2-core AVX2 EPYC, not this machine): {long_rate / LLAMA_CPP_2K:.2f}x")


if __name__ == "__main__":
    main()
