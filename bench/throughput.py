"""Offline throughput: kvserve continuous batching vs kvserve static batching vs transformers' padded batch.

64 requests with prompt lengths drawn from 32-512 tokens, 128 new tokens each (greedy, ignore_eos), all
submitted at once, after a short warm-up run. Prints output tokens/s, p50/p99 time to first token and the share
of allocated KV slots that held no token (averaged over steps), then the ratios, all measured in this one run;
last, the FLOP/s the decode-only steps' matmuls reach, against an fp32 GEMM timed here, a bf16 one where the engine
multiplies a float32 model's dense linears in bf16 (its bf16_matmuls: a CPU with native bf16, where AMX also takes a
GGUF model's steps of many rows), and an int8 one where it multiplies int8 activations (its kernels' integer dot
products of int8 activations and 4/8-bit codes, as a GGUF model's are).

kvserve multiplies a GGUF model's packed weights by int8 activations and a dense model's in bf16 where the CPU
does so natively (matmul_dtype "auto"); `--matmul-dtype float32` and `--transformers-dtype bfloat16` compare like
with like.

    python bench/throughput.py [--num-requests 64] [--min-prompt 32] [--max-prompt 512] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass

import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kernels import cpu_description
from kvserve.memory import load_spec
from kvserve.models.loader import transformers_model
from kvserve.models.registry import resolve_model_path

DEVICE = EngineConfig().torch_device  # kvserve's default device: transformers runs on the same one
WARM_UP = 4  # requests each contender runs, 4 new tokens each, before its timed run: first-call costs stay out of it


@dataclass
class Result:
    name: str
    tokens_per_s: float
    ttft: list[float]
    kv_waste: float | None
    decode_tokens_per_s: float | None = None  # over the steps that only decoded


def gemm_flops(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP/s of one n x n x n matmul on this machine in `dtype`: what its cores reach on dense math (int8: integer
    products summed in int32, torch._int_mm, as oneDNN's VNNI or AMX kernels do them on a CPU that has them)."""
    if dtype == torch.int8:
        a, b = (torch.randint(-128, 128, (n, n), dtype=dtype, device=DEVICE) for _ in range(2))
        multiply = torch._int_mm
    else:
        a, b = torch.randn(n, n, device=DEVICE).to(dtype), torch.randn(n, n, device=DEVICE).to(dtype)
        multiply = torch.mm
    multiply(a, b)
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(3):
        multiply(a, b)
    sync()
    return 3 * 2 * n**3 / (time.perf_counter() - start)


