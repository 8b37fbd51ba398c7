"""Which sequences run in the next forward pass, with how many tokens each, and which blocks move.

Continuous batching: every step first gives running sequences their next token (decodes) or prefill
chunk, then admits waiting sequences into what is left of the token budget. When the pool runs out of
blocks the newest running sequence is preempted (recomputed later, or swapped to CPU memory).

The scheduler only decides: it changes block tables through the KV manager and lists the blocks whose
values must be copied out or in; the model runner moves them.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv.manager import KVManager
from kvserve.outputs import SchedulerStats


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each sequence in this step
    padding: list[int] | None = None  # static batching: pad tokens computed after each prompt, then discarded
    rectangular: bool = False  # static batching: attention over padded rectangles, the baseline's way
    # Block moves the model runner does before the forward pass, in this order:
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # copy these blocks to CPU memory
    tier_loads: list[tuple[int, bytes]] = field(default_factory=list)  # write values from a KV tier into these blocks
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # copy the saved values into these blocks

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)

    def remove(self, seq: Sequence) -> int:
        i = self.seqs.index(seq)
        del self.seqs[i]
        return self.num_tokens.pop(i)

    def has_work(self) -> bool:
        return bool(self.seqs or self.swap_out or self.swap_in)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager):
        self.config, self.kv = config, kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A completion forked from its prompt's blocks: it runs from the next step, no prefill of its own."""
        seq.status = SequenceStatus.RUNNING
        seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or time.perf_counter()
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) a sequence wherever it is and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.swapped_kinds = seq.swapped_kv = None
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def schedule(self) -> ScheduledBatch:
        return self._schedule_static() if self.config.scheduler == "static" else self._schedule_continuous()

    def _schedule_static(self) -> ScheduledBatch:
        """The baseline continuous batching replaces: admit a batch only when the last one has fully finished,
        reserve KV for its longest prompt + max_tokens, prefill every prompt padded to the longest in one pass."""
        batch = ScheduledBatch(rectangular=True)
        if self.running:
            for seq in self.running:
                batch.add(seq, 1)
            return batch
        kv, members = self.kv, []
        while self.waiting and len(members) < self.config.max_num_seqs:
            longest = max([s.num_tokens for s in members] + [self.waiting[0].num_tokens])
            reserve = [longest + s.params.max_tokens for s in members + [self.waiting[0]]]
            if sum(map(kv.blocks_for, reserve)) > kv.pool.num_free:
                break
            members.append(self.waiting.popleft())
        longest = max((s.num_tokens for s in members), default=0)
        for seq in members:
            assert kv.allocate_slots(seq, longest + seq.params.max_tokens)
            seq.status = SequenceStatus.RUNNING
            seq.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            batch.add(seq, seq.num_tokens)
        batch.padding = [longest - seq.num_tokens for seq in members]
        return batch

    def _schedule_continuous(self) -> ScheduledBatch:
        batch, budget, preempted = ScheduledBatch(), self.config.max_num_batched_tokens, False
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1):  # decodes first
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted to make room for an older one
                continue
            n = min(self._chunk(seq, budget) + len(seq.draft_token_ids), budget)
            del seq.draft_token_ids[max(0, n - seq.num_uncomputed_tokens):]  # the guesses the budget leaves room for
            while not self.kv.allocate_slots(seq, n):
                if seq.draft_token_ids:  # guesses never cost another request its blocks
                    seq.draft_token_ids, n = [], self._chunk(seq, budget)
                    continue
                victim, preempted = self.running[-1], True
                if victim in batch.seqs:
                    budget += batch.remove(victim)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n
        if not preempted:  # admitting now would only take blocks the running ones just lacked
            self._admit_waiting(batch, budget)
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step, guesses aside. A KV policy's request computes its prompt in the chunks it
        would get alone (max_num_batched_tokens each; a step may hold part of one) and evicts only where they end,
        so what it keeps, and so what it generates, never depends on the requests that share its steps."""
        n = min(seq.num_uncomputed_tokens, budget)
        if seq.policy is None:  # never one prompt token left for later: alone it would be a decode query, with other arithmetic
            return n - 1 if n > 2 and seq.num_uncomputed_tokens - n == 1 else n
        return min(n, self.config.max_num_batched_tokens - seq.num_computed_tokens % self.config.max_num_batched_tokens)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        if self.config.preemption_mode == "swap" and seq.num_computed_tokens > 0:
            batch.swap_out.append((seq, self.kv.swap_out(seq)))
        else:
            self.kv.free(seq)
            seq.forget_kv()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._allocate_admitted(seq, budget, batch):
                break
            n = self._chunk(seq, budget)
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            batch.add(seq, n)
            budget -= n

    def _allocate_admitted(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> bool:
        kv = self.kv
        if seq.swapped_kinds is not None:
            block_ids = kv.swap_in(seq)
            if block_ids is None:
                return False
            if not kv.allocate_slots(seq, self._chunk(seq, budget)):
                kv.swap_out(seq)  # undo: the saved values stay where they are
                return False
            batch.swap_in.append((seq, block_ids))
            return True
        cached, from_tiers = kv.allocate_cached_prefix(seq)
        if not kv.can_hold_prompt(seq) or not kv.allocate_slots(seq, self._chunk(seq, budget)):
            kv.free(seq)
            seq.forget_kv()
            return False
        batch.tier_loads += seq.tier_loads
        self.stats.tier_loaded_blocks += len(seq.tier_loads)
        seq.tier_loads = []
        if kv.enable_prefix_caching:
            self.stats.prefix_queries += seq.num_tokens
            self.stats.prefix_hits += cached
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.cached_tokens, seq.metrics.tier_tokens = cached, from_tiers
        return True
