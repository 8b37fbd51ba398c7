"""How alike adjacent layers' K and V are, per token and KV head: MiniCache's premise (kv_policy minicache merges
pairs whose directions are close). Prints, for each pair of layers, the mean cosine of their K and of their V and
the share of token-heads further apart than an angular distance (over pi), on a prompt of Python's documentation.

    python bench/layer_similarity.py [--model smollm2-135m] [--tokens 1000] [--threshold 0.25]
"""
from __future__ import annotations

import argparse
import math

import torch

from kvserve import LLM, SamplingParams
from kvserve.eval.text import load_text


def capture(llm: LLM, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V [tokens, kv heads, dim] for one prefill of `tokens` tokens."""
    cache, written = llm.engine.runner.kv_cache, []
    write = cache.write

    def recording(j, k, v, slots):
        written.append((k.float().clone(), v.float().clone()))
        write(j, k, v, slots)

    cache.write = recording
    ids = llm.engine.tokenize(load_text(None))[:tokens]
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    cache.write = write
    return written[:llm.engine.layout.num_layers]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--threshold", type=float, default=0.25)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_batched_tokens=args.tokens, enable_prefix_caching=False, matmul_dtype="float32")
    layers = capture(llm, args.tokens)
    print(f"{args.model}, {layers[0][0].shape[0]} tokens: adjacent layers' cosine per token and KV head, "
          f"and the share further apart than {args.threshold} x pi")
    print(f"{'layers':>8} {'K cos':>7} {'K far':>6} {'V cos':>7} {'V far':>6}")
    for i in range(1, len(layers)):
        cells = []
        for which in (0, 1):
            cos = torch.nn.functional.cosine_similarity(layers[i - 1][which], layers[i][which], dim=-1)
            far = (torch.arccos(cos.clamp(-1, 1)) / math.pi > args.threshold).float().mean()
            cells += [f"{cos.mean():7.3f}", f"{far:6.0%}"]
        print(f"{i - 1:>3}-{i:<4} {' '.join(cells)}")


if __name__ == "__main__":
    main()
