"""CUDA decode steps: ms per step with SDPA over gathered blocks, the in-place kernel op by op, its CUDA graphs,
the graphs without the split over keys (flash-decoding), and the graphs with torch's RoPE and SiLU-and-mul instead
of the Triton ones (--no-native-kernels), at each batch size and context length. Every column runs in this process
on the same model; the ratios are graphs against SDPA, the split against none and the Triton ops against torch's.

    python bench/cuda_decode.py [--model smollm2-135m] [--batches 1 8 64] [--contexts 200 2000 6000] [--steps 30]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import cuda

MODES = ("sdpa", "op by op", "graphs", "graphs, not split", "graphs, torch ops")


def step_ms(model: str, mode: str, batch: int, context: int, steps: int) -> tuple[float, list[list[int]]]:
    """ms per decode step once `batch` prompts of `context` tokens are in, and the tokens the steps gave."""
    split = cuda.SPLIT_KEYS
    cuda.SPLIT_KEYS = 10**9 if mode == "graphs, not split" else split  # before the engine: its graphs read it too
    try:
        blocks = batch * -(-(context + steps + 16) // 16)  # every sequence's whole context: no preemption
        llm = LLM(model, device="cuda", max_num_seqs=batch, enable_prefix_caching=False, num_blocks=blocks, block_size=16,
                  enforce_eager=not mode.startswith("graphs"), native_kernels=mode != "graphs, torch ops")
        engine = llm.engine
        if mode == "sdpa":
            engine.runner.backend = engine.runner.sdpa
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request([1 + (i * 7 + j) % 1000 for j in range(context)], params)
        engine.step()
        while engine.last_step.prefill_tokens:
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / steps * 1e3
        return ms, [s.token_ids[context:] for s in engine.scheduler.running]
    finally:
        cuda.SPLIT_KEYS = split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[200, 2000, 6000])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/cuda_decode.py: torch sees no CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, {args.model}, ms per decode step ({args.steps} steps)")
    print(f"{'batch':>5} {'keys':>6} " + " ".join(f"{m:>18}" for m in MODES) + "   graphs/sdpa  split/not  triton/torch ops  same tokens")
    for batch in args.batches:
        for context in args.contexts:
            runs = {mode: step_ms(args.model, mode, batch, context, args.steps) for mode in MODES}
            ms = {mode: r[0] for mode, r in runs.items()}
            same = all(r[1] == runs["sdpa"][1] for r in runs.values())
            print(f"{batch:5d} {context:6d} " + " ".join(f"{ms[m]:15.2f} ms" for m in MODES)
                  + f"   {ms['sdpa'] / ms['graphs']:10.2f}x {ms['graphs, not split'] / ms['graphs']:9.2f}x "
                  f"{ms['graphs, torch ops'] / ms['graphs']:16.2f}x  {same}", flush=True)


if __name__ == "__main__":
    main()
