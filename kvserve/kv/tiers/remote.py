"""A KV tier in Redis (`redis://HOST:PORT[/DB]`): blocks under `kvserve:<key>`, shared by every engine that reaches
the server and runs the same model (the key's hash chain starts from a sha256 of its files, so copies elsewhere
match). The server bounds it (maxmemory with an LRU policy); a server that goes away costs lookups and saves, never a
request. Saves go out on a thread of their own: a block is a round trip and its bytes (~0.4 ms for SmolLM2's
368 KB to a local server; milliseconds over a network), which the engine's steps need not wait for."""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

from kvserve.errors import KVServeError

log = logging.getLogger("kvserve.tiers")
PREFIX = b"kvserve:"
RETRY_S = 5.0  # after a failed call, calls return nothing this long: each would wait out the socket timeout on the engine thread
MAX_UNSENT = 256  # blocks waiting to be sent; a save past them (the server slower than the steps) is dropped
_stores: weakref.WeakSet[RedisStore] = weakref.WeakSet()


class RedisStore:
    capacity = None  # the server's maxmemory bounds it

    def __init__(self, url: str):
        try:
            import redis
        except ImportError as e:
            raise KVServeError("a redis KV tier needs the redis package: pip install redis") from e
        self.url, self.errors = url, redis.RedisError
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
            self.client.ping()
        except (ValueError, redis.RedisError) as e:
            raise KVServeError(f"KV tier {url}: {e}") from e
        self.failing_since: float | None = None
        self.unsent: dict[bytes, bytes] = {}  # saved, not yet sent; the sender sends the oldest first
        self.lock = threading.Lock()  # unsent and sender: the engine's thread adds, the sender's removes
        self.sender: threading.Thread | None = None  # runs while anything is unsent
        _stores.add(self)

    def __str__(self) -> str:
        return self.url

    def describe(self) -> str:
        return f"{self.url} ({len(self)} keys)"

    def __len__(self) -> int:
        return self._call(self.client.dbsize) or 0

    @property
    def nbytes(self) -> int | None:
        info = self._call(self.client.info, "memory")
        return info["used_memory"] if info else None

    def __contains__(self, key: bytes) -> bool:
        with self.lock:
            if key in self.unsent:
                return True
        return bool(self._call(self.client.exists, PREFIX + key))

    def get(self, key: bytes) -> bytes | None:
        with self.lock:
            entry = self.unsent.get(key)
        return entry if entry is not None else self._call(self.client.get, PREFIX + key)

    def put(self, key: bytes, entry: bytes) -> None:
        with self.lock:
            if len(self.unsent) < MAX_UNSENT:
                self.unsent.setdefault(key, entry)
            if self.sender is None:
                self.sender = threading.Thread(target=self._send, name="kvserve-redis-tier", daemon=True)
                self.sender.start()

    def _send(self) -> None:
        while True:
            with self.lock:
                if not self.unsent:
                    self.sender = None
                    return
                key, entry = next(iter(self.unsent.items()))
            self._call(self.client.set, PREFIX + key, entry, nx=True)  # a failing server: dropped
            with self.lock:
                del self.unsent[key]

    def flush(self) -> None:
        """Wait until every save is sent (or dropped by a failing server)."""
        while (sender := self.sender) is not None:
            sender.join()

    def _call(self, method, *args, **kwargs):
        """The call's result, or None where the server failed (said once, until it answers again) or failed less
        than RETRY_S ago."""
        if self.failing_since is not None and time.monotonic() - self.failing_since < RETRY_S:
            return None
        try:
            result = method(*args, **kwargs)
        except self.errors as e:
            if self.failing_since is None:
                log.warning("KV tier %s: %s; going on without it, trying again every %.0f s", self.url, e, RETRY_S)
            self.failing_since = time.monotonic()
            return None
        self.failing_since = None
        return result


@atexit.register
def _flush_all() -> None:  # a daemon thread dies with the process: what it had not sent would be lost
    for store in list(_stores):
        store.flush()
