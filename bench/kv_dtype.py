"""What each KV cache dtype buys: tokens the pool holds, batch-1 decode speed at a long context, and a run
where the pool, not compute, limits how many requests run at once.

For each dtype, in this process (ratios are against float32 KV measured in the same run):
  1. tokens a 1 GiB pool holds (kivi2: packed blocks plus its float residual reserve), and bytes per token;
  2. batch-1 decode tok/s after a --context-token prompt (the cache read every step is context x bytes/token);
  3. the KV-bound run: --requests distinct prompts of --prompt-len tokens, --new-tokens each, in a pool of
     --pool (float32 fits a few at a time): output tok/s, decode-only tok/s (steps without prefill) and the
     most requests running at once.

    python bench/kv_dtype.py [--dtypes float32,int8,int4,kivi2] [--context 2000] [--requests 32] [--prompt-len 2000]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import LLM, SamplingParams


def pool_tokens(model: str, dtype: str) -> tuple[int, float]:
    engine = LLM(model, kv_cache_dtype=dtype, kv_cache_memory="1GiB").engine
    usage, bs = engine.kv_usage(), engine.config.block_size
    return (usage["num_blocks"] + usage.get("residual_blocks", 0)) * bs, engine.layout.bytes_per_token


def decode_at_context(model: str, dtypes: list[str], prompt: list[int], new_tokens: int, rounds: int) -> dict[str, float]:
    """Median decode tok/s per dtype over `rounds` runs taken in turn, so that machine noise hits every dtype alike."""
    llms = {d: LLM(model, kv_cache_dtype=d, kv_cache_memory="256MiB", enable_prefix_caching=False) for d in dtypes}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    runs: dict[str, list[float]] = {d: [] for d in dtypes}
    for llm in llms.values():
        llm.generate(prompt[:64], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    for _ in range(rounds):
        for d, llm in llms.items():
            runs[d].append(llm.generate(prompt, params, use_tqdm=False)[0].metrics.decode_tokens_per_s)
    return {d: statistics.median(r) for d, r in runs.items()}


def kv_bound_run(model: str, dtype: str, prompts: list[list[int]], new_tokens: int, pool: str) -> dict:
    engine = LLM(model, kv_cache_dtype=dtype, kv_cache_memory=pool, enable_prefix_caching=False, max_num_seqs=len(prompts)).engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    generated = most_running = 0
    decode_tokens, decode_seconds = 0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        generated += len(engine.step())
        most_running = max(most_running, len(engine.scheduler.running))
        if engine.last_step.prefill_tokens == 0:
            decode_tokens, decode_seconds = decode_tokens + engine.last_step.decode_tokens, decode_seconds + engine.last_step.seconds
    seconds = time.perf_counter() - start
    return {"tok_s": generated / seconds, "decode_tok_s": decode_tokens / max(decode_seconds, 1e-9), "most_running": most_running,
            "preemptions": engine.scheduler.stats.num_preemptions, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,int8,int4,kivi2")
    parser.add_argument("--context", type=int, default=2000, help="prompt tokens before the batch-1 decode")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="batch-1 decode runs per dtype (median)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pool", default="512MiB", help="KV pool of the KV-bound run")
    parser.add_argument("--skip-bound-run", action="store_true")
    parser.add_argument("--skip-decode", action="store_true", help="only the pool sizes and the KV-bound run")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "float32":
        parser.error(f"--dtypes must start with float32 (the baseline the ratios divide by), got {args.dtypes!r}")
    vocab = LLM(args.model, num_blocks=1).engine.checkpoint.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (args.context,), generator=g).tolist()
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]

    decode = {d: float("nan") for d in dtypes} if args.skip_decode else \
        decode_at_context(args.model, dtypes, prompt, args.decode_tokens, args.rounds)
    rows = {}
    for dtype in dtypes:
        tokens, per_token = pool_tokens(args.model, dtype)
        rows[dtype] = {"pool_tokens": tokens, "bytes_per_token": per_token, "decode_tok_s": decode[dtype]}
        if not args.skip_bound_run:
            rows[dtype]["bound"] = kv_bound_run(args.model, dtype, prompts, args.new_tokens, args.pool)
        print(dtype, rows[dtype], flush=True)

    base = rows["float32"]
    print(f"\nCPU threads {torch.get_num_threads()}; pool tokens at 1 GiB, batch-1 decode at {args.context} tokens of context"
          + ("" if args.skip_bound_run else f"; KV-bound run: {args.requests} x {args.prompt_len}-token prompts, "
             f"{args.new_tokens} new tokens, {args.pool} pool"))
    for dtype, r in rows.items():
        line = (f"{dtype:>9}: {r['bytes_per_token']:7,.0f} B/token ({base['bytes_per_token'] / r['bytes_per_token']:5.2f}x fewer), "
                f"pool {r['pool_tokens']:8,} tokens ({r['pool_tokens'] / base['pool_tokens']:5.2f}x) | "
                f"decode@{args.context} {r['decode_tok_s']:6.1f} tok/s ({r['decode_tok_s'] / base['decode_tok_s']:4.2f}x)")
        if "bound" in r:
            b, bb = r["bound"], base["bound"]
            line += (f" | bound run {b['tok_s']:6.1f} tok/s ({b['tok_s'] / bb['tok_s']:4.2f}x), decode-only "
                     f"{b['decode_tok_s']:6.1f} tok/s ({b['decode_tok_s'] / bb['decode_tok_s']:4.2f}x), "
                     f"up to {b['most_running']} at once, {b['preemptions']} preemptions")
        print(line)


if __name__ == "__main__":
    main()
