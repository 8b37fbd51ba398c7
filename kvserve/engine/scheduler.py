"""Which sequences run in the next forward pass, and with how many tokens each.

Continuous batching: every step first gives running sequences their next token (decodes) or prefill
chunk, then admits waiting sequences into what is left of the token budget. When the pool runs out of
blocks the newest running sequence is preempted (recomputed later, or swapped to CPU memory).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each sequence in this step
    padding: list[int] | None = None  # static batching: pad tokens computed after each prompt, then discarded

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)

    def remove(self, seq: Sequence) -> int:
        i = self.seqs.index(seq)
        del self.seqs[i]
        return self.num_tokens.pop(i)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens served from it


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, kv_cache: KVCache):
        self.config, self.block_manager, self.kv_cache = config, block_manager, kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) a sequence wherever it is and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.swapped_kv = None
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def schedule(self) -> ScheduledBatch:
        return self._schedule_static() if self.config.scheduler == "static" else self._schedule_continuous()

    def _schedule_static(self) -> ScheduledBatch:
        """The baseline continuous batching replaces: admit a batch only when the last one has fully finished,
        reserve KV for its longest prompt + max_tokens, prefill every prompt padded to the longest in one pass."""
        batch = ScheduledBatch()
        if self.running:
            for seq in self.running:
                batch.add(seq, 1)
            return batch
        bm, members = self.block_manager, []
        while self.waiting and len(members) < self.config.max_num_seqs:
            longest = max([s.num_tokens for s in members] + [self.waiting[0].num_tokens])
            reserve = [longest + s.params.max_tokens for s in members + [self.waiting[0]]]
            if sum(map(bm.blocks_needed, reserve)) > bm.num_free_blocks:
                break
            members.append(self.waiting.popleft())
        longest = max((s.num_tokens for s in members), default=0)
        for seq in members:
            assert bm.allocate_slots(seq, longest + seq.params.max_tokens)
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
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                victim, preempted = self.running[-1], True
                if victim in batch.seqs:
                    budget += batch.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n
        if not preempted:  # admitting now would only take blocks the running ones just lacked
            self._admit_waiting(batch, budget)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.config.preemption_mode == "swap" and seq.num_computed_tokens > 0:
            used = self.block_manager.blocks_needed(seq.num_computed_tokens)
            seq.swapped_kv = self.kv_cache.copy_out(seq.block_table[:used])
        else:
            seq.num_computed_tokens = 0
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._allocate_admitted(seq, budget):
                break
            n = min(seq.num_uncomputed_tokens, budget)
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            batch.add(seq, n)
            budget -= n

    def _allocate_admitted(self, seq: Sequence, budget: int) -> bool:
        bm = self.block_manager
        if seq.swapped_kv is not None:
            swapped = bm.blocks_needed(seq.num_computed_tokens)
            if not bm.allocate_slots(seq, min(seq.num_uncomputed_tokens, budget)):
                return False
            self.kv_cache.copy_in(seq.block_table[:swapped], seq.swapped_kv)
            seq.swapped_kv = None
            return True
        cached = bm.allocate_cached_prefix(seq)
        if not bm.allocate_slots(seq, min(seq.num_uncomputed_tokens, budget)):
            bm.free(seq)
            seq.num_computed_tokens = 0
            return False
        if bm.enable_prefix_caching:
            self.stats.prefix_queries += seq.num_tokens
            self.stats.prefix_hits += cached
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.cached_tokens = cached
        return True
