"""Speculative decoding: decode tok/s with and without each proposer, as ratios measured in one run.

Workloads (greedy, SmolLM2 by default):
  copy    rewrite a given paragraph (the output repeats the prompt: prompt lookup's best case), batch 1
  open    open-ended generation (little to look up), batch 1
  batch   16 open-ended requests at once: total tok/s (speculation's extra tokens compete with other requests)

Each proposer's engine and the baseline run the same prompt (or batch) in turns, `--rounds` times; each
prompt's median rate counts, averaged over a workload's prompts. At batch 1 a line also splits its ratio in two:
the tokens a decode step yields (one, plus the guesses it kept: the same every round, outputs being greedy) over
what a step costs against the baseline's (the target's rows for the guesses and the proposer's time: the part
that varies between runs on a noisy machine), and that cost in three, each over the baseline's step: the forward
pass (`ModelRunner.execute`, with the rows for the guesses; of it, decode attention by the native kernels' clock),
the proposer's guessing (`LLMEngine._propose`) and the rest of the engine's step (scheduling, verification,
outputs). Greedy outputs should be the same tokens; the
table says where they are not (a verification pass of more rows than layers/linear.py's block limit multiplies
differently from one-token steps, which can flip a near-tie).

    python bench/speculative.py [--model smollm2-135m] [--speculative ngram:k=4 ...] [--rounds 3] [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_description, native_ops

PARAGRAPHS = [
    "The city council met on Tuesday to discuss the new budget. After a long debate, the members agreed to spend more "
    "money on public parks and less on road repairs. The mayor said the decision would make the city a better place "
    "for families, but some residents worried that the roads would get worse over the winter.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water. "
    "It takes place mainly in the leaves, inside small structures called chloroplasts. Oxygen is released as a "
    "by-product, which is why forests are often called the lungs of the planet.",
    "To make a simple loaf of bread, mix flour, water, yeast and a pinch of salt in a large bowl. Knead the dough "
    "for ten minutes, then let it rise in a warm place for an hour. Shape it, let it rise again, and bake it in a "
    "hot oven for about thirty minutes until the crust is golden brown.",
]
OPEN = ["Write a short story about a dragon who is afraid of the dark.", "Explain why the sky is blue to a child.",
        "What are the main causes of the French Revolution?"]


def workloads(llm: LLM) -> dict[str, list[str]]:
    chat = lambda text: llm.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    copy = [chat(f"Rewrite the following paragraph, fixing nothing and changing nothing:\n\n{p}") for p in PARAGRAPHS]
    return {"copy": copy, "open": [chat(t) for t in OPEN], "batch": [chat(t) for t in OPEN * 6][:16]}


class Timed:
    """What a clock (seconds) advances in each call of an object's method, from now on."""

    def __init__(self, owner: object, name: str, clock: Callable[[], float] = time.perf_counter):
        self.calls: list[float] = []
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.calls.append(clock() - start)

        setattr(owner, name, timed)


def timers(llm: LLM) -> tuple[Timed, ...]:
    """Timers around an engine's forward pass, its proposer's guessing and the native kernels' decode attention (the
    kernels' own clock: where they run, else it stays at 0)."""
    ops = native_ops() if llm.engine.runner.native else None
    attention = Timed(llm.engine.runner, "execute", ops.attention_seconds if ops is not None else lambda: 0.0)
    return Timed(llm.engine.runner, "execute"), Timed(llm.engine, "_propose"), attention


