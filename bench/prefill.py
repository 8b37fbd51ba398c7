"""Prefill speed: kvserve against transformers (fp32) on the same prompt lengths, in this one run.

kvserve prefills a prompt of N tokens and samples one token (max_tokens=1: its time to first token, with the
prefix cache off and the engine's default 512 tokens a step, so 2,048 tokens take 4 chunks); transformers runs
one forward pass over the N tokens and takes the last logits. Each figure is the median of --rounds runs,
the two engines taking turns.

    python bench/prefill.py [--model smollm2-135m] [--lengths 128,512,2048] [--rounds 5] [--batch-invariant]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kernels import cpu_description
from kvserve.models.loader import transformers_model
from kvserve.models.registry import resolve_model_path

DEVICE = EngineConfig().torch_device


def kvserve_prefill(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def transformers_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device=DEVICE)
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, logits_to_keep=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--matmul-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="kvserve's")
    parser.add_argument("--batch-invariant", action="store_true", help="kvserve's prompt tokens attend as decode queries")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(args.model, enable_prefix_caching=False, matmul_dtype=args.matmul_dtype, batch_invariant=args.batch_invariant)
    hf = transformers_model(resolve_model_path(args.model)).to(DEVICE).eval()
    prompts = {n: [1000 + (i * 37) % 20000 for i in range(n)] for n in lengths}
    kvserve_prefill(llm, prompts[lengths[0]]), transformers_prefill(hf, prompts[lengths[0]])  # warm-up
    print(f"\nprefill, {torch.get_num_threads()} threads, {DEVICE}; kvserve matmuls in "
          f"{llm.engine.runner.model.describe_matmuls()}{', batch-invariant' if args.batch_invariant else ''}, transformers in fp32; "
          f"median of {args.rounds}")
    print(f"CPU: {cpu_description()}")
    for n in lengths:
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(kvserve_prefill(llm, prompts[n]))
            theirs.append(transformers_prefill(hf, prompts[n]))
        a, b = n / statistics.median(ours), n / statistics.median(theirs)
        print(f"  {n:5d} tokens: kvserve {a:7.1f} tok/s, transformers {b:7.1f} tok/s, ratio {a / b:.2f}x (target >= 1.0)")


if __name__ == "__main__":
    main()
