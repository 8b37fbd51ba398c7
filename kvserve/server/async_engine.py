"""The HTTP process's side of the engine: it starts the engine process, sends it requests and hands each request's
outputs to its stream, and keeps the metrics.

The engine runs in a process of its own (kvserve.server.engine_core). On a thread of the HTTP process, one client's
stream ran at 0.87 of the offline engine's pace on 2 cores: HTTP's Python held the GIL the engine's steps needed,
and pinning threads could not help. Apart, on Linux the engine's OpenMP threads are bound one to a core and the
HTTP process is placed on the last one's core: the engine's one-threaded phases (Python between kernels, sampling)
leave that core idle, and HTTP's work fits there (a process consuming 400 us a token slowed the offline engine by
11-13% left to float, by 4-6% placed so). A user's own OMP_PROC_BIND or OMP_PLACES turns the placement off.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from kvserve.config import EngineConfig
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server import engine_core
from kvserve.server.engine_core import EngineDeadError, EngineFacts, from_wire
from kvserve.server.metrics import Metrics

BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


class AsyncEngine:
    def __init__(self, process, commands, events, facts: EngineFacts, metrics: Metrics, max_waiting: int):
        self.process, self.events = process, events
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # commands, written by a thread of their own: a
        # prompt bigger than the pipe holds would block the event loop until the engine read it, while the engine
        # could be blocked writing outputs bigger than the pipe holds, which only the event loop reads
        self._writer = threading.Thread(target=_write, args=(self._outbox, commands), name="kvserve-commands", daemon=True)
        self._writer.start()
        self.facts, self.metrics, self.max_waiting = facts, metrics, max_waiting
        self._streams: dict[str, asyncio.Queue] = {}
        self._last: dict[str, RequestOutput] = {}  # each running request's latest output, which the next one extends
        self._replies: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._alive = True
        self.usage_history: deque[tuple[float, float]] = deque(maxlen=240)
        self.recent = RecentStats()
        self._gaps: list[float] = []  # inter-token gaps and tokens not yet in the metrics
        self._new_tokens = 0

    @classmethod
    def start(cls, config: EngineConfig, model_name: str, max_waiting: int = 256, make_engine: Callable | None = None,
              describe: Callable | None = None, place: bool = False, stream_interval: int = 1) -> AsyncEngine:
        """Start the engine process and wait until it has loaded (its KVServeError if it could not).

        make_engine(config) builds the engine there (default LLMEngine); describe(engine) words the startup line;
        place: bind the engine's OpenMP threads to cores and move this whole process to the last one's (Linux, more
        than one CPU, OMP_PROC_BIND and OMP_PLACES unset), as `kvserve serve` does; stream_interval: a request's
        outputs come merged, every that many steps (its first and last at once)."""
        context = multiprocessing.get_context("spawn")  # a forked child would inherit torch's threads half-made
        commands, child_commands = context.Pipe(duplex=False)[::-1]
        child_events, events = context.Pipe(duplex=False)[::-1]
        process = context.Process(target=engine_core.main, name="kvserve-engine", daemon=True,
                                  args=(config, child_commands, child_events, max_waiting, stream_interval, make_engine, describe))
        cpu = _http_cpu() if place else None
        with _environment(BINDING if cpu is not None else {}):
            process.start()
        child_commands.close()  # only the child's copies remain: its exit shows here as the end of the events pipe
        child_events.close()
        try:
            kind, value = events.recv()
        except EOFError:
            process.join()
            raise EngineDeadError(f"the engine process exited with code {process.exitcode} while loading") from None
        if kind == "failed":
            process.join()
            raise value
        if cpu is not None:
            _pin_process(cpu)
        return cls(process, commands, events, value, Metrics(model_name, value.layout, value.kv_total_bytes), max_waiting)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the engine's messages on this event loop, which all requests' streams use."""
        self._loop = loop
        loop.add_reader(self.events.fileno(), self._receive)
        os.set_blocking(self.events.fileno(), True)  # uvloop made it non-blocking; a message can outgrow the pipe

    def stop(self) -> None:
        """Stop the engine process (after the step in progress) and wait for it; again, nothing more."""
        if self._alive:
            self._alive = False
            self._outbox.put(("stop",))
        self._outbox.put(None)
        self._detach()
        self.process.join(timeout=30)
        if self.process.is_alive():  # stuck, or blocked writing outputs no one reads now
            self.process.kill()
            self.process.join()
        self._writer.join()  # its last send has gone, or failed with the process gone

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.events.fileno())
        self._loop = None

    @property
    def alive(self) -> bool:
        return self._alive

    async def add(self, jobs: list[tuple[str, list[int], SamplingParams]]) -> list[AsyncIterator[tuple[int, RequestOutput]]]:
        """Start one HTTP request's engine requests (request id, prompt token ids, params), all or none; each one's
        outputs as they arrive, with its place in `jobs`. The engine validates them: its KVServeError, or
        QueueFullError at the waiting bound."""
        queues = [asyncio.Queue() for _ in jobs]
        self._streams.update((request_id, q) for (request_id, _, _), q in zip(jobs, queues))
        try:
            await self._call("add", jobs)
        except BaseException:
            for request_id, _, _ in jobs:  # if the client left while the engine took them, their outputs abort them
                self._streams.pop(request_id, None)
            raise
        self.metrics.prompt_tokens.inc(sum(len(ids) for _, ids, _ in jobs))
        return [self._stream(request_id, q, index) for index, ((request_id, _, _), q) in enumerate(zip(jobs, queues))]

    async def snapshot(self) -> dict:
        """The block pool as the engine sees it between two steps, with the recent latencies."""
        return {**await self._call("snapshot"), "history": list(self.usage_history), **self.recent.summary()}

    async def _stream(self, request_id: str, outputs: asyncio.Queue, index: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Leaving early (a disconnect) aborts the request."""
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield index, out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._last.pop(request_id, None)
                self.recent.last_token.pop(request_id, None)
                self._send(("abort", request_id))

    async def _call(self, kind: str, *args):
        if not self._alive:
            raise EngineDeadError("the engine is not running")
        key = next(self._keys)
        self._replies[key] = reply = asyncio.get_running_loop().create_future()
        self._send((kind, key, *args))
        result = await reply
        if isinstance(result, Exception):
            raise result
        return result

    def _send(self, command: tuple) -> None:
        if self._alive:
            self._outbox.put(command)

    def _receive(self) -> None:
        """A message from the engine; the event loop calls again while more wait (no Connection.poll, which builds a
        selector a call)."""
        try:
            message = self.events.recv()
        except (EOFError, OSError):
            self._died()
            return
        if message[0] == "step":
            self._deliver(*message[1:])
        elif message[0] == "reply":
            future = self._replies.pop(message[1])
            if not future.done():
                future.set_result(message[2])
        elif message[0] == "lost":
            for request_id, error in message[1]:
                self._last.pop(request_id, None)
                self._put(request_id, EngineDeadError(error))

    def _deliver(self, wired: list[tuple], stats: dict | None, aborted: int) -> None:
        now, m, last = time.perf_counter(), self.metrics, self._last
        for item in wired:
            request_id, finished, completions = item[:3]
            self._new_tokens += sum(len(c[1]) for c in completions)  # each completion's new token ids
            if request_id not in self._streams:  # its client left (its last output went with its stream), perhaps
                if not finished:  # before its stream was read
                    self._send(("abort", request_id))
                continue
            out = from_wire(item, last.pop(request_id, None))
            if not out.finished:
                last[request_id] = out
            self._record(out, now, item[4])
            self._put(request_id, out)
        for _ in range(aborted):
            m.record_finished("abort")
        if stats is not None:
            self._record_stats(stats)

    def _put(self, request_id: str, item: RequestOutput | Exception) -> None:
        """To the request's stream; a finished request's entry goes (its stream may never have been read)."""
        done = isinstance(item, Exception) or item.finished
        outputs = self._streams.pop(request_id, None) if done else self._streams.get(request_id)
        if outputs is not None:
            outputs.put_nowait(item)

    def _record(self, out: RequestOutput, now: float, steps: int) -> None:
        """One output, which holds `steps` steps' tokens (merged by the stream interval): each step's gap is their
        share of the time since the request's last output."""
        m, recent = self.metrics, self.recent
        if out.request_id not in recent.last_token:  # its first tokens
            m.ttft.observe(out.metrics.ttft)
            m.queue_time.observe(out.metrics.queue_time or 0.0)
            recent.ttft.append(out.metrics.ttft)
        else:
            gaps = [(now - recent.last_token[out.request_id]) / steps] * steps
            self._gaps += gaps
            recent.itl.extend(gaps)
        recent.last_token[out.request_id] = now
        recent.token_times.extend([now] * steps)
        if out.finished:
            m.e2e.observe(out.metrics.e2e_latency)
            for c in out.outputs:
                m.record_finished(c.finish_reason)
            recent.last_token.pop(out.request_id, None)

    def _record_stats(self, stats: dict) -> None:
        """The engine's counters and gauges, and the tokens and gaps seen since the last stats: observed together,
        not a token at a time with the caches the engine's step emptied."""
        m, usage = self.metrics, stats["usage"]
        for gap in self._gaps:
            m.itl.observe(gap)
        m.generation_tokens.inc(self._new_tokens)
        self._gaps, self._new_tokens = [], 0
        m.record_stats(stats["scheduler"])
        share = usage["used_blocks"] / usage["num_blocks"]
        m.kv_usage.set(share)
        m.kv_used_bytes.set(usage["used_bytes"])
        m.running.set(stats["running"])
        m.waiting.set(stats["waiting"])
        now = time.time()
        if not self.usage_history or now - self.usage_history[-1][0] >= 0.25:
            self.usage_history.append((now, share))

    def _died(self) -> None:
        """The engine process is gone: every request in flight and every call waiting fails."""
        self._alive = False
        self._detach()
        self.process.join(timeout=1)  # it closed its end: it is on its way out
        error = EngineDeadError(f"the engine process exited (code {self.process.exitcode})")
        self._last.clear()
        for request_id in list(self._streams):
            self._put(request_id, error)
        for future in self._replies.values():
            if not future.done():
                future.set_result(error)
        self._replies.clear()


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


def _write(outbox: queue.SimpleQueue, commands) -> None:
    """Send the commands put in `outbox` until None (or the engine is gone: the event loop sees its pipe close)."""
    while (command := outbox.get()) is not None:
        try:
            commands.send(command)
        except OSError:
            return


def _http_cpu() -> int | None:
    """The CPU the HTTP process goes to (the last one it may use), or None: not Linux, one CPU, or the user placed
    OpenMP's threads."""
    if not hasattr(os, "sched_setaffinity") or any(name in os.environ for name in BINDING):
        return None
    cpus = os.sched_getaffinity(0)
    return max(cpus) if len(cpus) > 1 else None


def _pin_process(cpu: int) -> None:
    """All of this process's threads to one CPU (os.sched_setaffinity(0) moves only the calling thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that ended meanwhile
            pass


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """os.environ with some variables set, for a child process started inside; the old values after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
