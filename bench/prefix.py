"""Prefix caching: a ~2,000-token shared system prompt, then short questions, one at a time.

Cold: prefix caching off, so every question prefills the whole prompt. Warm: prefix caching on, after one
request has filled the cache. KV tiers: the prompt's blocks come back from a tier instead, after the pool evicted
them (a CPU tier; a pool of --small-pool holds one prompt, and another prompt evicts it) and after a restart (a
disk tier: a new engine on the directory the first one wrote; the files may still be in the OS's page cache).
Prints mean TTFT of each and their ratios, measured in this one run.

    python bench/prefix.py [--system-tokens 2000] [--questions 20] [--cold-questions 20] [--tier-questions 5]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from kvserve import LLM, SamplingParams

QUESTIONS = [f"Question {i}: what is {i} times {i + 3}?" for i in range(100)]
FACTS = ("The archive stores records of ships, harbours, tides, cargo and crews. Each record lists the date, the port, "
         "the captain and the weather. ")


def system_prompt(llm: LLM, tokens: int) -> str:
    text = ""
    while len(llm.engine.tokenize(text, add_special_tokens=False)) < tokens:
        text += FACTS
    return text


def ttfts(llm: LLM, system: str, questions: list[str]) -> tuple[list[float], list[int]]:
    params = SamplingParams(temperature=0, max_tokens=1)
    times, cached = [], []
    for q in questions:
        out = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": q}], params)[0]
        times.append(out.metrics.ttft)
        cached.append(out.metrics.cached_tokens)
    return times, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--cold-questions", type=int, default=20)
    parser.add_argument("--tier-questions", type=int, default=5, help="questions after each eviction or restart (0: no tiers)")
    parser.add_argument("--small-pool", default="64MiB", help="the CPU-tier engine's KV pool")
    args = parser.parse_args()
    questions = QUESTIONS[: args.questions]

    cold_llm = LLM(args.model, enable_prefix_caching=False)
    system = system_prompt(cold_llm, args.system_tokens)
    cold, _ = ttfts(cold_llm, system, questions[: args.cold_questions])
    del cold_llm
    warm_llm = LLM(args.model, enable_prefix_caching=True)
    first, _ = ttfts(warm_llm, system, ["Warm-up question."])
    warm, cached = ttfts(warm_llm, system, questions)
    stats = warm_llm.engine.scheduler.stats

    prompt_tokens = len(warm_llm.engine.tokenize(
        warm_llm.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": questions[0]}]),
        add_special_tokens=False))
    print(f"\nshared system prompt + question: {prompt_tokens} tokens; {len(cold)} cold and {len(warm)} warm questions")
    print(f"  cold TTFT (no prefix cache)   mean {statistics.mean(cold) * 1000:8.1f} ms")
    print(f"  first request (fills cache)   {first[0] * 1000:8.1f} ms")
    print(f"  warm TTFT (prefix cache)      mean {statistics.mean(warm) * 1000:8.1f} ms, "
          f"{statistics.mean(cached):.0f} cached tokens per request")
    print(f"  prefix cache hit rate: {stats.prefix_hits / max(stats.prefix_queries, 1):.1%} of queried tokens")
    print(f"ratio warm / cold TTFT: {statistics.mean(warm) / statistics.mean(cold):.3f}x")
    if args.tier_questions:
        del warm_llm
        tiers(args, system, questions[: args.tier_questions], statistics.mean(cold))


def tiers(args: argparse.Namespace, system: str, questions: list[str], cold: float) -> None:
    """The first question after the pool lost the prompt: from a CPU tier (evicted) and a disk tier (restart)."""
    other = system.replace("ships", "trains").replace("harbours", "stations")  # as long, sharing no block
    cpu_llm = LLM(args.model, kv_cache_memory=args.small_pool, kv_tiers=["cpu:1GiB"])
    evicted = []
    for q in questions:
        ttfts(cpu_llm, system, [q])
        ttfts(cpu_llm, other, ["Evict the first prompt."])
        times, cached = ttfts(cpu_llm, system, [q + " Again?"])
        evicted.append((times[0], cached[0]))
    loaded = cpu_llm.engine.scheduler.stats.tier_loaded_blocks
    del cpu_llm
    with tempfile.TemporaryDirectory() as directory:
        ttfts(LLM(args.model, kv_tiers=[f"disk:{directory}"]), system, ["Fill the disk tier."])
        restarted = []
        for q in questions:
            disk_llm = LLM(args.model, kv_tiers=[f"disk:{directory}"])
            times, cached = ttfts(disk_llm, system, [q])
            restarted.append((times[0], cached[0]))
            del disk_llm
    for name, runs in (("evicted, from a CPU tier", evicted), ("restarted, from a disk tier", restarted)):
        mean = statistics.mean(t for t, _ in runs)
        print(f"  {name:28s}  mean {mean * 1000:8.1f} ms, {statistics.mean(c for _, c in runs):.0f} cached tokens per request")
    print(f"  blocks the CPU tier loaded back: {loaded}")
    print(f"ratio CPU tier / cold TTFT: {statistics.mean(t for t, _ in evicted) / cold:.3f}x; "
          f"disk tier after a restart / cold TTFT: {statistics.mean(t for t, _ in restarted) / cold:.3f}x")


if __name__ == "__main__":
    main()