def run_kvserve(name: str, llm: LLM, prompts: list[list[int]], new_tokens: int) -> Result:
    engine = llm.engine
    llm.generate(prompts[:WARM_UP], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    outputs, allocated, held, decoded, decode_seconds = [], 0, 0, 0, 0.0
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        if not engine.last_step.prefill_tokens:
            decoded, decode_seconds = decoded + engine.last_step.decode_tokens, decode_seconds + engine.last_step.seconds
        running = engine.scheduler.running
        allocated += sum(len(s.block_tables[0]) for s in running) * engine.config.block_size
        held += sum(s.num_computed_tokens for s in running)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return Result(name, generated / seconds, [o.metrics.ttft for o in outputs], 1 - held / max(allocated, 1),
                  decoded / decode_seconds if decode_seconds else None)


def run_transformers(path, prompts: list[list[int]], new_tokens: int, batch_size: int, dtype: str) -> Result:
    model = transformers_model(path, getattr(torch, dtype)).to(DEVICE).eval()

    @torch.inference_mode()
    def generate(chunk: list[list[int]], new: int) -> int:
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=DEVICE)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=DEVICE)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        return (out.shape[1] - width) * len(chunk)

    generate(prompts[:WARM_UP], 4)
    start = time.perf_counter()
    generated = sum(generate(prompts[i:i + batch_size], new_tokens) for i in range(0, len(prompts), batch_size))
    return Result(f"transformers generate ({dtype}, padded)", generated / (time.perf_counter() - start), [], None)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="batch size of all three")
    parser.add_argument("--max-num-batched-tokens", type=int, help="kvserve's tokens per step (default: the engine's)")
    parser.add_argument("--kv-cache-memory", help="kvserve's KV pool, a size or a share of free memory (default: the engine's)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--matmul-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="kvserve's")
    parser.add_argument("--transformers-dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_requests)]

    results, runs = [], [("kvserve continuous", {}), ("kvserve static", dict(scheduler="static"))]
    if DEVICE.type == "cuda":  # the decode steps op by op too, beside their CUDA graphs
        runs.append(("kvserve continuous, eager", dict(enforce_eager=True)))
    for name, options in runs:
        llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False, matmul_dtype=args.matmul_dtype, **options)
        results.append(run_kvserve(name, llm, prompts, args.new_tokens))
        engine = llm.engine
        budget, bf16, kv, matmuls = (engine.config.max_num_batched_tokens, engine.config.bf16_matmuls, engine.layout.dtype_name,
                                     engine.runner.model.describe_matmuls())
        pool = f"{engine.kv_usage()['total_bytes'] / 2**30:.1f} GiB ({engine.config.kv_cache_memory})"
        del llm, engine
        gc.collect()  # the next contender's pool, if a share of free memory, sees this one's memory free again
    if not args.skip_transformers:
        results.append(run_transformers(resolve_model_path(args.model), prompts, args.new_tokens, args.max_num_seqs, args.transformers_dtype))

    lengths = [len(p) for p in prompts]
    print(f"\n{args.num_requests} requests, prompts {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}), "
          f"{args.new_tokens} new tokens each, batch {args.max_num_seqs}, {budget} tokens a step, {torch.get_num_threads()} threads, "
          f"{DEVICE}, "
          f"kvserve matmuls in {matmuls}, KV cache {kv}, pool {pool}")
    print(f"CPU: {cpu_description()}")
    for r in results:
        ttft = f"TTFT p50 {percentile(r.ttft, 0.5):6.1f} s  p99 {percentile(r.ttft, 0.99):6.1f} s" if r.ttft else "TTFT n/a"
        waste = f"KV waste {r.kv_waste * 100:5.1f}%" if r.kv_waste is not None else ""
        print(f"  {r.name:40s} {r.tokens_per_s:8.1f} output tok/s   {ttft}   {waste}")
    continuous, by_name = results[0].tokens_per_s, {r.name: r.tokens_per_s for r in results}
    print(f"ratio continuous / static:       {continuous / results[1].tokens_per_s:.2f}x")
    if "kvserve continuous, eager" in by_name:
        print(f"ratio CUDA graphs / eager:       {continuous / by_name['kvserve continuous, eager']:.2f}x")
    if not args.skip_transformers:
        print(f"ratio continuous / transformers: {continuous / results[-1].tokens_per_s:.2f}x")
    if results[0].decode_tokens_per_s is None:  # every step prefilled too (--new-tokens 1)
        return
    flops = 2 * load_spec(args.model).num_params() * results[0].decode_tokens_per_s  # the matmuls; attention left out
    peaks = ({"fp32": gemm_flops(torch.float32)} | ({"bf16": gemm_flops(torch.bfloat16)} if bf16 else {})
             | ({"int8": gemm_flops(torch.int8)} if matmuls == "int8 activations" else {}))
    print(f"continuous decode-only steps: {results[0].decode_tokens_per_s:.1f} tok/s = {flops / 1e9:.0f} GFLOP/s of matmuls, "
          + ", ".join(f"{flops / peak:.0%} of this machine's {name} GEMM ({peak / 1e9:.0f} GFLOP/s, 2048^3)" for name, peak in peaks.items()))


if __name__ == "__main__":
    main()
