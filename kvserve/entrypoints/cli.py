"""The `kvserve` command: generate, chat, serve, memory."""
from __future__ import annotations

import argparse
import sys

from kvserve.config import EngineConfig
from kvserve.errors import KVServeError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    parser.add_argument("--model", default=d.model, help="built-in name, .gguf file or Hugging Face model directory")
    parser.add_argument("--dtype", default=d.dtype, help="float32, bfloat16 or float16 (weights and KV cache)")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="KV pool size, e.g. 512MiB or 2GiB")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-memory)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"])
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step (baseline)")
    parser.add_argument("--seed", type=int, default=d.seed)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode, use_kv_cache=not args.no_kv_cache, seed=args.seed,
    )


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler (reproducible output)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                          max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)


def stats_line(out: RequestOutput) -> str:
    m = out.metrics
    rate = f"{m.decode_tokens_per_s:.1f} tok/s" if m.decode_tokens_per_s else "n/a"
    prefilled = m.num_prompt_tokens - m.cached_tokens
    return (f"[{m.num_prompt_tokens} prompt tokens: {prefilled} prefilled, {m.cached_tokens} from cache | "
            f"{m.num_output_tokens} generated | TTFT {m.ttft * 1000:.0f} ms | decode {rate} | "
            f"KV {m.kv_bytes / 2**20:.2f} MiB | finish: {out.finish_reason}]")


def stream_answer(llm, prompt: str, params: SamplingParams, add_special_tokens: bool) -> RequestOutput:
    for out in llm.stream(prompt, params, add_special_tokens=add_special_tokens):
        print(out.new_text, end="", flush=True)
    print()
    return out


def cmd_generate(args: argparse.Namespace) -> None:
    from kvserve.entrypoints.llm import LLM

    params = sampling_params(args)
    llm = LLM.from_config(engine_config(args))
    out = stream_answer(llm, args.prompt, params, add_special_tokens=True)
    print(stats_line(out), file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    """Multi-turn chat; earlier turns stay in the prefix cache, so each turn prefills only what is new."""
    from kvserve.entrypoints.llm import LLM

    params = sampling_params(args)
    llm = LLM.from_config(engine_config(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = iter(args.message) if args.message else _read_turns()
    for text in turns:
        if args.message:
            print(f">>> {text}")
        messages.append({"role": "user", "content": text})
        out = stream_answer(llm, llm.apply_chat_template(messages), params, add_special_tokens=False)
        messages.append({"role": "assistant", "content": out.text})
        print(stats_line(out), file=sys.stderr)


def _read_turns():
    print("kvserve chat: type a message, Ctrl-D or /exit to quit.", file=sys.stderr)
    while True:
        try:
            text = input(">>> ").strip()
        except EOFError:
            return
        if text in ("/exit", "/quit"):
            return
        if text:
            yield text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="A small LLM inference engine built around the KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming the tokens")
    gen.add_argument("--prompt", required=True)
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive multi-turn chat (the conversation's KV stays cached)")
    chat.add_argument("--message", action="append", default=[], help="a user turn; repeat for several (non-interactive)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KVServeError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
