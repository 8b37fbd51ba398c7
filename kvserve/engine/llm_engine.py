"""The engine: requests in, one scheduled forward pass per `step`, outputs back."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import ScheduledBatch, Scheduler
from kvserve.engine.sequence import Sequence
from kvserve.errors import KVServeError
from kvserve.memory import blocks_that_fit, kv_bytes_per_token, spec_from_hf_config
from kvserve.models.loader import open_checkpoint
from kvserve.outputs import RequestOutput, TokenLogprob
from kvserve.sampling_params import SamplingParams


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
        self.tokenizer = self.checkpoint.tokenizer
        model_config = self.checkpoint.config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise KVServeError(f"max_model_len {self.max_model_len} exceeds the model's context window "
                               f"of {model_config.max_position_embeddings} tokens")
        self.bytes_per_token = int(kv_bytes_per_token(spec_from_hf_config(self.checkpoint.hf_config), config.kv_dtype_name))
        num_blocks = config.num_blocks or blocks_that_fit(config.kv_cache_memory, config.block_size, self.bytes_per_token)
        if num_blocks < 1:
            raise KVServeError(f"kv_cache_memory {config.kv_cache_memory} is smaller than one block "
                               f"({config.block_size * self.bytes_per_token} bytes)")
        self.runner = ModelRunner(self.checkpoint, config, self.max_model_len, num_blocks)
        salt = f"{config.model}|{config.dtype}|{config.block_size}"
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, salt)
        self.scheduler = Scheduler(config, self.block_manager, self.runner.kv_cache)
        eos = set(model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.sequences: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.last_step = StepStats(0, 0, 0.0)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold: the context window or the whole pool."""
        return min(self.max_model_len, self.block_manager.num_blocks * self.config.block_size)

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; chat-templated text passes add_special_tokens=False (the template has them)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise KVServeError(f"{self.config.model} has no tokenizer; pass prompts as lists of token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The conversation as prompt text, ending where the assistant's answer starts."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise KVServeError(f"{self.config.model} has no chat template")
        if not messages:
            raise KVServeError("messages must not be empty")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # templates raise jinja errors for conversations they do not accept
            raise KVServeError(f"the chat template rejected these messages: {e}") from e

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    add_special_tokens: bool = True, prompt_text: str | None = None) -> str:
        """Queue a request; `prompt_text` names the text of a prompt passed already tokenized."""
        token_ids = self.tokenize(prompt, add_special_tokens)
        self.check_request(token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.sequences:
            raise KVServeError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt if isinstance(prompt, str) else prompt_text, token_ids, params)
        self.sequences[request_id] = seq
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids)
        self.scheduler.add(seq)
        return request_id

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        limit, vocab = self.max_request_tokens, self.checkpoint.config.vocab_size
        if not token_ids:
            raise KVServeError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise KVServeError(f"prompt token ids must be ints in [0, {vocab})")
        if len(token_ids) >= limit:
            raise KVServeError(f"the prompt has {len(token_ids)} tokens, but this engine holds at most {limit} tokens "
                               f"per request (max_model_len {self.max_model_len}, KV pool {self.block_manager.num_blocks} "
                               f"blocks of {self.config.block_size})")
        if len(token_ids) + params.max_tokens > limit:
            raise KVServeError(f"max_tokens {params.max_tokens} is too large: the prompt's {len(token_ids)} tokens plus "
                               f"{params.max_tokens} new ones exceed the limit of {limit} tokens per request")

    def abort_request(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        self._detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass; returns an output for each request that got a token."""
        batch = self.scheduler.schedule()
        if not batch:
            assert not self.scheduler.has_unfinished(), "scheduler made no progress with requests pending"
            return []
        started = time.perf_counter()
        rows, sampled = self.runner.execute(batch)
        decode = sum(n for seq, n in zip(batch.seqs, batch.num_tokens) if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.last_step = StepStats(sum(batch.num_tokens) - decode, decode, time.perf_counter() - started)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        outputs = [self._append_token(batch.seqs[row], token, sampled.logprobs, i)
                   for i, (row, token) in enumerate(zip(rows, sampled.token_ids))]
        if not self.config.use_kv_cache:
            self._drop_kv(batch)
        return outputs

    def _drop_kv(self, batch: ScheduledBatch) -> None:
        """no_cache mode: forget every K/V, so the next step recomputes the whole sequence."""
        for seq in batch.seqs:
            if not seq.is_finished and seq.num_uncomputed_tokens == 1:
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0

    def _append_token(self, seq: Sequence, token: int, logprobs: torch.Tensor | None, row: int) -> RequestOutput:
        now = time.perf_counter()
        seq.token_ids.append(token)
        metrics = seq.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        metrics.num_output_tokens += 1
        metrics.kv_bytes = seq.num_computed_tokens * self.bytes_per_token
        if seq.logprobs is not None:
            seq.logprobs.append(_token_logprob(logprobs[row], token, seq.params.logprobs))
        detokenizer = self._detokenizers.get(seq.request_id)
        previous = seq.text
        seq.text, reason = self._check_stop(seq, token, previous + (detokenizer.push(token) if detokenizer else ""))
        delta = seq.text[len(previous):]
        if reason is not None:
            self.scheduler.finish(seq, reason)
            metrics.finished_time = now
            self.sequences.pop(seq.request_id, None)
            self._detokenizers.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, seq.prompt, seq.token_ids[: seq.num_prompt_tokens], seq.text,
                             seq.output_token_ids, seq.finish_reason, metrics, seq.logprobs, delta, [token])

    def _check_stop(self, seq: Sequence, token: int, text: str) -> tuple[str, str | None]:
        """The output text (cut before a stop string) and the finish reason, if the sequence is done."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return text, "stop"
        for stop in params.stop:
            at = text.find(stop, max(0, len(seq.text) - len(stop) + 1))
            if at != -1:
                return text[:at], "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_request_tokens:
            return text, "length"
        return text, None

    def kv_usage(self) -> dict[str, int]:
        """Blocks and bytes of the KV pool, now."""
        bm, block_bytes = self.block_manager, self.config.block_size * self.bytes_per_token
        return {
            "num_blocks": bm.num_blocks, "used_blocks": bm.num_used_blocks,
            "cached_blocks": bm.num_cached_free, "free_blocks": bm.num_free_blocks - bm.num_cached_free,
            "used_bytes": bm.num_used_blocks * block_bytes, "free_bytes": bm.num_free_blocks * block_bytes,
            "total_bytes": bm.num_blocks * block_bytes,
        }


def _token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    values, ids = logprobs.topk(top) if top else (torch.empty(0), torch.empty(0, dtype=torch.long))
    return TokenLogprob(token, float(logprobs[token]), dict(zip(ids.tolist(), values.tolist())))
