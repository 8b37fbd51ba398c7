"""Sliding-window KV: the bytes a Gemma 3 request holds in the pool per token of context, against the same model
shape with every layer global (the planner's figure, which a pool of full layers holds), and batch-1 decode
speed at each context. Prompts are synthetic token ids; the pool's figure is read while the request decodes.

    python bench/sliding_window.py [--model gemma3-270m] [--contexts 1024 8192 32000] [--new-tokens 16]
"""
from __future__ import annotations

import argparse
import time

from kvserve import LLM, SamplingParams


def held_while_decoding(llm: LLM, context: int, new_tokens: int) -> tuple[int, float]:
    """Pool bytes held by one request once its prompt is in, and its decode tokens/s."""
    engine, held = llm.engine, 0
    engine.add_request([1000 + i % 200_000 for i in range(context)], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    decode_start = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if decode_start is None and any(o.outputs[0].token_ids for o in outputs):
            decode_start = time.perf_counter()  # the prefill's step sampled the first token
            held = engine.kv_manager.pool.num_used * engine.layout.block_bytes()
    return held, (new_tokens - 1) / (time.perf_counter() - decode_start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32000])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory="2GiB", enable_prefix_caching=False)
    layout = llm.engine.layout
    print(layout.describe())
    print(f"{'context':>8} {'pool B/token':>13} {'planner B/token':>16} {'all-global B/token':>19} {'ratio':>6} {'decode tok/s':>13}")
    for context in args.contexts:
        held, tok_s = held_while_decoding(llm, context, args.new_tokens)
        print(f"{context:>8} {held / context:>13,.0f} {layout.bytes_held(context) / context:>16,.0f} "
              f"{layout.bytes_per_token:>19,.0f} {layout.bytes_per_token * context / held:>5.1f}x {tok_s:>13.1f}")


if __name__ == "__main__":
    main()
