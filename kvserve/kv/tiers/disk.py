"""A KV tier on a local disk: one file per block, named by its key, the most recently used within a size. What
a directory holds at start is indexed (oldest access first), so a restarted engine finds its blocks again."""
from __future__ import annotations

import os
from pathlib import Path

from kvserve.errors import KVServeError
from kvserve.kv.tiers.lru import LRUStore

SUFFIX, PARTIAL = ".kvblock", ".partial"


class DiskStore(LRUStore):
    def __init__(self, directory: str, capacity: int):
        super().__init__(capacity)
        self.directory = Path(directory)
        self.name = f"disk {self.directory}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for partial in self.directory.glob("*" + PARTIAL):  # half a write a crash left behind: never read, never freed
                if not _writer_alive(partial):
                    partial.unlink(missing_ok=True)
            found = sorted((entry.stat().st_atime_ns, entry.name, entry.stat().st_size) for entry in os.scandir(self.directory)
                           if entry.name.endswith(SUFFIX) and entry.is_file())
        except OSError as e:
            raise KVServeError(f"KV tier directory {directory}: {e}") from e
        for _, name, size in found:
            try:
                self.sizes[bytes.fromhex(name.removesuffix(SUFFIX))] = size
            except ValueError:  # not a name this store wrote
                continue
        self.nbytes = sum(self.sizes.values())
        self._shrink(0)

    def __str__(self) -> str:
        return f"disk:{self.directory}:{self.capacity}"

    def _load(self, key: bytes) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except OSError:
            return None

    def _store(self, key: bytes, entry: bytes) -> bool:
        path = self._path(key)
        partial = path.with_suffix(f".{os.getpid()}{PARTIAL}")  # each writer its own: engines may share a directory
        try:
            partial.write_bytes(entry)
            partial.replace(path)  # a reader never sees half a block
        except OSError:  # a full disk loses the block, not the request
            partial.unlink(missing_ok=True)
            return False
        return True

    def _drop(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)


def _writer_alive(partial: Path) -> bool:
    """Whether the process named in a `KEY.PID.partial` may still be writing it (another engine on this directory)."""
    _, dot, pid = partial.name.removesuffix(PARTIAL).rpartition(".")
    if not dot or not pid.isdigit() or not 0 < int(pid) < 2**31 or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        pass
    return True
