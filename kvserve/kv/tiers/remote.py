"""A KV tier in Redis (`redis://HOST:PORT[/DB]`): blocks under `kvserve:<key>`, shared by every engine that reaches
the server and runs the same model (the key's hash chain starts from a sha256 of its files, so copies elsewhere
match). The server bounds it (maxmemory with an LRU policy); a server that goes away costs lookups and saves, never a
request."""
from __future__ import annotations

import logging
import time

from kvserve.errors import KVServeError

log = logging.getLogger("kvserve.tiers")
PREFIX = b"kvserve:"
RETRY_S = 5.0  # after a failed call, calls return nothing this long: each would wait out the socket timeout on the engine thread


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
        return bool(self._call(self.client.exists, PREFIX + key))

    def get(self, key: bytes) -> bytes | None:
        return self._call(self.client.get, PREFIX + key)

    def put(self, key: bytes, entry: bytes) -> None:
        self._call(self.client.set, PREFIX + key, entry, nx=True)

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
