"""Which blocks each request holds: one block table per layer group, all drawn from one pool.

A full block's hash chains its parent's hash with its token ids (the root mixes in the engine's salt,
which names the layout, and the request's cache_salt), so equal hashes mean equal prefixes. Only blocks
that will never change are shared: full blocks of computed tokens; with a kivi2 layout, only packed ones.

kivi2: new tokens go to float blocks of a second, residual pool; once a block's tokens are all
`residual_tokens` older than the newest, the block is packed (2-bit) into a main-pool block. Packing is
decided right after a forward pass (`pack_aged`) and done by the model runner before anything else is
scheduled, so a block never holds values in two states at once.

With KV tiers (kv/tiers), a block registered in the prefix cache is also saved to them (`saves`, which the engine
copies out after the step), and a prefix the pool lacks is looked up there: the blocks found are allocated,
registered and filled with the saved values (the sequence's `tier_loads`, which the runner writes before the
forward pass), as if the pool had kept them.

A sliding-window group (Gemma 3's local layers, Mistral) gives back the blocks that slid out of its window
before each step: their entries in its block table become NULL, so a table's length stays the sequence's
length in blocks. A prefix-cache hit then needs only the window's blocks of a sliding group.
"""
from __future__ import annotations

import hashlib
from array import array

import numpy as np

from kvserve.engine.sequence import Sequence
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.block_table import NULL
from kvserve.kv.cache import BLOCK_BYTES_VERSION
from kvserve.kv.spec import KVLayout
from kvserve.kv.tiers import Tiers


