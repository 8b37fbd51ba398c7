"""The `kvserve` command: generate, chat, serve, memory, eval, distill."""
from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvserve.config import KV_CACHE_DTYPES, EngineConfig, memory_share
from kvserve.engine.prompts import check_text
from kvserve.errors import KVServeError, check_output_dir
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


def add_model_args(parser: argparse.ArgumentParser, default: str | None, what: str) -> None:
    """The model as the first argument (vLLM's `vllm serve MODEL`) or as --model; check_args resolves the two, and
    `default` where neither is given (None: one is needed)."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help=f"{what} (or --model)")
    parser.add_argument("--model", help=f"{what}" + (f" (default {default})" if default else ""))
    parser.set_defaults(model_default=default)


def resolve_model(args: argparse.Namespace) -> None:
    """args.model from MODEL or --model (both: the same one), else the default. (distill's parser leaves an option
    not given unset: so do these two.)"""
    if "model_default" not in args:
        return
    given, flag = getattr(args, "model_arg", None), getattr(args, "model", None)
    if given is not None and flag is not None and given != flag:
        raise KVServeError(f"the model is given twice: {given!r} and --model {flag!r}")
    args.model = given or flag or args.model_default
    if "model_arg" in args:
        del args.model_arg
    del args.model_default
    if args.model is None:
        raise KVServeError(f"kvserve {args.command} needs a model: kvserve {args.command} MODEL (or --model MODEL)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    add_model_args(parser, d.model, "built-in name, .gguf file or Hugging Face model directory")
    parser.add_argument("--device", default=d.device, help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=d.dtype, help="float32, bfloat16 or float16 (weights and KV cache)")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                        help="KV pool: a size (512MiB, 2GiB) or a share of the memory free once the weights are loaded (50%%); "
                        "default 1GiB on CPU, 50%% on CUDA")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-memory)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                        help="tokens one step holds (prefill chunks and decodes); default 512 on CPU, 8192 on CUDA")
    parser.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"])
    parser.add_argument("--scheduler", default=d.scheduler, choices=["continuous", "static"],
                        help="continuous batching, or static padded batches (the baseline)")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step (baseline)")
    parser.add_argument("--no-native-kernels", action="store_true",
                        help="plain torch only: no paged decode-attention kernel, fp32 copies of GGUF weights "
                        "(on CUDA: no Triton RoPE and SiLU-and-mul)")
    parser.add_argument("--matmul-dtype", default=d.matmul_dtype, choices=["auto", "float32", "bfloat16"],
                        help="float32 models: keep the linear layers' weights in bf16 (auto: on CPUs that multiply bf16 natively)")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, metavar="DTYPE",
                        help=f"how K and V are stored: {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype)")
    parser.add_argument("--cache-type-k", default=None, metavar="DTYPE", help="K apart from V (overrides --kv-cache-dtype)")
    parser.add_argument("--cache-type-v", default=None, metavar="DTYPE", help="V apart from K (overrides --kv-cache-dtype)")
    parser.add_argument("--kivi-residual", type=int, default=d.kivi_residual,
                        help="kivi2: newest tokens per request kept in full precision (a multiple of --block-size)")
    parser.add_argument("--kv-tier", action="append", default=[], metavar="TIER", dest="kv_tiers",
                        help="a store past the KV pool for prefix-cache blocks, fastest first (repeatable): cpu:SIZE, "
                             "disk:DIR[:SIZE] (kept across restarts; 10GiB when no size is given), redis://HOST:PORT[/DB]")
    parser.add_argument("--kv-policy", default=None, metavar="POLICY",
                        help="which cached tokens requests keep, NAME:key=value,...: streaming:sinks=4,window=1024 (runs past the "
                             "context window), h2o:budget=0.2 (heavy hitters + recent), snapkv:budget=512 (the prompt's "
                             "last queries vote); budgets are tokens or a fraction; minicache:start=15 merges adjacent "
                             "layers' K/V from that layer on (per engine)")
    parser.add_argument("--speculative", default=None, metavar="PROPOSER",
                        help="speculative decoding, NAME[:key=value,...]: ngram[:k=6,n=3] (prompt lookup), "
                             "draft:model=PATH[,k=4,lookup=4] (a small model), self:layers=N[,k=3,lookup=4] (the model's first N layers), "
                             "eagle:model=DIR[,k=2,width=1,lookup=4] (a feature draft from kvserve distill --eagle), "
                             "lookup: prompt lookup's guesses where the text repeats (0: none); "
                             "each also takes min_acceptance (percent of guesses kept) and min_speedup (percent of plain "
                             "decoding's tokens a second, default 90), under which it stops guessing for a while")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a request's output never depends on what shares its steps or how its prompt is chunked "
                             "(GGUF models on the native CPU kernels; long prompts prefill slower)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: run decode steps op by op instead of replaying CUDA graphs of them")
    parser.add_argument("--seed", type=int, default=d.seed)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode, scheduler=args.scheduler, use_kv_cache=not args.no_kv_cache,
        native_kernels=not args.no_native_kernels, matmul_dtype=args.matmul_dtype, kv_cache_dtype=args.kv_cache_dtype,
        cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v, kivi_residual=args.kivi_residual,
        kv_policy=args.kv_policy, speculative=args.speculative, batch_invariant=args.batch_invariant, seed=args.seed,
        kv_tiers=args.kv_tiers, enforce_eager=args.enforce_eager,
    )


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop string ends the output before this many tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0, help="in [0, 1], as vLLM's (0: none)")
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler (reproducible output)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], as OpenAI's")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], as OpenAI's")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, as vLLM's (1: none)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                          max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty)


def stats_line(out: RequestOutput) -> str:
    m = out.metrics
    rate = f"{m.decode_tokens_per_s:.1f} tok/s" if m.decode_tokens_per_s else "n/a"
    prefilled = m.num_prompt_tokens - m.cached_tokens
    tiers = f" ({m.tier_tokens} from KV tiers)" if m.tier_tokens else ""
    return (f"[{m.num_prompt_tokens} prompt tokens: {prefilled} prefilled, {m.cached_tokens} from cache{tiers} | "
            f"{m.num_output_tokens} generated | TTFT {m.ttft * 1000:.0f} ms | decode {rate} | "
            f"KV {m.kv_bytes / 2**20:.2f} MiB{_eviction(m)}{_speculation(m)} | finish: {out.outputs[0].finish_reason}]")


def _eviction(m) -> str:
    if not m.kv_policy:
        return ""
    return f" ({m.kv_policy})" if m.kv_policy.startswith("minicache") else f" ({m.kv_policy}: {m.num_evicted_tokens} tokens evicted)"


def _speculation(m) -> str:
    if not m.num_draft_tokens:
        return ""
    return f" | speculative: {m.num_accepted_tokens}/{m.num_draft_tokens} accepted ({m.acceptance_rate:.0%})"


def stream_answer(llm, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool) -> RequestOutput:
    for out in llm.stream(prompt, params, add_special_tokens=add_special_tokens):
        print(out.outputs[0].new_text, end="", flush=True)
    print()
    return out


def load_llm(args: argparse.Namespace):
    """The engine, with one line on stderr saying what it holds: the weights' bytes and formats, the KV pool."""
    from kvserve.entrypoints.llm import LLM

    started = time.perf_counter()
    llm = LLM.from_config(engine_config(args))
    engine = llm.engine
    print(f"kvserve: {args.model} loaded in {time.perf_counter() - started:.1f} s: {engine.runner.model.describe_weights()}; "
          f"KV pool {engine.kv_usage()['total_bytes'] / 2**20:.0f} MiB ({engine.layout.describe()}){startup_note(engine)}", file=sys.stderr)
    return llm


