"""A KV tier in CPU RAM: the most recently used blocks within a size."""
from __future__ import annotations

from collections import OrderedDict


class HostStore:
    def __init__(self, capacity: int):
        self.capacity, self.nbytes = capacity, 0
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first

    def __str__(self) -> str:
        return f"cpu:{self.capacity}"

    def describe(self) -> str:
        return f"cpu {self.capacity / 2**20:.0f} MiB ({len(self)} blocks held)"

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> bytes | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: bytes) -> None:
        if key in self.entries or len(entry) > self.capacity:
            return
        while self.nbytes + len(entry) > self.capacity:
            self.nbytes -= len(self.entries.popitem(last=False)[1])
        self.entries[key] = entry
        self.nbytes += len(entry)
