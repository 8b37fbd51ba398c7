"""A KV tier on a local disk: one file per block, named by its key, the most recently used within a size. What
a directory holds at start is indexed (oldest access first), so a restarted engine finds its blocks again."""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from kvserve.errors import KVServeError

SUFFIX = ".kvblock"


class DiskStore:
    def __init__(self, directory: str, capacity: int):
        self.directory, self.capacity = Path(directory), capacity
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            found = sorted((entry.stat().st_atime_ns, entry.name, entry.stat().st_size) for entry in os.scandir(self.directory)
                           if entry.name.endswith(SUFFIX) and entry.is_file())
        except OSError as e:
            raise KVServeError(f"KV tier directory {directory}: {e}") from e
        self.sizes: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        for _, name, size in found:
            try:
                self.sizes[bytes.fromhex(name.removesuffix(SUFFIX))] = size
            except ValueError:  # not a name this store wrote
                continue
        self.nbytes = sum(self.sizes.values())
        self._shrink(0)

    def __str__(self) -> str:
        return f"disk:{self.directory}:{self.capacity}"

    def describe(self) -> str:
        return f"disk {self.directory} {self.capacity / 2**20:.0f} MiB ({len(self)} blocks held)"

    def __len__(self) -> int:
        return len(self.sizes)

    def __contains__(self, key: bytes) -> bool:
        return key in self.sizes

    def get(self, key: bytes) -> bytes | None:
        if key not in self.sizes:
            return None
        try:
            entry = self._path(key).read_bytes()
        except OSError:  # removed behind our back
            self.nbytes -= self.sizes.pop(key)
            return None
        self.sizes.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: bytes) -> None:
        if key in self.sizes or len(entry) > self.capacity:
            return
        self._shrink(len(entry))
        path = self._path(key)
        partial = path.with_suffix(".partial")
        try:
            partial.write_bytes(entry)
            partial.replace(path)  # a reader never sees half a block
        except OSError:  # a full disk loses the block, not the request
            partial.unlink(missing_ok=True)
            return
        self.sizes[key] = len(entry)
        self.nbytes += len(entry)

    def _shrink(self, room: int) -> None:
        while self.sizes and self.nbytes + room > self.capacity:
            key, size = self.sizes.popitem(last=False)
            self._path(key).unlink(missing_ok=True)
            self.nbytes -= size

    def _path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)
