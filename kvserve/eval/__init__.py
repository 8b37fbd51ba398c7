"""`kvserve eval`: what each engine option set costs in quality, memory and speed, against a baseline.

For the baseline and every option set (any engine keywords, e.g. kv_cache_dtype=int8), on one model and text:
perplexity over windows of `context` tokens scored in `chunk`-token steps through the paged cache (so later
chunks attend to cached, possibly compressed K/V), the mean KL divergence of each next-token distribution from
the baseline's and their top-1 agreement, passkey retrieval by length and depth, KV bytes per token, and
decode tokens/s at the eval's context.
"""
from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.entrypoints.llm import LLM
from kvserve.errors import KVServeError
from kvserve.eval.passkey import passkey_prompts
from kvserve.eval.text import load_text
from kvserve.kv.policies import parse_policy
from kvserve.sampling_params import SamplingParams

GiB = 2**30


@dataclass(slots=True)
class EvalSettings:
    model: str = "smollm2-135m"
    compare: list[str] = field(default_factory=list)  # option sets, each "name=value,name=value"
    base: str = "matmul_dtype=float32"  # options every run shares, the baseline included
    text: str | None = None  # a file; None: Python's own documentation (pydoc_data.topics)
    context: int = 2048  # tokens per perplexity window
    chunk: int = 512  # tokens scored per step (max_num_batched_tokens)
    tokens: int = 8192  # tokens of text scored, in windows of `context`
    passkey_lengths: list[int] | None = None  # None: a quarter, half and all of `context`
    passkey_depths: list[int] = field(default_factory=lambda: [0, 25, 50, 75, 100])  # percent
    passkey_trials: int = 1  # random keys per length and depth
    decode_tokens: int = 32
    seed: int = 0

    def validate(self) -> None:
        for name in ("context", "chunk", "tokens", "passkey_trials", "decode_tokens"):
            if getattr(self, name) < 1:
                raise KVServeError(f"eval's {name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}")
        if self.decode_tokens >= self.context:  # decode speed is measured after a prompt of the rest of the context
            raise KVServeError(f"--decode-tokens {self.decode_tokens} must be below --context {self.context}")