def read_prompt(path: str) -> str:
    """--prompt-file's text: the file's, or standard input's for -."""
    from kvserve.eval.text import load_text

    if path != "-":
        return load_text(path)
    try:
        return sys.stdin.buffer.read().decode()
    except UnicodeDecodeError as e:
        raise KVServeError(f"cannot read the prompt from standard input: {e}") from None


def cmd_generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)
    prompt = args.prompt if args.prompt_file is None else read_prompt(args.prompt_file)
    llm = load_llm(args)
    out = stream_answer(llm, prompt, params, add_special_tokens=True)
    print(stats_line(out), file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    """Multi-turn chat; earlier turns stay in the prefix cache, so each turn prefills only what is new."""
    params = sampling_params(args)
    llm = load_llm(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    turns = iter(args.message) if args.message else _read_turns()
    for text in turns:
        if args.message:
            print(f">>> {text}")
        if text in ("/clear", "/reset"):  # a new conversation; the old one's blocks stay in the prefix cache
            messages = list(start)
            print("(a new conversation)", file=sys.stderr)
            continue
        fitted = fit_conversation(llm, [*messages, {"role": "user", "content": text}], len(start), params)
        if fitted is None:  # the session goes on: before, the engine's error ended it
            continue
        messages, prompt, turn_params = fitted
        out = stream_answer(llm, prompt, turn_params, add_special_tokens=False)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        print(stats_line(out), file=sys.stderr)


def fit_conversation(llm, messages: list[dict], kept: int,
                     params: SamplingParams) -> tuple[list[dict], list[int], SamplingParams] | None:
    """The conversation, its prompt and the answer's params within the engine's request limit, as Ollama does: the
    oldest exchanges dropped (the first `kept` messages, a system prompt, stay) until a whole answer fits; with only
    the newest message left, max_tokens cut to the room left. None, said, if that message alone does not fit."""
    limit, fitted = llm.engine.request_limit(llm.engine.kv_policy), list(messages)
    while (len(ids := llm.engine.tokenize(llm.apply_chat_template(fitted), add_special_tokens=False)) + params.max_tokens > limit
           and len(fitted) > kept + 1):
        del fitted[kept:kept + 2]  # the oldest question and its answer
    if len(ids) >= limit:
        print(f"kvserve: that message does not fit this engine's {limit}-token limit even alone; send a shorter one", file=sys.stderr)
        return None
    if len(fitted) < len(messages):
        print(f"(the conversation outgrew the {limit}-token limit: its {len(messages) - len(fitted)} oldest messages "
              "were dropped)", file=sys.stderr)
    return fitted, ids, replace(params, max_tokens=min(params.max_tokens, limit - len(ids)))


def _read_turns():
    print("kvserve chat: type a message; /clear starts a new conversation, Ctrl-D or /exit quits.", file=sys.stderr)
    while True:
        try:
            text = input(">>> ").strip()
        except EOFError:
            return
        except UnicodeDecodeError:  # a terminal whose encoding is not UTF-8
            print("kvserve: that line is not UTF-8 text; type it again", file=sys.stderr)
            continue
        if text in ("/exit", "/quit"):
            return
        if re.fullmatch(r"/\w+", text) and text not in ("/clear", "/reset"):  # a typo went to the model as a message
            print(f"kvserve: unknown command {text}; /clear starts a new conversation, /exit quits", file=sys.stderr)
        elif text:
            yield text


def startup_note(engine) -> str:
    """The startup line's end: how the KV pool was sized, the KV tiers, and on CUDA how decode steps run."""
    share = memory_share(engine.config.kv_cache_memory) if not engine.config.num_blocks else None
    note = f"; KV pool up to {engine.config.kv_cache_memory} of the memory free after loading" if share else ""
    note += f"; {engine.tiers.describe()}" if engine.tiers is not None else ""
    graphs = engine.runner.graphs
    if graphs is not None:
        note += (f"; decode steps as CUDA graphs ({len(graphs.graphs)} for {len(graphs.sizes)} batch sizes, captured in "
                 f"{graphs.capture_seconds:.1f} s)")
    elif engine.runner.device.type == "cuda":
        note += "; decode steps op by op (no CUDA graphs)"
    return note


def serve_description(engine) -> str:
    """What `kvserve serve` says of its engine: weights, KV pool and layout, and how the pool was sized."""
    usage = engine.kv_usage()
    draft = f"; the draft's own pool {usage['draft']['total_bytes'] / 2**20:.0f} MiB" if "draft" in usage else ""
    return (f"{engine.runner.model.describe_weights()}; KV pool {usage['total_bytes'] / 2**20:.0f} MiB, "
            f"{engine.kv_manager.num_blocks} blocks; {engine.layout.describe()}{draft}){startup_note(engine)}")


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from kvserve.server.app import create_app
    from kvserve.server.async_engine import AsyncEngine

    if args.max_waiting < 1:
        raise KVServeError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.stream_interval < 1:
        raise KVServeError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if not 1 <= args.port <= 65535:  # uvloop would bind the port modulo 65536 and say nothing
        raise KVServeError(f"--port must be in [1, 65535], got {args.port}")
    name = args.served_model_name or args.model
    with _listen(args.host, args.port) as sock:
        engine = AsyncEngine.start(engine_config(args), name, args.max_waiting, describe=serve_description, place=True,
                                   stream_interval=args.stream_interval)
        try:
            app = create_app(engine, name, api_key=args.api_key)
            print(f"kvserve: serving {args.model} on http://{args.host}:{args.port} ({engine.facts.description}", file=sys.stderr)
            server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
            # uvicorn raises the signal that stopped it again once it has shut down; this handler, restored under
            # it, lets the engine stop and exit 0
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
            server.run(sockets=[sock])
        finally:
            engine.stop()
    if not server.started:
        raise KVServeError(f"could not serve on {args.host}:{args.port} (see the log above)")


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (as vLLM does; the family as uvicorn picks it): a port in
    use or an address not this machine's was uvicorn's exit 3, once a model had taken its minutes to load."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # uvicorn's own: a restart finds the port in TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:  # gaierror too: a host name that does not resolve
        sock.close()
        raise KVServeError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with metrics and a live KV page")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model)")
    serve.add_argument("--max-waiting", type=int, default=256, help="waiting requests beyond this get HTTP 503")
    serve.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="send each request's new tokens every N steps, merged (its first and last at once): less "
                            "CPU a token for the server and its clients, burstier streams (default 1: every step)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=cmd_serve)


def _int_list(text: str, low: int = 1, high: int | None = None) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < low or (high is not None and v > high) for v in values):
        raise argparse.ArgumentTypeError(f"values must be in [{low}, {high}], got {text!r}" if high is not None
                                         else f"values must be >= {low}, got {text!r}")
    return values


