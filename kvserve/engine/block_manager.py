"""The pool of KV blocks: allocation, reference counts and the prefix cache.

A full block's hash chains its parent block's hash with its token ids (the root mixes in the engine's
salt and the request's cache_salt), so equal hashes mean equal prefixes. Freed blocks keep their hash and
stay reusable until the LRU end of the free queue hands them out again.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from kvserve.engine.sequence import Sequence


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id, self.ref_count = block_id, 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, salt: str):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.salt = enable_prefix_caching, salt.encode()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # least recently freed first
        self.cached: dict[bytes, int] = {}
        self.num_cached_free = 0  # free blocks that still hold a cached prefix

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached ones included (they are evicted on demand)."""
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Point a new sequence's block table at the longest cached prefix; returns the tokens reused."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        self._hash_full_blocks(seq)
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):  # the last token is always computed, for its logits
            block_id = self.cached.get(seq.block_hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False (and no change) if the pool is short."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self.free_ids):
            return False
        for _ in range(needed):
            block_id = next(iter(self.free_ids))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are full of computed tokens in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_hashed_blocks:
            return
        self._hash_full_blocks(seq)
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, full):
            block, block_hash = self.blocks[seq.block_table[i]], seq.block_hashes[i]
            if block.hash is None and block_hash not in self.cached:
                block.hash, block.token_ids = block_hash, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.cached[block_hash] = block.id
        seq.num_hashed_blocks = full

    def free(self, seq: Sequence) -> None:
        # Tail blocks go to the free queue first, so they are evicted before the prefix they extend.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
                self.num_cached_free += block.hash is not None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
            self.num_cached_free -= block.hash is not None
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            self.num_cached_free -= 1
            block.hash = block.token_ids = None

    def _hash_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else self.salt + (seq.params.cache_salt or "").encode()
            tokens = array("q", seq.token_ids[i * bs:(i + 1) * bs]).tobytes()
            seq.block_hashes.append(hashlib.sha256(parent + tokens).digest())
