"""What the RAM and disk tiers share: keys most recently used last, within a size in bytes. A store keeps the
entries themselves (_load, _store, _drop); this keeps which ones, their sizes, and evicts the oldest for room."""
from __future__ import annotations

from collections import OrderedDict


class LRUStore:
    name = ""  # for describe()

    def __init__(self, capacity: int):
        self.capacity, self.nbytes = capacity, 0
        self.sizes: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    def describe(self) -> str:
        return f"{self.name} {self.capacity / 2**20:.0f} MiB ({len(self)} blocks held)"

    def __len__(self) -> int:
        return len(self.sizes)

    def __contains__(self, key: bytes) -> bool:
        return key in self.sizes

    def get(self, key: bytes) -> bytes | None:
        if key not in self.sizes:
            return None
        entry = self._load(key)
        if entry is None:  # gone behind our back
            self.nbytes -= self.sizes.pop(key)
            return None
        self.sizes.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: bytes) -> None:
        if key in self.sizes or len(entry) > self.capacity:
            return
        self._shrink(len(entry))
        if self._store(key, entry):
            self.sizes[key] = len(entry)
            self.nbytes += len(entry)

    def _shrink(self, room: int) -> None:
        while self.sizes and self.nbytes + room > self.capacity:
            key, size = self.sizes.popitem(last=False)
            self._drop(key)
            self.nbytes -= size

    def _load(self, key: bytes) -> bytes | None:
        raise NotImplementedError

    def _store(self, key: bytes, entry: bytes) -> bool:
        """Keep the entry; False if it could not be kept."""
        raise NotImplementedError

    def _drop(self, key: bytes) -> None:
        raise NotImplementedError