def _percent_list(text: str) -> list[int]:
    return _int_list(text, 0, 100)


def cmd_memory(args: argparse.Namespace) -> None:
    from kvserve.config import parse_size
    from kvserve.memory import DEVICES, Device, PlanRequest, load_spec, plan
    from kvserve.memory.report import plot, render

    if args.device not in DEVICES:
        raise KVServeError(f"unknown device {args.device!r}; choose from {', '.join(DEVICES)} or pass --flops and --bandwidth")
    if args.plot:
        check_output_dir(Path(args.plot).parent, "--plot")
    base = DEVICES[args.device]
    custom = args.flops is not None or args.bandwidth is not None
    device = Device("custom" if custom else base.name, base.memory, base.flops if args.flops is None else args.flops,
                    base.bandwidth if args.bandwidth is None else args.bandwidth)
    spec = load_spec(args.model)
    request = PlanRequest(
        dtypes=args.kv_dtype or PlanRequest().dtypes, contexts=args.contexts, batches=args.batch,
        memory=None if args.memory is None else parse_size(args.memory), num_devices=args.num_devices,
        weight_bytes=None if args.weight_bytes is None else parse_size(args.weight_bytes), weight_bits=args.weight_bits,
        utilization=args.utilization, policies=args.kv_policy or [],
    )
    report = plan(spec, device, request)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    if args.plot:
        plot(spec, request.dtypes, max(request.contexts), args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)


