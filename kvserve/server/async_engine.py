"""The engine loop, on a thread of its own, so the HTTP event loop never waits on model compute.

Only the thread in `run` touches the LLMEngine. Handlers send it commands (add, abort, snapshot) through
a queue and receive each request's outputs on an asyncio queue, filled with call_soon_threadsafe.
`kvserve serve` runs the loop on the main thread and HTTP on another: torch's OpenMP pool belongs to the
thread that first ran an op (the one that loaded the model), and a second thread running ops makes a
second pool, oversubscribes the cores and made every step ~15% slower.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future

from kvserve.engine.llm_engine import LLMEngine
from kvserve.kv.block_table import NULL
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.metrics import Metrics

log = logging.getLogger("kvserve.server")

METRICS_PERIOD_S = 0.05  # gauges and scheduler counters follow the engine at most this late (updating them took ~30 us a step)


class QueueFullError(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class EngineDeadError(Exception):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics, max_waiting: int = 256):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self.usage_history: deque[tuple[float, float]] = deque(maxlen=240)
        self.recent = RecentStats()
        self._flushed = 0.0  # when the gauges and scheduler counters last caught up

    def stop(self) -> None:
        """End `run` after the step in progress; commands sent before it starts wait for it."""
        self._stop.set()
        self._commands.put(("wake",))

    @property
    def alive(self) -> bool:
        return not self._stop.is_set()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    async def generate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as its tokens arrive; leaving early (a disconnect) aborts it.

        The caller has validated the request and checked the waiting bound (see `check_capacity`)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", request_id, token_ids, params))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def check_capacity(self, new_requests: int) -> None:
        if self.num_waiting + new_requests > self.max_waiting:
            raise QueueFullError(f"the server is busy: {self.num_waiting} requests are waiting (limit {self.max_waiting})")

    async def snapshot(self) -> dict:
        """The block pool as the engine thread sees it between two steps."""
        future: Future = Future()
        self._commands.put(("snapshot", future))
        return await asyncio.wrap_future(future)

    def run(self) -> None:
        """Step the engine until `stop`; blocks the calling thread, which alone runs the model."""
        try:
            while not self._stop.is_set():
                self._handle_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set() or not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug must fail the requests in flight, not kill the server
                    log.exception("engine step failed")
                    self._fail_all(e)
                    continue
                self._deliver(outputs)
        finally:
            self._stop.set()

    def _handle_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            while True:
                self._handle(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, token_ids, params = command
            if request_id not in self._streams:  # the client left before the engine saw it
                return
            try:
                self.engine.add_request(token_ids, params, request_id=request_id)
                self.metrics.prompt_tokens.inc(len(token_ids))
            except Exception as e:
                self._send([(request_id, e)])
        elif kind == "abort":
            if command[1] in self.engine.requests:
                self._abort(command[1])
                self.metrics.record_finished("abort")
                self._flush_metrics()
        elif kind == "snapshot":
            command[1].set_result(self._snapshot())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            m = out.metrics
            if out.request_id not in self.recent.last_token:  # its first tokens
                self.metrics.ttft.observe(m.ttft)
                self.metrics.queue_time.observe(m.queue_time or 0.0)
                self.recent.ttft.append(m.ttft)
            else:
                gap = now - self.recent.last_token[out.request_id]
                self.metrics.itl.observe(gap)
                self.recent.itl.append(gap)
            self.recent.last_token[out.request_id] = now
            self.recent.token_times.append(now)
            if out.finished:
                self.metrics.e2e.observe(m.e2e_latency)
                for c in out.outputs:
                    self.metrics.record_finished(c.finish_reason)
                self.recent.last_token.pop(out.request_id, None)
        self._send([(out.request_id, out) for out in outputs])
        self.metrics.generation_tokens.inc(sum(len(c.new_token_ids) for out in outputs for c in out.outputs))
        if now - self._flushed >= METRICS_PERIOD_S or any(out.finished for out in outputs):
            self._flush_metrics()

    def _flush_metrics(self) -> None:
        """The scheduler's counters and the gauges, as of now."""
        self._flushed = time.perf_counter()
        self.metrics.record_stats(self.engine.scheduler.stats)
        usage = self.engine.kv_manager.usage()  # the pool only: a Redis tier's counts would cost round trips here
        share = usage["used_blocks"] / usage["num_blocks"]
        self.metrics.kv_usage.set(share)
        self.metrics.kv_used_bytes.set(usage["used_bytes"])
        self.metrics.running.set(len(self.engine.scheduler.running))
        self.metrics.waiting.set(len(self.engine.scheduler.waiting))
        now = time.time()
        if not self.usage_history or now - self.usage_history[-1][0] >= 0.25:
            self.usage_history.append((now, share))

    def _fail_all(self, error: Exception) -> None:
        failed = list(self.engine.requests)
        for request_id in failed:
            self._abort(request_id)
        self._send([(r, EngineDeadError(f"the engine failed on this request's step: {error}")) for r in failed])
        self._flush_metrics()

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.recent.last_token.pop(request_id, None)  # else every aborted request would stay in it

    def _send(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        """Hand items to their requests' streams: one wake-up per event loop, not one per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _snapshot(self) -> dict:
        """The pool's blocks (ids: the main pool's, then the residual pool's) that are held or cached; the others are
        free. Only those are listed: it runs on the engine thread, and a dict per block of a small model's pool
        (262,144 blocks in 1 GiB) took 4 s a snapshot and 19 MB of JSON."""
        engine, kv = self.engine, self.engine.kv_manager
        owners: dict[int, list[str]] = {}
        compacted = set()  # blocks of requests whose policy evicted tokens: they hold the kept ones, not a run of positions
        for seq in (s for seqs in engine.requests.values() for s in seqs):
            for block_id in set(seq.block_tables.ids.ravel().tolist()) - {NULL}:  # NULL: a block a sliding window gave back
                owners.setdefault(block_id, []).append(seq.request_id)
                if seq.num_evicted_tokens:
                    compacted.add(block_id)
        pools = [kv.pool] + ([kv.residual] if kv.residual else [])
        listed = [kv.pool_of(i).block(i) for i in sorted(set(owners) | {i for pool in pools for i in pool.cached.values()})]
        blocks = [{"id": b.id, "owners": owners.get(b.id, []), "ref": b.ref_count, "cached": b.hash is not None,
                   "compacted": b.id in compacted} for b in listed]
        grid = {"blocks": sum(pool.num_blocks for pool in pools), "residual_from": kv.pool.num_blocks}
        layout = {**engine.layout.to_dict(), "description": engine.layout.describe(),
                  "tiers": engine.tiers.describe() if engine.tiers is not None else ""}
        return {"blocks": blocks, "grid": grid, "block_size": kv.block_size, "layout": layout, "usage": engine.kv_usage(),
                "evicted_tokens": engine.scheduler.stats.num_evicted_tokens, "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "history": list(self.usage_history), **self.recent.summary()}


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for outputs, out in items:
        outputs.put_nowait(out)


class RecentStats:
    """Rolling TTFT, inter-token latency and tokens/s for the live page."""

    def __init__(self):
        self.ttft: deque[float] = deque(maxlen=50)
        self.itl: deque[float] = deque(maxlen=500)
        self.token_times: deque[float] = deque(maxlen=5000)
        self.last_token: dict[str, float] = {}

    def summary(self) -> dict:
        now = time.perf_counter()
        window = [t for t in self.token_times if now - t <= 5.0]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {"ttft_s": mean(self.ttft), "itl_s": mean(self.itl), "tokens_per_s": len(window) / 5.0}
