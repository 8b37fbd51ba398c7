"""KV tiers: the prefix cache's full blocks, saved past the pool to larger, slower stores (CPU RAM, a local
disk, a Redis server), keyed by the block's chained hash (which names the model, the layout and every token
before it), so a later prompt that starts with the same tokens loads them into the pool instead of computing
them again, also after the pool evicted them, and with a disk or Redis tier after a restart.

A block is saved once, when it becomes full of computed tokens (write-through: what a disk holds survives the
process), to every tier; a lookup reads the first tier that holds it and copies it into the faster ones.
Each tier keeps its most recently used blocks within its size (Redis: within the server's maxmemory).
`--kv-tier cpu:4GiB --kv-tier disk:DIR:20GiB --kv-tier redis://HOST:6379`.
"""
from __future__ import annotations

from array import array

from kvserve.config import parse_size
from kvserve.errors import KVServeError
from kvserve.kv.tiers.disk import DiskStore
from kvserve.kv.tiers.host import HostStore
from kvserve.kv.tiers.remote import RedisStore


def parse_tier(spec: str) -> HostStore | DiskStore | RedisStore:
    """`cpu:SIZE`, `disk:DIR[:SIZE]` (a disk tier without a size: 10GiB) or `redis://HOST:PORT[/DB]`."""
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec)
    kind, _, rest = spec.partition(":")
    if kind == "cpu" and rest:
        return HostStore(parse_size(rest))
    if kind == "disk" and rest:
        directory, colon, size = rest.rpartition(":")
        if not colon or not size[:1].isdigit():
            directory, size = rest, "10GiB"
        return DiskStore(directory, parse_size(size))
    raise KVServeError(f"unknown KV tier {spec!r}: use cpu:SIZE (e.g. cpu:4GiB), disk:DIR[:SIZE] (e.g. disk:/var/kv:20GiB) "
                       f"or redis://HOST:PORT[/DB]")


class Tiers:
    """The tiers in order, fastest first. A block's entry is its tokens (checked on load: a hash names them) and
    its values, `block_bytes` bytes as the KV cache lays out one block of every layer."""

    def __init__(self, specs: list[str], block_bytes: int):
        self.stores = [parse_tier(spec) for spec in specs]
        self.block_bytes = block_bytes
        for store in self.stores:
            if store.capacity is not None and store.capacity < block_bytes:
                raise KVServeError(f"KV tier {store} holds less than one block ({block_bytes} bytes)")

    def __contains__(self, key: bytes) -> bool:
        return any(key in store for store in self.stores)

    def save(self, key: bytes, tokens: tuple[int, ...], values: bytes) -> None:
        entry = array("q", tokens).tobytes() + values
        for store in self.stores:
            store.put(key, entry)

    def load(self, key: bytes, tokens: tuple[int, ...]) -> bytes | None:
        """The block's values, if a tier holds exactly these tokens under this key."""
        header = array("q", tokens).tobytes()
        for i, store in enumerate(self.stores):
            entry = store.get(key)
            if entry is None or len(entry) != len(header) + self.block_bytes or not entry.startswith(header):
                continue
            for faster in self.stores[:i]:
                faster.put(key, entry)
            return entry[len(header):]
        return None

    def describe(self) -> str:
        """E.g. "KV tiers cpu 4096 MiB (0 blocks held), disk /var/kv 20480 MiB (312 blocks held)"."""
        return "KV tiers " + ", ".join(store.describe() for store in self.stores)

    def usage(self) -> list[dict]:
        return [{"tier": str(store), "blocks": len(store), "bytes": store.nbytes, "capacity_bytes": store.capacity} for store in self.stores]