def _add_memory_parser(sub) -> None:
    mem = sub.add_parser("memory", help="plan KV memory: bytes per token, capacity, roofline")
    add_model_args(mem, None, "preset (e.g. llama-3-70b), built-in model, config.json, model directory or .gguf")
    mem.add_argument("--kv-dtype", action="append",
                     help="bf16, fp16, fp32, fp8, fp8_e5m2, int8, int4, kivi2, or K/V apart as int8/int4 (repeatable)")
    mem.add_argument("--contexts", type=_int_list, default=[4096, 32768, 131072], help="e.g. 4096,32768")
    mem.add_argument("--batch", type=_int_list, default=[1, 8, 32], help="batch sizes, e.g. 1,8,32")
    mem.add_argument("--device", default="h100-80gb")
    mem.add_argument("--num-devices", type=int, default=1)
    mem.add_argument("--memory", help="total device memory, overrides the device's (e.g. 640GiB)")
    mem.add_argument("--weight-bytes", help="weight size (default: parameters x --weight-bits)")
    mem.add_argument("--weight-bits", type=int, default=16)
    mem.add_argument("--utilization", type=float, default=0.9, help="share of memory the engine may use")
    mem.add_argument("--flops", type=float, help="peak FLOP/s of a custom device")
    mem.add_argument("--bandwidth", type=float, help="memory bandwidth (bytes/s) of a custom device")
    mem.add_argument("--kv-policy", action="append", help="also plan a KV policy, e.g. h2o:budget=0.2 (repeatable)")
    mem.add_argument("--json", action="store_true")
    mem.add_argument("--plot", help="write a PNG of KV GiB against context length")
    mem.set_defaults(func=cmd_memory)


