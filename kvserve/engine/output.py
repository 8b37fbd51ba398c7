"""After a forward pass: count the computed tokens, hash full blocks, append the sampled tokens (several per
sequence once speculation lands), detokenize, check stops, and say which requests finished."""
from __future__ import annotations

import time

import torch

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.model_runner import StepOutput
from kvserve.engine.scheduler import ScheduledBatch
from kvserve.engine.sequence import Sequence
from kvserve.kv.manager import KVManager
from kvserve.outputs import CompletionOutput, RequestOutput, TokenLogprob


class OutputProcessor:
    def __init__(self, kv: KVManager, tokenizer, eos_token_ids: set[int]):
        self.kv, self.tokenizer, self.eos_token_ids = kv, tokenizer, eos_token_ids
        self.detokenizers: dict[Sequence, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self.detokenizers[seq] = IncrementalDetokenizer(self.tokenizer, seq.token_ids)

    def drop(self, seq: Sequence) -> None:
        self.detokenizers.pop(seq, None)

    def record_computed(self, batch: ScheduledBatch, rejected: dict[Sequence, int]) -> None:
        """The step's tokens now have K/V in the cache: count them (not rejected guesses, whose K/V is rolled
        back) and share the blocks they filled."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n - rejected.get(seq, 0)
            if seq in rejected:
                self.kv.truncate(seq)
            self.kv.cache_full_blocks(seq)

    def process(self, step: StepOutput) -> tuple[dict[Sequence, tuple[str, list[int]]], list[tuple[Sequence, str]]]:
        """Append each sequence's new tokens; returns what each one's text and tokens gained, and the sequences that
        finished with their reasons (for the engine to finish)."""
        sampled = step.sampled
        if sampled is None:
            return {}, []
        for seq, scored in sampled.prompt.items():
            targets = seq.token_ids[len(seq.prompt_logprobs):]
            seq.prompt_logprobs += [TokenLogprob(t, lp, dict(zip(ids, values))) for t, lp, ids, values in
                                    zip(targets, scored.logprobs.tolist(), scored.top_ids.tolist(), scored.top_logprobs.tolist())]
            if scored.distributions is not None:
                seq.prompt_distributions.append(scored.distributions)
        deltas, finished = {}, []
        for seq, tokens, rows in zip(step.seqs, step.tokens, step.rows):
            # max_tokens 0 scores the prompt only: its sampled token is dropped
            *deltas[seq], reason = self.append(seq, tokens if seq.params.max_tokens else [], sampled.logprobs, rows)
            if reason is not None:
                finished.append((seq, reason))
        return deltas, finished

    def append(self, seq: Sequence, tokens: list[int], logprobs: torch.Tensor | None,
               logprob_rows: list[int]) -> tuple[str, list[int], str | None]:
        """Append tokens up to the first that finishes the sequence; returns the text shown, the tokens added and
        the reason it finished (None: it goes on)."""
        now, metrics = time.perf_counter(), seq.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        detokenizer, reason, new = self.detokenizers.get(seq), None, []
        for token, row in zip(tokens, logprob_rows):
            seq.token_ids.append(token)
            new.append(token)
            metrics.num_output_tokens += 1
            if seq.logprobs is not None:
                seq.logprobs.append(_token_logprob(logprobs[row], token, seq.params.logprobs))
            seq.text, reason = self._check_stop(seq, token, seq.text + (detokenizer.push(token) if detokenizer else ""))
            if reason is not None:
                break
        if not tokens:
            reason = "length"
        # A stream holds back text that could still turn into a stop string, so what it shows is always what
        # the finished request's text starts with.
        shown = seq.text if reason is not None else seq.text[: len(seq.text) - _stop_prefix_length(seq.text, seq.params.stop)]
        delta, seq.num_shown_chars = shown[seq.num_shown_chars:], len(shown)
        return delta, new, reason

    def request_output(self, seqs: list[Sequence], deltas: dict[Sequence, tuple[str, list[int]]]) -> RequestOutput:
        """The request's completions as they stand, each with what this step added to it."""
        outputs = [CompletionOutput(seq.index, seq.text[:seq.num_shown_chars], seq.output_token_ids,
                                    None if seq.logprobs is None else sum(lp.logprob for lp in seq.logprobs), seq.logprobs,
                                    seq.finish_reason, seq.stop_reason, *deltas.get(seq, ("", [])))
                   for seq in seqs]
        first, finished = seqs[0], all(o.finished for o in outputs)
        distributions = torch.cat(first.prompt_distributions) if finished and first.prompt_distributions else None
        return RequestOutput(first.request_id, first.prompt, first.token_ids[: first.num_prompt_tokens], outputs, finished,
                             first.metrics, first.prompt_logprobs, distributions)

    def _check_stop(self, seq: Sequence, token: int, text: str) -> tuple[str, str | None]:
        """The output text (cut before a stop string) and the finish reason, if the sequence is done."""
        params, produced = seq.params, seq.num_tokens - seq.num_prompt_tokens
        if produced >= params.min_tokens:  # before min_tokens, only the length ends it
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return text, "stop"
            if not params.ignore_eos and token in self.eos_token_ids:
                return text, "stop"
            for stop in params.stop:
                at = text.find(stop, max(0, len(seq.text) - len(stop) + 1))
                if at != -1:
                    seq.stop_reason = stop
                    return text[:at], "stop"
        if produced >= params.max_tokens or seq.num_tokens >= seq.token_limit:
            return text, "length"
        return text, None


def _stop_prefix_length(text: str, stops: list[str]) -> int:
    """The longest end of `text` that is the start of a stop string (which more text could complete)."""
    return max((k for stop in stops for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), default=0)


def _token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    values, ids = logprobs.topk(top) if top else (torch.empty(0), torch.empty(0, dtype=torch.long))
    return TokenLogprob(token, float(logprobs[token]), dict(zip(ids.tolist(), values.tolist())))
