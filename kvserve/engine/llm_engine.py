"""The engine: requests in, one scheduled forward pass per `step`, outputs back."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvserve.config import EngineConfig
from kvserve.engine.detokenizer import serial
from kvserve.engine.model_runner import ModelRunner, StepOutput
from kvserve.engine.output import OutputProcessor
from kvserve.engine.prompts import PromptEncoder
from kvserve.engine.scheduler import ScheduledBatch, Scheduler
from kvserve.engine.sequence import Sequence
from kvserve.errors import KVServeError
from kvserve.kv.manager import KVManager
from kvserve.kv.policies import UNBOUNDED, KVPolicy, SeqKV, add_votes, parse_policy
from kvserve.kv.spec import build_layout
from kvserve.kv.tiers import Tiers
from kvserve.memory import spec_from_hf_config
from kvserve.models.loader import open_checkpoint, weights_digest
from kvserve.models.registry import FLOAT16_OVERFLOWS
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode import depths
from kvserve.spec_decode.proposers import parse_speculative


@dataclass(slots=True)
class StepStats:
    prefill_tokens: int
    decode_tokens: int
    seconds: float


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        if not config.use_kv_cache:
            config.enable_prefix_caching = False  # nothing survives a step to be shared
        torch.manual_seed(config.seed)
        self.config = config
        self.checkpoint = open_checkpoint(config.model)
        self.tokenizer = serial(self.checkpoint.tokenizer)
        self.prompts = PromptEncoder(self.tokenizer, config.model)
        model_config = self.checkpoint.config
        if config.dtype == "float16" and model_config.model_type in FLOAT16_OVERFLOWS:
            raise KVServeError(f"model type {model_config.model_type} does not run in float16: its activations overflow "
                               "float16's range; use dtype bfloat16 or float32")
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise KVServeError(f"max_model_len {self.max_model_len} exceeds the model's context window "
                               f"of {model_config.max_position_embeddings} tokens")
        k_dtype, v_dtype = config.kv_dtypes
        policy = parse_policy(config.kv_policy)
        self.layout = build_layout(spec_from_hf_config(self.checkpoint.hf_config, config.model), k_dtype, v_dtype,
                                   config.block_size, config.kivi_residual, config.residual_dtype,
                                   merge=policy if policy is not None and policy.merges_layers else None)
        if self.layout.merge and config.speculative:
            raise KVServeError("kv_policy minicache cannot run with speculative decoding: verified guesses would differ from "
                               "tokens decoded one at a time, whose earlier layers already see merged K/V")
        self.runner = ModelRunner(self.checkpoint, config, self.max_model_len, self.layout)
        num_blocks, num_residual = self.runner.kv_cache.num_blocks, self.runner.kv_cache.num_residual
        self.tiers = self._tiers(config)
        self.kv_manager = KVManager(self.layout, num_blocks, num_residual, config.enable_prefix_caching, salt=self._salt(config),
                                    chunk_tokens=config.max_num_batched_tokens, tiers=self.tiers)
        self.scheduler = Scheduler(config, self.kv_manager)
        eos = set(model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.requests: dict[str, list[Sequence]] = {}  # a request's completions, by index
        self.output = OutputProcessor(self.kv_manager, self.tokenizer, eos)  # no callback: a bound method kept the engine in a cycle
        self.feature_observers: list[tuple[Callable[[list[Sequence], torch.Tensor], None], Callable[[], bool] | None]] = []
        self.proposer = parse_speculative(config.speculative) if config.speculative else None
        if self.proposer is not None:
            self.proposer.start(self)
        self.kv_policy = self.resolve_policy(config.kv_policy)
        self._ids = itertools.count()
        self.last_step = StepStats(0, 0, 0.0)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold: the context window or the whole pool."""
        return min(self.max_model_len, self.kv_manager.max_tokens_per_request())

    def resolve_policy(self, text: str | None) -> KVPolicy | None:
        """A KV policy string, parsed and checked against this engine (None: keep every token)."""
        policy, config, layout = parse_policy(text), self.config, self.layout
        if policy is not None and policy.merges_layers:  # the engine's layout, already built
            if layout.merge is None or policy.at(layout.num_layers) != layout.merge:
                raise KVServeError(f"kv_policy {policy.name} changes the KV layout: choose it per engine (--kv-policy, kv_policy=), "
                                   "not per request")
            return None
        if policy is None:
            return None
        if config.batch_invariant:
            raise KVServeError(f"kv_policy {policy.name} cannot run with batch_invariant: its votes come from attention over whole prompt chunks")
        if layout.merge is not None:
            raise KVServeError(f"this engine's KV layout merges layers ({layout.merge}); a request cannot add kv_policy {policy.name}")
        if any(g.spec.kind != "full" for g in layout.groups):
            raise KVServeError(f"kv_policy {policy.name} needs full-attention layers; {config.model} has "
                               f"{', '.join(sorted({g.spec.kind for g in layout.groups} - {'full'}))} ones")
        if layout.has_residual:
            raise KVServeError(f"kv_policy {policy.name} cannot evict from kivi2 blocks; use a per-token KV dtype")
        if config.scheduler == "static" or config.speculative or not config.use_kv_cache:
            raise KVServeError(f"kv_policy {policy.name} needs the continuous scheduler with the KV cache and no speculative decoding")
        policy.check(config.block_size)
        if policy.reposition:
            most = policy.max_slots(UNBOUNDED, config.max_num_batched_tokens, config.block_size)
            if most > self.max_model_len:
                raise KVServeError(f"kv_policy {policy}: its window plus a step's tokens ({most}) must fit max_model_len "
                                   f"({self.max_model_len}); lower the window or max_num_batched_tokens")
        return policy

    def request_limit(self, policy: KVPolicy | None) -> int:
        """Prompt + output tokens one request may have: no bound where the policy places tokens at cache slots."""
        return UNBOUNDED if policy is not None and policy.reposition else self.max_request_tokens

    def request_policy(self, params: SamplingParams) -> KVPolicy | None:
        """The request's own kv_policy ("none": none), else the engine's."""
        policy = self.kv_policy if params.kv_policy is None else self.resolve_policy(params.kv_policy)
        if policy is not None and params.n > 1:
            raise KVServeError(f"kv_policy {policy.name} runs one completion per request (n = 1)")
        return policy

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return self.prompts.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self.prompts.apply_chat_template(messages)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    add_special_tokens: bool = True, prompt_text: str | None = None) -> str:
        """Queue a request; `prompt_text` names the text of a prompt passed already tokenized."""
        token_ids = self.tokenize(prompt, add_special_tokens)
        policy = self.check_request(token_ids, params)
        if params.max_tokens is None:
            params = replace(params, max_tokens=self._room(token_ids))
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise KVServeError(f"request id {request_id!r} is already in use")
        text, groups = prompt if isinstance(prompt, str) else prompt_text, len(self.layout.groups)
        first = Sequence(request_id, text, token_ids, params, groups, policy=policy, token_limit=self.request_limit(policy))
        first.metrics.kv_policy = str(policy) if policy is not None else (str(self.layout.merge) if self.layout.merge else None)
        # The other completions wait for the first's prefill, then fork from its blocks.
        first.children = [Sequence(request_id, text, token_ids, params, groups, i, first.metrics, token_limit=first.token_limit)
                          for i in range(1, params.n)]
        self.requests[request_id] = [first, *first.children]
        early_stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)) if params.min_tokens else []
        for seq in self.requests[request_id]:
            seq.early_stops = early_stops
            self.output.add(seq)
        self.scheduler.add(first)
        return request_id

    def check_request(self, token_ids: list[int], params: SamplingParams) -> KVPolicy | None:
        """Raise a clear error for a request this engine cannot run; returns its KV policy."""
        if not isinstance(params, SamplingParams):
            raise KVServeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        policy = self.request_policy(params)
        if params.n > 1 and self.config.scheduler == "static":
            raise KVServeError("the static baseline runs one completion per request (n = 1)")
        limit, vocab = self.request_limit(policy), self.checkpoint.config.vocab_size
        if not token_ids:
            raise KVServeError("the prompt is empty")
        bad = next((i for i, t in enumerate(token_ids) if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            value = token_ids[bad]
            raise KVServeError(f"prompt token ids must be ints in [0, {vocab}); token {bad} is {value!r:.40} ({type(value).__name__})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise KVServeError(f"logit_bias names token {max(params.logit_bias)}, past the vocabulary ({vocab} tokens)")
        max_tokens = self._room(token_ids) if params.max_tokens is None else params.max_tokens
        if len(token_ids) >= limit + (max_tokens == 0):  # a scored prompt may fill the limit
            raise KVServeError(f"the prompt has {len(token_ids)} tokens, but this engine holds at most {limit} tokens "
                               f"per request (max_model_len {self.max_model_len}, KV pool {self.kv_manager.num_blocks} "
                               f"blocks of {self.config.block_size})")
        if params.min_tokens > max_tokens:
            raise KVServeError(f"min_tokens {params.min_tokens} is more than max_tokens (none given: the {max_tokens} tokens "
                               f"left to this request)")
        if len(token_ids) + max_tokens > limit:
            raise KVServeError(f"max_tokens {max_tokens} is too large: the prompt's {len(token_ids)} tokens plus "
                               f"{max_tokens} new ones exceed the limit of {limit} tokens per request")
        if policy is not None:  # a policy's request may be longer than the pool holds, but not what it keeps at once
            chunk, bs = self.config.max_num_batched_tokens, self.config.block_size
            peak = policy.max_slots(len(token_ids) + max_tokens, chunk, bs)
            if self.kv_manager.blocks_for(peak) > self.kv_manager.num_blocks:
                raise KVServeError(f"kv_policy {policy}: this request holds up to {peak} tokens at once (what it keeps, a "
                                   f"block and a step's {chunk} tokens), more than the KV pool's {self.kv_manager.num_blocks} "
                                   f"blocks of {bs} tokens")
        return policy

    def _room(self, token_ids: list[int]) -> int:
        """max_tokens=None: up to the context window or what the pool holds (a policy that could go on stops there too)."""
        return max(1, self.max_request_tokens - len(token_ids))

    def observe_features(self, callback: Callable[[list[Sequence], torch.Tensor, list[int]], None],
                         wanted: Callable[[], bool] | None = None) -> Callable[[], None]:
        """After every step, callback(seqs, states, rows): row rows[i] of the step's final hidden states [rows, hidden]
        is the one that gave seqs[i] its newest token (a feature draft reads them; distillation records them).
        `wanted`: asked before each step, whether the callback needs that step's (None: always); a step no observer
        wants keeps none (picking the rows cost a paused feature draft's steps 4%). Returns what stops it."""
        observer = (callback, wanted)
        self.feature_observers.append(observer)
        return lambda: self.feature_observers.remove(observer)

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self._release(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass; returns an output for each request that got a token."""
        began = time.perf_counter()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch.has_work():
            assert not self.scheduler.has_unfinished(), "scheduler made no progress with requests pending"
            return []
        started = time.perf_counter()
        features = any(wanted is None or wanted() for _, wanted in self.feature_observers)
        step = self.runner.execute(batch, keep_features=features)
        decode = sum(n for seq, n in zip(batch.seqs, batch.num_tokens) if seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.last_step = StepStats(sum(batch.num_tokens) - decode, decode, time.perf_counter() - started)
        if self.proposer is not None:  # guessing pays or not: timed on decode-only steps (before _verified clears the guesses)
            self.proposer.timed(batch.seqs, time.perf_counter() - began, sum(map(len, step.tokens)),
                                decode_only=not self.last_step.prefill_tokens, features=features)
        self.output.record_computed(batch, self._verified(step))
        if any(seq.policy is not None for seq in batch.seqs):
            self._evict(batch.seqs, step.votes)
        self.runner.copy_blocks(self._fork(step.seqs))
        if self.kv_manager.sliding:  # give back what slid out of a window now, not at the next step
            for seq in batch.seqs:
                self.kv_manager.slide(seq)
        self.runner.pack(self.kv_manager.pack_aged(batch.seqs))  # kivi2: before finished requests free their blocks
        self._save_to_tiers()
        touched = list(dict.fromkeys(seq.request_id for seq in step.seqs))
        for request_id in touched:  # measured while every completion still holds its blocks
            self.requests[request_id][0].metrics.kv_bytes = self.kv_manager.kv_bytes(self.requests[request_id])
        deltas, finished = self.output.process(step)
        for seq, reason in finished:
            self._finish(seq, reason)
        if step.features is not None:  # a step of swaps only has none
            for observe, _ in self.feature_observers:
                observe(step.seqs, step.features, step.feature_rows)
        outputs = [self._request_output(request_id, deltas) for request_id in touched]
        if not self.config.use_kv_cache:
            self._drop_kv(batch)
        return outputs

    def _tiers(self, config: EngineConfig) -> Tiers | None:
        if not config.kv_tiers:
            return None
        if not config.enable_prefix_caching:
            raise KVServeError("KV tiers hold prefix-cache blocks: they need prefix caching (and the KV cache) on")
        return Tiers(config.kv_tiers, self.runner.kv_cache.block_nbytes)

    def _salt(self, config: EngineConfig) -> str:
        """What a block's hash chain starts from: what the cached values depend on besides the tokens. With KV tiers,
        which outlive the process and may serve other engines, the model is named by its files' contents, and the
        matmuls by how they ran ("auto" is bf16 on one CPU and fp32 on another)."""
        model = weights_digest(self.checkpoint) if config.kv_tiers else self.checkpoint.path
        return f"{model}|{config.dtype}|{self.runner.model.describe_matmuls()}|{bool(self.runner.native)}|{config.batch_invariant}"

    def _save_to_tiers(self) -> None:
        """Copy the blocks the prefix cache listed this step to the KV tiers (they are full, so they never change)."""
        saves, self.kv_manager.saves = self.kv_manager.saves, []
        if saves:
            self.scheduler.stats.tier_saved_blocks += len(saves)
            for (_, key, tokens), values in zip(saves, self.runner.kv_cache.read_blocks([b for b, _, _ in saves])):
                self.tiers.save(key, tokens, values)

    def _evict(self, seqs: list[Sequence], votes: dict[Sequence, torch.Tensor]) -> None:
        """Each policy's evictions after the step: kept tokens move to the front of the cache, emptied blocks go back."""
        for seq in seqs:
            policy = seq.policy
            if policy is None:
                continue
            if seq in votes:
                seq.kv_votes = add_votes(seq.kv_votes, votes[seq][..., :seq.num_slots])
            if seq.num_computed_tokens < seq.num_prompt_tokens and seq.num_computed_tokens % self.config.max_num_batched_tokens:
                continue  # within one of its prompt's chunks (Scheduler._chunk)
            keep = policy.keep(SeqKV(seq.num_prompt_tokens, seq.num_computed_tokens, seq.num_slots, self.config.block_size), seq.kv_votes)
            if not policy.decode_votes and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.kv_votes = None
            moves = None if keep is None else self.kv_manager.compact(seq, keep.shape[-1])
            if moves is None:
                continue
            self.runner.compact(*moves, keep, policy.reposition)
            evicted = seq.num_slots - keep.shape[-1]
            seq.num_evicted_tokens += evicted
            seq.metrics.num_evicted_tokens += evicted
            self.scheduler.stats.num_evicted_tokens += evicted
            if seq.kv_votes is not None:
                seq.kv_votes = seq.kv_votes.gather(-1, keep.expand(*seq.kv_votes.shape[:-1], -1))

    def _propose(self) -> None:
        """Guesses for each decoding sequence, never past max_tokens or the request's token limit (the token
        after the last guess comes too)."""
        seqs, limits = [], []
        if not self.proposer.begin_step(sum(seq.num_uncomputed_tokens == 1 for seq in self.scheduler.running)):
            return
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens == 1 and seq.params.max_tokens:
                room = min(seq.params.max_tokens - len(seq.output_token_ids), seq.token_limit - seq.num_tokens) - 1
                limit = min(room, self.proposer.lookahead(seq)) if room > 0 else 0
                if limit > 0:
                    seqs.append(seq)
                    limits.append(limit)
        for seq, guesses in zip(seqs, self.proposer.guesses(seqs, limits) if seqs else []):
            seq.draft_token_ids, seq.draft_parents = guesses, self.proposer.parents(seq, len(guesses))

    def _verified(self, step: StepOutput) -> dict[Sequence, int]:
        """Each guessing sequence's rejected guesses (their K/V is rolled back); counts proposals and acceptances."""
        rejected, stats = {}, self.scheduler.stats
        for seq, tokens in zip(step.seqs, step.tokens):
            if seq.draft_token_ids:
                proposed, kept = len(seq.draft_token_ids), len(tokens) - 1
                rejected[seq] = proposed - kept
                seq.metrics.num_draft_tokens += proposed
                seq.metrics.num_accepted_tokens += kept
                stats.num_draft_tokens += proposed
                stats.num_accepted_tokens += kept
                self.proposer.record(seq, max(depths(seq.guess_parents)), kept)  # a tree's gate and next length: its deepest path
                seq.draft_token_ids = []
        return rejected

    def _fork(self, sampled: list[Sequence]) -> list[tuple[int, int]]:
        """Completions that just sampled their first token from the prompt's logits take its blocks; returns the
        blocks to copy. One the pool has no room for waits to prefill on its own (the prefix cache helps it)."""
        copies = []
        for seq in sampled:
            if seq.index == 0 or seq.num_computed_tokens:
                continue
            first = self.requests[seq.request_id][0]
            first.children = []
            pairs = self.kv_manager.fork(first, seq)
            if pairs is None:
                self.scheduler.add(seq)
                continue
            copies += pairs
            seq.metrics.forked_blocks += seq.num_shared_tokens // self.config.block_size * len(self.layout.groups)
            self.scheduler.add_running(seq)
        return copies

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.output.drop(seq)
        if self.proposer is not None:
            self.proposer.forget(seq)

    def _request_output(self, request_id: str, deltas: dict) -> RequestOutput:
        seqs = self.requests[request_id]
        out = self.output.request_output(seqs, deltas)
        if out.finished:
            seqs[0].metrics.finished_time = time.perf_counter()
            del self.requests[request_id]
        return out

    def _drop_kv(self, batch: ScheduledBatch) -> None:
        """no_cache mode: forget every K/V, so the next step recomputes the whole sequence."""
        for seq in batch.seqs:
            if not seq.is_finished and seq.num_uncomputed_tokens == 1:
                self.kv_manager.free(seq)
                seq.forget_kv()

    def kv_usage(self) -> dict:
        """Blocks and bytes of the KV pool, now; a draft model's own pool under "draft" and the KV tiers under "tiers"
        (neither in the totals)."""
        usage = self.kv_manager.usage()
        draft = getattr(self.proposer, "kv", None)
        if draft is not None:
            usage["draft"] = draft.usage()
        if self.tiers is not None:
            usage["tiers"] = self.tiers.usage()
        return usage