def cmd_eval(args: argparse.Namespace) -> None:
    from kvserve.eval import EvalSettings, run_eval
    from kvserve.eval.report import plot, render

    settings = EvalSettings(
        model=args.model, compare=args.compare, base=args.base, text=args.text, context=args.context, chunk=args.chunk,
        tokens=args.tokens, passkey_lengths=args.passkey_lengths, passkey_depths=args.passkey_depths,
        passkey_trials=args.passkey_trials, decode_tokens=args.decode_tokens, seed=args.seed,
    )
    if args.plot:
        check_output_dir(args.plot, "--plot")
    report = run_eval(settings)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    if args.plot:
        paths = plot(report, args.plot)
        print("plots written: " + ", ".join(map(str, paths)), file=sys.stderr)


def _add_eval_parser(sub) -> None:
    d = EngineConfig()
    ev = sub.add_parser("eval", help="what KV options cost: perplexity, KL, passkey, memory and speed against a baseline")
    add_model_args(ev, d.model, "built-in name, .gguf file or Hugging Face model directory")
    ev.add_argument("--compare", action="append", default=[], metavar="NAME=VALUE,...",
                    help="an option set to compare with the baseline, e.g. kv_cache_dtype=int8 (repeatable)")
    ev.add_argument("--base", default="matmul_dtype=float32", metavar="NAME=VALUE,...",
                    help="engine options every run shares, the baseline included")
    ev.add_argument("--text", default=None, help="a text file (default: Python's own documentation, pydoc_data.topics)")
    ev.add_argument("--context", type=int, default=2048, help="tokens per perplexity window")
    ev.add_argument("--chunk", type=int, default=512, help="tokens scored per step: later chunks attend to the cached K/V")
    ev.add_argument("--tokens", type=int, default=8192, help="tokens of text to score")
    ev.add_argument("--passkey-lengths", type=_int_list, default=None, help="context lengths (default: context/4, /2, /1)")
    ev.add_argument("--passkey-depths", type=_percent_list, default=[0, 25, 50, 75, 100], help="depths in percent")
    ev.add_argument("--passkey-trials", type=int, default=1, help="random keys per length and depth")
    ev.add_argument("--decode-tokens", type=int, default=32)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--plot", metavar="DIR", help="write perplexity.png and passkey.png here")
    ev.set_defaults(func=cmd_eval)