def run(llm: LLM, batch: bool, prompts: list[str], max_tokens: int, clocks: tuple[Timed, ...]) -> tuple:
    """tok/s (one prompt: its decode rate; a batch: all output tokens over wall time), outputs, guesses made and
    kept, and (one prompt) seconds per decode step (a step yields one token plus the guesses it kept), of which
    the forward pass's, the proposer's and decode attention's seconds a decode step."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for clock in clocks:
        clock.calls.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start) if batch else outs[0].metrics.decode_tokens_per_s or 0.0
    drafted, kept = sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)
    decoded = len(outs[0].outputs[0].token_ids) - 1  # after the prompt's step
    steps = max(decoded - kept, 1)
    step = decoded / rate / steps if not batch and rate else float("nan")
    forward, propose, attention = (sum(clock.calls[1:]) / steps for clock in clocks)  # past the prompt's step (one at batch 1)
    return rate, [o.outputs[0].token_ids for o in outs], drafted, kept, step, forward, propose, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--speculative", nargs="+", default=["ngram", "ngram:k=3"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="copy,open,batch")
    parser.add_argument("--dtype", default="float32", help="every engine's (e.g. bfloat16 on a GPU, where a verification's rows cost "
                                                        "what one row does)")
    args = parser.parse_args()

    make = lambda spec: LLM(args.model, speculative=spec, dtype=args.dtype)  # noqa: E731
    engines = {"baseline": make(None)} | {spec: make(spec) for spec in args.speculative}
    loads = {name: prompts for name, prompts in workloads(engines["baseline"]).items() if name in args.workloads.split(",")}
    # units of measurement: each batch-1 prompt alone, the batch whole; every engine runs each unit in turn
    units = [(load, load == "batch", prompts if load == "batch" else [p]) for load, prompts in loads.items()
             for p in (prompts[:1] if load == "batch" else prompts)]
    for llm in engines.values():  # warm-up: kernels, allocator
        llm.generate(units[0][2][0], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    clocks = {name: timers(llm) for name, llm in engines.items()}
    results: dict[tuple[int, str], list] = {}
    names = list(engines)
    for r in range(args.rounds):
        for u, (_, batch, prompts) in enumerate(units):
            for name in names[r % len(names):] + names[:r % len(names)]:  # a different engine goes first each round
                results.setdefault((u, name), []).append(run(engines[name], batch, prompts, args.max_tokens, clocks[name]))

    print(f"{args.model} ({args.dtype}), greedy, up to {args.max_tokens} new tokens; each prompt's median of {args.rounds} rounds, "
          f"averaged over a workload's prompts")
    print(f"CPU: {cpu_description()}")
    for load in loads:
        mine = [u for u, unit in enumerate(units) if unit[0] == load]
        typical = lambda name, field: statistics.mean(statistics.median(x[field] for x in results[(u, name)]) for u in mine)  # noqa: E731
        base = typical("baseline", 0)
        for name in engines:
            rate = typical(name, 0)
            same = sum(a == b for u in mine for a, b in zip(results[(u, name)][0][1], results[(u, "baseline")][0][1]))
            total = sum(len(results[(u, name)][0][1]) for u in mine)
            drafted, kept = (sum(x[i] for u in mine for x in results[(u, name)]) for i in (2, 3))
            accepted = f"accepted {kept / drafted:5.1%}" if drafted else " " * 14
            steps = ""
            if load != "batch":  # the ratio's two factors: tokens a step yields, and what a step costs (taken apart)
                decoded, step, unit = sum(len(x[1][0]) - 1 for u in mine for x in results[(u, name)]), typical(name, 4), typical("baseline", 4)
                forward, propose, attention = (typical(name, i) for i in (5, 6, 7))
                steps = (f" | {decoded / max(decoded - kept, 1):4.2f} tokens/step, step {step * 1e3:5.2f} ms ({step / unit:4.2f}x = forward "
                         f"{forward / unit:4.2f} (attention {attention / unit:4.2f}) + proposer {propose / unit:4.2f} + rest "
                         f"{(step - forward - propose) / unit:4.2f})")
            print(f"  {load:5s} {name:24s} {rate:7.1f} tok/s ({rate / base:4.2f}x) | {accepted} | "
                  f"same tokens as baseline: {same}/{total}{steps}")


if __name__ == "__main__":
    main()