def parse_options(text: str) -> dict:
    """'kv_cache_dtype=int8,kivi_residual=64' -> engine keywords, typed like EngineConfig's fields. A value of the form
    NAME:key=value,... (kv_policy, speculative) takes the items after it that name no engine option."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    options, last = {}, None
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        if name not in fields and last is not None and ":" in str(options[last]):
            options[last] += "," + item
            continue
        if not sep or not name:
            raise KVServeError(f"option {item!r} is not name=value")
        EngineConfig.check_names([name])
        options[name], last = _typed(name, value, str(fields[name].type)), name
    return options


def _typed(name: str, value: str, kind: str):
    if "bool" in kind:
        if value.lower() not in ("true", "false", "1", "0"):
            raise KVServeError(f"option {name} takes true or false, got {value!r}")
        return value.lower() in ("true", "1")
    if "None" in kind and value.lower() == "none":
        return None
    if "int" in kind:
        try:
            return int(value)
        except ValueError:
            if "str" not in kind:
                raise KVServeError(f"option {name} takes an integer, got {value!r}") from None
    return value


def run_eval(settings: EvalSettings, progress: bool = True) -> dict:
    """Every measurement for the baseline and each option set, as a JSON-ready dict."""
    settings.validate()
    base = parse_options(settings.base)
    runs = {"baseline": base} | {name: {**base, **parse_options(name)} for name in settings.compare}
    for options in runs.values():  # each set's settings, before the baseline's minutes of work
        config = _engine_config(settings, options)
        config.validate()
        if (policy := parse_policy(config.kv_policy)) is not None:
            policy.check(config.block_size)
    first = _engine(settings, base)  # validates the model and the context before any long work
    max_len = first.engine.request_limit(first.engine.kv_policy)  # past the model's window under streaming
    if settings.context > max_len:
        raise KVServeError(f"context {settings.context} is longer than the model's window of {max_len} tokens")
    ids = first.engine.tokenize(load_text(settings.text))
    windows = [ids[i:i + settings.context] for i in range(0, min(len(ids), settings.tokens) - settings.context + 1, settings.context)]
    if not windows:
        raise KVServeError(f"{min(len(ids), settings.tokens)} tokens to score (--tokens {settings.tokens}; the text has {len(ids)}) "
                           f"hold no window of --context {settings.context}")
    lengths = settings.passkey_lengths or [settings.context // 4, settings.context // 2, settings.context]
    if max(lengths) > max_len:
        raise KVServeError(f"passkey length {max(lengths)} is longer than the model's window of {max_len} tokens")
    passkeys = passkey_prompts(first.engine, lengths, settings.passkey_depths, settings.passkey_trials, settings.seed)
    del first
    results, reference = [], None
    with tqdm(total=len(runs) * (len(windows) + 2), desc="eval", unit="step", disable=not progress) as bar:  # closed
        for name, options in runs.items():  # before an error's line
            bar.set_postfix_str(name)
            llm = _engine(settings, options)
            scored = _score(llm, windows, reference, bar)
            distributions = scored.pop("distributions")
            reference = distributions if reference is None else reference
            results.append({"name": name, "options": options, **_memory(llm), **scored, **_passkey(llm, passkeys, lengths,
                            settings.passkey_depths), "decode_tok_s": _decode_speed(llm, ids, settings)})
            bar.update(2)
            del llm
            gc.collect()
    baseline = results[0]["perplexity"]
    for r in results:
        r["delta_ppl"] = r["perplexity"] / baseline - 1
    return {"model": settings.model, "text": settings.text or "pydoc_data.topics", "text_tokens": len(ids),
            "scored_tokens": len(windows) * (settings.context - 1), "settings": dataclasses.asdict(settings) | {"passkey_lengths": lengths},
            "results": results}


def _engine(settings: EvalSettings, options: dict) -> LLM:
    return LLM.from_config(_engine_config(settings, options))


def _engine_config(settings: EvalSettings, options: dict) -> EngineConfig:
    return EngineConfig(**{"model": settings.model, "max_num_batched_tokens": settings.chunk, "seed": settings.seed, **options})


def _score(llm: LLM, windows: list[list[int]], reference: list[torch.Tensor] | None, bar) -> dict:
    """Perplexity over the windows; KL and top-1 agreement against the reference distributions (the baseline's)."""
    nll, kl, agree, count, distributions, held = 0.0, 0.0, 0, 0, [], 0
    for i, window in enumerate(windows):
        params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_distributions=True)
        out = llm.generate(window, params, use_tqdm=False)[0]
        nll -= sum(s.logprob for s in out.prompt_logprobs[1:])
        held += out.metrics.kv_bytes
        count += len(window) - 1
        if reference is None:
            distributions.append(out.prompt_distributions)
        else:
            for ref, mine in zip(reference[i].split(1024), out.prompt_distributions.split(1024)):  # bounded memory
                ref, mine = ref.float(), mine.float()
                kl += float((ref.exp() * (ref - mine)).sum(-1).clamp(min=0).sum())
                agree += int((ref.argmax(-1) == mine.argmax(-1)).sum())
        bar.update(1)
    scored = {"perplexity": math.exp(nll / count), "distributions": distributions, "kv_bytes_held": held / len(windows)}
    if reference is not None:
        scored |= {"kl_mean": kl / count, "top1_agreement": agree / count}
    else:
        scored |= {"kl_mean": 0.0, "top1_agreement": 1.0}
    return scored


def _memory(llm: LLM) -> dict:
    engine = llm.engine
    per_token = engine.layout.bytes_per_token
    return {"kv_layout": engine.layout.describe(), "kv_bytes_per_token": per_token, "tokens_per_gib": GiB / per_token}


def _passkey(llm: LLM, prompts: list, lengths: list[int], depths: list[int]) -> dict:
    outs = llm.generate([p.token_ids for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    hits: dict[tuple[int, int], list[bool]] = {}
    for p, out in zip(prompts, outs):
        hits.setdefault((p.length, p.depth), []).append(p.key in out.outputs[0].text)
    table = {str(n): {str(d): sum(hits[n, d]) / len(hits[n, d]) for d in depths} for n in lengths}
    return {"passkey": table, "passkey_accuracy": sum(map(sum, hits.values())) / len(prompts)}


def _decode_speed(llm: LLM, ids: list[int], settings: EvalSettings) -> float:
    """Batch-1 decode tokens/s after a prompt of `context` tokens of the text."""
    params = SamplingParams(temperature=0, max_tokens=settings.decode_tokens, ignore_eos=True)
    prompt = ids[: settings.context - settings.decode_tokens]
    return llm.generate(prompt, params, use_tqdm=False)[0].metrics.decode_tokens_per_s or 0.0
