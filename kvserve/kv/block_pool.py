"""A pool of KV blocks: reference counts, a free queue and the prefix-cache index.

Freed blocks keep their hash and stay reusable until the least-recently-freed end of the free queue hands
them out again (then their hash is evicted).
"""
from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id, self.ref_count = block_id, 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Blocks with ids first_id .. first_id + num_blocks - 1."""

    def __init__(self, num_blocks: int, first_id: int = 0):
        self.num_blocks, self.first_id = num_blocks, first_id
        self.blocks = [Block(first_id + i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(b.id for b in self.blocks)  # least recently freed first
        self.cached: dict[bytes, int] = {}
        self.num_cached_free = 0  # free blocks that still hold a cached prefix

    def __contains__(self, block_id: int) -> bool:
        return self.first_id <= block_id < self.first_id + self.num_blocks

    def block(self, block_id: int) -> Block:
        return self.blocks[block_id - self.first_id]

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached ones included (they are evicted on demand)."""
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def allocate(self) -> int:
        block = self.block(next(iter(self.free_ids)))
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash = block.token_ids = None
            self.num_cached_free -= 1
        self.take(block.id)
        return block.id

    def take(self, block_id: int) -> None:
        block = self.block(block_id)
        if block.ref_count == 0:
            del self.free_ids[block_id]
            self.num_cached_free -= block.hash is not None
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.block(block_id)
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None
            self.num_cached_free += block.hash is not None

    def forget(self, block_id: int) -> None:
        """Take a held block out of the prefix cache (its holder is about to write it)."""
        block = self.block(block_id)
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash = block.token_ids = None

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens after this prefix, if any."""
        block_id = self.cached.get(block_hash)
        return block_id if block_id is not None and self.block(block_id).token_ids == token_ids else None

    def register(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """List the block in the prefix cache under this hash; False if it or the hash is listed already."""
        block = self.block(block_id)
        if block.hash is not None or block_hash in self.cached:
            return False
        block.hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block_id
        return True