class KVManager:
    def __init__(self, layout: KVLayout, num_blocks: int, num_residual: int, enable_prefix_caching: bool, salt: str,
                 chunk_tokens: int = 0, tiers: Tiers | None = None):
        """chunk_tokens: the most tokens a step computes for one sequence (a sliding group holds its window
        plus those)."""
        self.layout, self.block_size, self.num_groups = layout, layout.block_size, len(layout.groups)
        self.windows = layout.windows
        self.sliding = any(self.windows)
        self.chunk_tokens = chunk_tokens
        self.pool = BlockPool(num_blocks)
        self.residual = BlockPool(num_residual, first_id=num_blocks) if layout.has_residual else None
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = (f"{salt}|{layout.k_format.name}|{layout.v_format.name}|{layout.block_size}|{layout.residual_tokens}|"
                     f"{layout.merge!r}|{BLOCK_BYTES_VERSION}").encode()
        self.tiers = tiers
        self.saves: list[tuple[int, bytes, tuple[int, ...]]] = []  # (block, key, tokens) registered since the engine last saved

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks (of every group) that hold `num_tokens` tokens: a sliding group at most its window's and a chunk's."""
        blocks = -(-num_tokens // self.block_size)
        return sum(blocks if w is None else min(blocks, -(-(w - 1 + self.chunk_tokens) // self.block_size) + 1)
                   for w in self.windows)

    def max_tokens_per_request(self) -> int:
        """The longest request the pool can hold alone (without bound if only sliding groups grow)."""
        low, high = 0, 1 << 40
        if self.blocks_for(high) <= self.pool.num_blocks:
            return high
        while low < high:  # blocks_for grows with the tokens
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.blocks_for(mid) <= self.pool.num_blocks else (low, mid - 1)
        return low + self.layout.residual_tokens

    def allocate_cached_prefix(self, seq: Sequence) -> tuple[int, int]:
        """Point a new sequence's block tables at the longest cached prefix, in the pool or a KV tier; returns the
        tokens reused, and how many of them the pool alone would have computed (the tiers')."""
        assert not len(seq.block_tables) and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:  # scoring needs every position's logits
            return 0, 0
        self._hash_full_blocks(seq)
        bs, found, stored = self.block_size, {}, {}

        def tokens(i: int) -> tuple[int, ...]:
            return tuple(seq.token_ids[i * bs:(i + 1) * bs])

        def in_pool(g: int, i: int) -> int | None:
            if (g, i) not in found:
                found[g, i] = self.pool.lookup(_group_key(seq.block_hashes[i], g), tokens(i))
            return found[g, i]

        def in_tier(g: int, i: int) -> bytes | None:
            if (g, i) not in stored:
                stored[g, i] = self.tiers.load(_group_key(seq.block_hashes[i], g), tokens(i))
            return stored[g, i]

        hit = pool_hit = self._longest_hit(seq, lambda g, i: in_pool(g, i) is not None)
        if self.tiers is not None:
            longer = self._longest_hit(seq, lambda g, i: in_pool(g, i) is not None or in_tier(g, i) is not None)
            needed = self._needed(longer)
            missing = sum(in_pool(g, i) is None for g, i in needed)
            idle_hits = sum(self.pool.block(in_pool(g, i)).ref_count == 0 for g, i in needed if in_pool(g, i) is not None)
            if missing <= self.pool.num_free - idle_hits:  # the pool has room for what the tiers hold
                hit = longer
        columns = np.full((self.num_groups, hit), NULL)
        needed = self._needed(hit)
        for g, i in needed:  # the pool's blocks first: loading the rest may evict idle cached blocks
            if in_pool(g, i) is not None:
                self.pool.take(in_pool(g, i))
                columns[g, i] = in_pool(g, i)
        for g, i in needed:
            if columns[g, i] == NULL:
                columns[g, i] = self.pool.allocate()
                self.pool.register(int(columns[g, i]), _group_key(seq.block_hashes[i], g), tokens(i))
                seq.tier_loads.append((int(columns[g, i]), in_tier(g, i)))
        seq.block_tables.extend(columns)
        seq.num_hashed_blocks = seq.num_packed_blocks = hit
        seq.num_computed_tokens = hit * bs
        return seq.num_computed_tokens, (hit - pool_hit) * bs

    def _longest_hit(self, seq: Sequence, cached) -> int:
        """Leading blocks every full group has cached (`cached(group, block)`), but never the last two tokens' (they
        are computed: the last for its logits, with the one before it so that they run as a prompt chunk; one token
        alone is a decode query, whose arithmetic differs, and a prompt of 16k + 1 tokens answered otherwise once
        cached) nor past what the sequence's KV policy may reuse, fewer until each sliding group has the window's
        blocks before the first token left to compute."""
        full_groups = [g for g, w in enumerate(self.windows) if w is None]
        last = seq.num_tokens - 2
        if seq.policy is not None:
            last = min(last, seq.policy.reusable_prefix(seq.num_prompt_tokens, self.chunk_tokens, self.block_size))
        hit = 0
        while hit < last // self.block_size and all(cached(g, hit) for g in full_groups):
            hit += 1
        while hit and not all(cached(g, i) for g, w in enumerate(self.windows) if w for i in range(self._first_needed(hit * self.block_size, w), hit)):
            hit -= 1
        return hit

    def _needed(self, hit: int) -> list[tuple[int, int]]:
        """The (group, block) a prefix of `hit` blocks needs: every block of a full group, a window's of a sliding one."""
        return [(g, i) for g, w in enumerate(self.windows) for i in range(self._first_needed(hit * self.block_size, w), hit)]

    def _first_needed(self, position: int, window: int | None) -> int:
        """The first block a query at `position` (or later) reads in a group with this window."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def slide(self, seq: Sequence) -> None:
        """Give back the blocks of sliding groups that no query from the next uncomputed token on reads."""
        if not self.sliding:
            return
        for table, window in zip(seq.block_tables, self.windows):
            for i in range(min(self._first_needed(seq.num_computed_tokens, window), len(table)) - 1, -1, -1):
                block_id = int(table[i])
                if block_id == NULL:  # given back already, and everything before it
                    break
                self.pool_of(block_id).release(block_id)
                table[i] = NULL

    def can_hold_prompt(self, seq: Sequence) -> bool:
        """Whether the pool has room now for the rest of the sequence's tokens (kivi2: those it will pack). Admitting
        one that has not would only preempt others a few prefill chunks later."""
        held_later = seq.num_tokens
        if seq.policy is not None:
            held_later = seq.policy.max_slots(seq.num_tokens, self.chunk_tokens, self.block_size)
        packed_later = max(0, held_later - self.layout.residual_tokens) if self.residual else held_later
        return self.blocks_for(packed_later) - seq.block_tables.num_held() <= self.pool.num_free

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens (after giving back blocks that slid out of a window); False,
        allocating nothing, if the pool is short."""
        self.slide(seq)
        new = -(-(seq.num_slots + num_new_tokens) // self.block_size) - len(seq.block_tables)
        pool = self.residual or self.pool  # kivi2: new tokens are written in float
        if new * self.num_groups > pool.num_free:
            return False
        if new > 0:  # block by block, every group's in turn
            seq.block_tables.extend(np.array([pool.allocate() for _ in range(new * self.num_groups)]).reshape(new, -1).T)
        return True

    def compact(self, seq: Sequence, kept: int) -> tuple[list[list[int]], list[list[int]]] | None:
        """A policy keeps `kept` of the sequence's slots, to be moved to the front: returns each group's blocks the
        values are read from and the blocks they go to, and gives back the blocks left empty. The runner moves the
        values before anything else writes to the pool. A block another sequence shares is never written: one
        of this sequence's own blocks past the kept ones takes its place, else a new one; a block only this sequence
        holds but the prefix cache lists is replaced while the pool has room, else leaves the cache (None, changing
        nothing, if a shared block has no stand-in)."""
        bs, pool = self.block_size, self.pool
        used, needed = -(-seq.num_slots // bs), -(-kept // bs)
        exclusive = lambda b: pool.block(b).ref_count == 1 and pool.block(b).hash is None  # noqa: E731
        plans, new, uncached = [], 0, []  # per table: its kept blocks (None: a new one goes there); blocks leaving the cache
        tables = seq.block_tables.ids.tolist()
        for table in tables:
            spare, plan = [b for b in table[needed:] if exclusive(b)], []
            for block_id in table[:needed]:
                if exclusive(block_id):
                    plan.append(block_id)
                elif spare:
                    plan.append(spare.pop())
                elif new < pool.num_free:
                    plan.append(None)
                    new += 1
                elif pool.block(block_id).ref_count == 1:
                    plan.append(block_id)
                    uncached.append(block_id)
                else:
                    return None
            plans.append(plan)
        sources = [table[:used] for table in tables]
        for block_id in uncached:
            pool.forget(block_id)
        dests = []  # group by group, as the runner moves them: a group's new blocks are never a later group's sources
        for table, plan in zip(tables, plans):
            for block_id in table:
                if block_id not in plan:
                    pool.release(block_id)
            dests.append([pool.allocate() if b is None else b for b in plan])
        seq.block_tables.assign(dests)
        return sources, dests

    def pack_aged(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """kivi2: move each sequence's residual blocks that are now old enough to main blocks, while the pool
        has room (the rest wait for a later step); returns (residual block, main block) pairs to pack."""
        if not self.residual:
            return []
        packs = []
        for seq in seqs:
            for i in range(seq.num_packed_blocks, self._packable(seq)):
                if self.pool.num_free < self.num_groups:
                    return packs
                for table in seq.block_tables:
                    src, table[i] = int(table[i]), self.pool.allocate()
                    packs.append((src, int(table[i])))
                    self.residual.release(src)
                seq.num_packed_blocks = i + 1
                if self.enable_prefix_caching:
                    self._hash_full_blocks(seq)
                    self._register(seq, i)
        return packs

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Give `child` the parent's computed prompt (the parent may have computed guessed tokens past it in the
        same step): full blocks shared (ref counts), the partly filled last block copied, since both will write
        into it (copy on write). Returns the (source, copy) blocks for the runner to copy; None, changing nothing,
        if the pool has no block for the copy."""
        full, partial = divmod(min(parent.num_computed_tokens, parent.num_prompt_tokens), self.block_size)
        copies = []
        if partial:
            pool = self.pool_of(int(parent.block_tables[0][full]))
            if pool.num_free < self.num_groups:
                return None
            copies = [(int(table[full]), pool.allocate()) for table in parent.block_tables]
        shared = parent.block_tables.ids[:, :full]
        for block_id in shared.ravel().tolist():
            if block_id != NULL:
                self.pool_of(block_id).take(block_id)
        child.block_tables.extend(np.concatenate([shared, [[copy] for _, copy in copies]], 1) if copies else shared)
        child.block_hashes = parent.block_hashes[:full]
        child.num_hashed_blocks, child.num_packed_blocks = min(parent.num_hashed_blocks, full), min(parent.num_packed_blocks, full)
        child.num_computed_tokens, child.num_shared_tokens = full * self.block_size + partial, full * self.block_size
        return copies

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks past the one its next token goes to (rejected guesses filled them)."""
        for removed in seq.block_tables.truncate(-(-(seq.num_slots + 1) // self.block_size)):
            for block_id in reversed(removed):
                self.pool_of(block_id).release(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are full of computed tokens in the prefix cache (kivi2: at packing)."""
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if not self.enable_prefix_caching or self.residual or seq.num_evicted_tokens or full <= seq.num_hashed_blocks:
            return
        self._hash_full_blocks(seq)
        for i in range(seq.num_hashed_blocks, full):
            self._register(seq, i)
        seq.num_hashed_blocks = full

    def free(self, seq: Sequence) -> None:
        for block_id, _ in seq.tier_loads:  # never loaded (the sequence was not admitted): the values are not there
            self.pool.forget(block_id)
        seq.tier_loads = []
        # Tail blocks go to the free queue first, so they are evicted before the prefix they extend.
        for removed in seq.block_tables.truncate(0):
            for block_id in reversed(removed):
                if block_id != NULL:
                    self.pool_of(block_id).release(block_id)
        seq.num_hashed_blocks = seq.num_packed_blocks = 0

    def swap_out(self, seq: Sequence) -> list[int]:
        """Free the sequence's blocks, remembering which pool each came from (None: a NULL entry); returns the
        blocks whose values must be copied out first (those of computed tokens, every group in turn)."""
        tables = seq.block_tables.ids[:, :-(-seq.num_slots // self.block_size)].tolist()
        ids = [block_id for table in tables for block_id in table if block_id != NULL]
        seq.swapped_kinds = [[None if b == NULL else self.residual is not None and b in self.residual for b in table]
                             for table in tables]
        self.free(seq)
        return ids

    def swap_in(self, seq: Sequence) -> list[int] | None:
        """Blocks for a swapped-out sequence's values, from the pools they came from, in swap_out's order;
        None, changing nothing, if a pool is short."""
        kinds = seq.swapped_kinds
        residual_needed = sum(k is True for ks in kinds for k in ks)
        if sum(k is False for ks in kinds for k in ks) > self.pool.num_free or \
                (self.residual and residual_needed > self.residual.num_free):
            return None
        tables = [[NULL if is_residual is None else (self.residual if is_residual else self.pool).allocate() for is_residual in table_kinds]
                  for table_kinds in kinds]
        seq.block_tables.extend(tables)
        ids = [block_id for table in tables for block_id in table if block_id != NULL]
        seq.num_packed_blocks = next((i for i, r in enumerate(kinds[0]) if r), len(kinds[0]))
        seq.swapped_kinds = None
        return ids

    def kv_bytes(self, seqs: list[Sequence]) -> int:
        """Bytes a request's computed tokens take in the cache (blocks its completions share, once)."""
        total, layout = 0.0, self.layout
        for seq in seqs:
            computed = seq.num_slots
            shared = min(seq.num_shared_tokens, computed)
            if not self.residual:
                total += layout.bytes_held(computed) - layout.bytes_held(shared)
                continue
            own = computed - shared
            residual = min(own, computed - min(seq.num_packed_blocks * self.block_size, computed))
            total += (own - residual) * layout.bytes_per_token + residual * layout.residual_bytes_per_token
        return int(total)

    def usage(self) -> dict[str, int]:
        """Blocks and bytes of the pools, now."""
        pool, block_bytes = self.pool, self.layout.block_bytes()
        usage = {"num_blocks": pool.num_blocks, "used_blocks": pool.num_used, "cached_blocks": pool.num_cached_free,
                 "free_blocks": pool.num_free - pool.num_cached_free, "used_bytes": pool.num_used * block_bytes,
                 "free_bytes": pool.num_free * block_bytes, "total_bytes": pool.num_blocks * block_bytes}
        if self.residual:
            res, res_bytes = self.residual, self.layout.block_bytes(residual=True)
            usage.update(residual_blocks=res.num_blocks, residual_used_blocks=res.num_used)
            usage["used_bytes"] += res.num_used * res_bytes
            usage["free_bytes"] += res.num_free * res_bytes
            usage["total_bytes"] += res.num_blocks * res_bytes
        return usage

    def _packable(self, seq: Sequence) -> int:
        """Leading logical blocks whose tokens are all residual_tokens older than the newest computed one."""
        if not self.residual:
            return 0
        return max(0, (seq.num_computed_tokens - self.layout.residual_tokens) // self.block_size)

    def _register(self, seq: Sequence, i: int) -> None:
        tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
        for g, block_id in enumerate(seq.block_tables.ids[:, i].tolist()):
            key = _group_key(seq.block_hashes[i], g)
            if block_id != NULL and self.pool.register(block_id, key, tokens) and self.tiers is not None and key not in self.tiers:
                self.saves.append((block_id, key, tokens))

    def pool_of(self, block_id: int) -> BlockPool:
        """The pool a block id belongs to: the main one, or the residual one whose ids follow it."""
        return self.pool if block_id in self.pool else self.residual

    def _hash_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else self.salt + (seq.params.cache_salt or "").encode()
            tokens = array("q", seq.token_ids[i * bs:(i + 1) * bs]).tobytes()
            seq.block_hashes.append(hashlib.sha256(parent + tokens).digest())


def _group_key(block_hash: bytes, group: int) -> bytes:
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
