from __future__ import annotations

import enum
import time

import torch

from kvserve.kv.block_table import BlockTable
from kvserve.kv.policies import UNBOUNDED, KVPolicy
from kvserve.outputs import RequestMetrics, TokenLogprob
from kvserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One completion of a request: its tokens and where its KV lives.

    `num_computed_tokens` tokens have been through the model; the cache holds K/V of `num_slots` of them (in the
    blocks of `block_tables`, one table per layer group): all, unless a KV policy evicted some. The rest of
    `token_ids` still has to go through the model. A finished prefill samples a
    token, which is appended. With n > 1, completion 0 prefills the prompt and the others wait in its
    `children` until then, to fork from its blocks.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 num_kv_groups: int = 1, index: int = 0, metrics: RequestMetrics | None = None, policy: KVPolicy | None = None,
                 token_limit: int = UNBOUNDED):
        self.request_id, self.prompt, self.params, self.index = request_id, prompt, params, index
        self.children: list[Sequence] = []
        self.num_shared_tokens = 0  # a forked completion: prompt tokens in blocks it shares with completion 0
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.policy = policy  # which cached tokens to evict (kvserve.kv.policies)
        self.num_evicted_tokens = 0  # computed tokens whose K/V the policy evicted
        self.kv_votes: torch.Tensor | None = None  # a voting policy's accumulated votes, [layers, kv heads, slots]
        self.token_limit = token_limit  # prompt + output tokens at most
        self.block_tables = BlockTable(num_kv_groups)
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids, filled lazily
        self.num_hashed_blocks = 0  # leading blocks of the tables registered in the prefix cache
        self.num_packed_blocks = 0  # kivi2: leading blocks already packed (the rest are float residual blocks)
        self.draft_token_ids: list[int] = []  # speculative decoding: this step's guesses after the last token...
        self.draft_parents: list[int] = []  # ...each one's parent guess as proposed (-1: the last token); see guess_parents
        self.spec_state = None  # the proposer's own, per sequence
        self.tier_loads: list[tuple[int, bytes]] = []  # prefix blocks found in a KV tier: (block, values) to write before its first step
        self.early_stops: list[int] = []  # the stop tokens (EOS and stop_token_ids) it may not sample before min_tokens
        self.swapped_kinds: list[list[bool | None]] | None = None  # swapped out: per group and block, from the residual pool? (None: NULL)
        self.swapped_kv: dict | None = None  # the swapped-out values, held by the model runner
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.num_shown_chars = 0  # of text, already in an output's new_text
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # one entry per prompt token scored so far; the first token has nothing before it
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_distributions: list[torch.Tensor] = []  # SamplingParams.prompt_distributions, chunk by chunk
        # one per request: its completions share it
        self.metrics = metrics or RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_token_ids))
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed + index if params.seed is not None else torch.seed())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def guess_parents(self) -> list[int]:
        """The parents of the guesses this step verifies: the scheduler may have cut the guesses' tail."""
        return self.draft_parents[:len(self.draft_token_ids)]

    @property
    def num_slots(self) -> int:
        """Tokens whose K/V the cache holds, at slots 0 .. num_slots - 1."""
        return self.num_computed_tokens - self.num_evicted_tokens

    def forget_kv(self) -> None:
        """Its cache is gone (preempted for recompute): every token has to go through the model again."""
        self.num_computed_tokens = self.num_evicted_tokens = 0
        self.kv_votes = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