def cmd_distill(args: argparse.Namespace) -> None:
    import dataclasses

    from kvserve.spec_decode.distill import DistillSettings, distill

    settings = DistillSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillSettings) if hasattr(args, f.name)})
    report = distill(settings)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    b, a, acc = report["before"], report["after"], report["acceptance"]
    width = f", MLP width {settings.mlp}" if settings.mlp else ""
    kind = f"a feature draft for {settings.model}" if settings.eagle else f"layers {report['kept_layers']} of {settings.model}"
    print(f"draft: {settings.out} ({kind}{width}); loss curve: {Path(settings.out) / 'loss.png'}")
    ahead = " two tokens ahead" if settings.eagle else ""
    print(f"perplexity{ahead} on held-out text: target {report['target_perplexity']:.2f} (next token), draft {b['perplexity']:.2f} "
          f"untrained -> {a['perplexity']:.2f} trained; KL to the target {b['kl_mean']:.3f} -> {a['kl_mean']:.3f}")
    if settings.eagle:
        print(f"the draft's guess is the target's greedy token: {b['agreement']:.1%} -> {a['agreement']:.1%}; its second guess, "
              f"where the first was: {b['second_agreement']:.1%} -> {a['second_agreement']:.1%}")
    print(f"acceptance (greedy, k=4): {acc['accepted_tokens']}/{acc['draft_tokens']} = {acc['rate']:.1%}")
    print(f"use it: kvserve generate --speculative {'eagle' if settings.eagle else 'draft'}:model={settings.out} --prompt ...")


def _add_distill_parser(sub) -> None:
    """Its defaults are DistillSettings' (an option not given is not set here), read when it runs: importing
    kvserve.spec_decode.distill brings torch, which `kvserve serve`'s HTTP process does without."""
    di = sub.add_parser("distill", help="make a speculative-decoding draft from the model: prune layers, then distill",
                        argument_default=argparse.SUPPRESS)
    add_model_args(di, EngineConfig().model, "the target: built-in name, .gguf file or Hugging Face model directory")
    di.add_argument("--out", help="directory the draft is saved to (Hugging Face format)")
    di.add_argument("--layers", type=int, help="decoder layers kept: the first ones and the last LAYERS // 3")
    di.add_argument("--eagle", action="store_true",
                    help="train a feature draft (EAGLE-style: one MLP block on the model's hidden states) instead of pruning")
    di.add_argument("--depth", type=int,
                    help="with --eagle, train the draft on its own predictions this many tokens ahead; it guesses as many (eagle's k)")
    di.add_argument("--mlp", type=int, metavar="WIDTH",
                    help="narrow each kept MLP to its WIDTH most active intermediate neurons (0: keep its width); "
                         "with --eagle, the block's MLP width (0: the model's)")
    di.add_argument("--steps", type=int)
    di.add_argument("--batch", type=int, help="windows per step")
    di.add_argument("--seq-len", type=int, help="tokens per window")
    di.add_argument("--lr", type=float)
    di.add_argument("--temperature", type=float, help="softens both distributions in the KL loss")
    di.add_argument("--text", help="a text file (default: Python's own documentation, pydoc_data.topics)")
    di.add_argument("--answers", type=int, metavar="N",
                    help="distill on the model's own answers to N chat prompts (greedy, then sampled rounds past the prompts' number) instead of a text")
    di.add_argument("--prompts",
                    help="the chat prompts --answers asks: builtin (4,312: tasks on topics) or self (N user messages the model writes itself)")
    di.add_argument("--vocab", type=int, help="tokens the draft's LM head covers (0: all)")
    di.add_argument("--seed", type=int)
    di.add_argument("--json", action="store_true", default=False)
    di.set_defaults(func=cmd_distill)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="A small LLM inference engine built around the KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming the tokens")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument("--prompt-file", metavar="FILE", help="the prompt's text from a file (-: standard input)")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive multi-turn chat (the conversation's KV stays cached)")
    chat.add_argument("--message", action="append", default=[], help="a user turn; repeat for several (non-interactive)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    _add_serve_parser(sub)
    _add_memory_parser(sub)
    _add_eval_parser(sub)
    _add_distill_parser(sub)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """The model from MODEL or --model; every text option is text the tokenizer can encode: Python hands a command
    line's bytes that are not UTF-8 over as lone surrogates, which the tokenizer (and printing them) failed on."""
    resolve_model(args)
    for name, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                check_text(text, f"--{name.replace('_', '-')}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        args.func(args)
    except KVServeError as e:  # one line: some messages quote another library's, which may span several
        print("kvserve: error: " + re.sub(r"\s*\n\s*", " ", str(e)), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
