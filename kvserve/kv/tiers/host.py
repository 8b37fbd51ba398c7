"""A KV tier in CPU RAM: the most recently used blocks within a size."""
from __future__ import annotations

from kvserve.kv.tiers.lru import LRUStore


class HostStore(LRUStore):
    name = "cpu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.entries: dict[bytes, bytes] = {}

    def __str__(self) -> str:
        return f"cpu:{self.capacity}"

    def _load(self, key: bytes) -> bytes | None:
        return self.entries.get(key)

    def _store(self, key: bytes, entry: bytes) -> bool:
        self.entries[key] = entry
        return True

    def _drop(self, key: bytes) -> None:
        del self.entries[key]
