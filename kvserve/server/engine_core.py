"""The engine's own process under `kvserve serve`: it steps the model; the HTTP process talks to it over two pipes.

Apart, HTTP never holds the GIL a step's Python needs, and on Linux the HTTP process runs on the last OpenMP worker's
core, whose time the engine's one-threaded phases (Python between kernels, sampling) leave idle (see
kvserve.server.async_engine for the placement).

To the engine: ("add", key, [(request_id, token_ids, params), ...]), ("abort", request_id), ("snapshot", key),
("stop",). From it: ("ready", EngineFacts) or ("failed", error) once, then ("reply", key, value or error),
("step", outputs, stats or None, aborted requests) and ("lost", [(request_id, message), ...]).

With a stream interval of N steps, a request's outputs are merged and sent every N steps (its first and last at
once): one message, one SSE event and one client wake-up carry N steps' tokens. At one client on 2 cores, 4 halved
the HTTP process's CPU a token (bench/serve.py: 234 to 117 us).
"""
from __future__ import annotations

import logging
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvserve.config import EngineConfig
from kvserve.errors import KVServeError
from kvserve.kv.block_table import NULL
from kvserve.outputs import CompletionOutput, RequestOutput

log = logging.getLogger("kvserve.engine")

# Gauges and scheduler counters follow the engine at most this late (the live page charts usage every 0.25 s): at
# 0.05 s, the HTTP process spent ~25 us a token on them at one client, its caches cold after each step.
STATS_PERIOD_S = 0.25


class QueueFullError(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class EngineDeadError(Exception):
    pass


@dataclass
class EngineFacts:
    """What the HTTP process needs of the loaded engine: it tokenizes and validates shapes without the model."""
    tokenizer: object | None  # the checkpoint's (transformers) tokenizer, pickled across
    model: str
    max_request_tokens: int
    vocab_size: int
    layout: dict  # KVLayout.to_dict()'s (KVLayout holds torch's KV formats, which the HTTP process does not import)
    kv_total_bytes: int
    description: str  # how the engine describes itself on the startup line


def main(config: EngineConfig, commands: Connection, events: Connection, max_waiting: int, stream_interval: int,
         make_engine: Callable | None, describe: Callable | None) -> None:
    """The engine process: load, say so, serve commands until told to stop or the HTTP process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the HTTP process stops us
    if make_engine is None:  # imported here: the HTTP process, which names what to run, runs without torch
        from kvserve.engine.llm_engine import LLMEngine as make_engine
    try:
        engine = make_engine(config)
    except KVServeError as e:  # the HTTP process reports it, as the CLI does any bad value
        events.send(("failed", e))
        return
    except Exception as e:
        events.send(("failed", RuntimeError(f"the engine could not load: {type(e).__name__}: {e}")))
        raise
    checkpoint = engine.checkpoint
    try:
        events.send(("ready", EngineFacts(checkpoint.tokenizer, config.model, engine.max_request_tokens,
                                          checkpoint.config.vocab_size, engine.layout.to_dict(), engine.kv_usage()["total_bytes"],
                                          describe(engine) if describe else "")))
    except OSError:  # the HTTP process was stopped while we loaded: nobody to serve (this was a BrokenPipeError's traceback)
        return
    EngineCore(engine, commands, events, max_waiting, stream_interval).run()


def to_wire(out: RequestOutput, first: bool) -> tuple:
    """A step's output as the HTTP process gets it: plain tuples of what the step added (a slotted dataclass pickles
    through Python code, and every token's cumulative text and ids grew the message), the prompt's fields and the
    metrics on a request's first and last outputs, and how many steps it holds (1; more once merged). (The server never
    asks for prompt_distributions.)"""
    completions = [(c.new_text, c.new_token_ids, c.cumulative_logprob, c.finish_reason, c.stop_reason,
                    None if c.logprobs is None else c.logprobs[len(c.logprobs) - len(c.new_token_ids):]) for c in out.outputs]
    whole = (out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.metrics) if first or out.finished else None
    return out.request_id, out.finished, completions, whole, 1


def merge_wire(earlier: tuple, later: tuple) -> tuple:
    """Two consecutive outputs of a request as one, as if one step had added what both did. (The earlier one is
    never the request's first, so only the later can carry the prompt's fields.)"""
    completions = [(a[0] + b[0], a[1] + b[1], *b[2:5], None if b[5] is None else a[5] + b[5])
                   for a, b in zip(earlier[2], later[2])]
    return later[0], later[1], completions, later[3], earlier[4] + later[4]


def from_wire(item: tuple, last: RequestOutput | None) -> RequestOutput:
    """The request's output again, from what to_wire sent and its previous output."""
    request_id, finished, completions, whole, _ = item
    prompt, prompt_ids, prompt_logprobs, metrics = whole or (last.prompt, last.prompt_token_ids, last.prompt_logprobs, last.metrics)
    outputs = []
    for i, (text, ids, cumulative, reason, stop, logprobs) in enumerate(completions):
        before = last.outputs[i] if last is not None else CompletionOutput(i, "", [], None, None if logprobs is None else [], None)
        outputs.append(CompletionOutput(i, before.text + text, before.token_ids + ids, cumulative,
                                        None if logprobs is None else before.logprobs + logprobs, reason, stop, text, ids))
    return RequestOutput(request_id, prompt, prompt_ids, outputs, finished, metrics, prompt_logprobs)


class EngineCore:
    def __init__(self, engine, commands: Connection, events: Connection, max_waiting: int, stream_interval: int = 1):
        self.engine, self.commands, self.events, self.max_waiting = engine, commands, events, max_waiting
        self.stream_interval = stream_interval
        self._held: dict[str, tuple] = {}  # outputs not sent yet: fewer than stream_interval steps' worth
        self._flushed = 0.0  # when stats were last sent
        self._aborted = 0  # requests aborted since stats were last sent
        self._started: set[str] = set()  # requests that have sent outputs and not finished
        self._arrived = select.poll()  # Connection.poll builds a selector a call: tens of us a step
        self._arrived.register(commands.fileno(), select.POLLIN)

    def run(self) -> None:
        """Serve until told to stop or the HTTP process is gone (its pipes closed, mid-step too)."""
        engine = self.engine
        try:
            while self._handle_commands(block=not engine.has_unfinished_requests()):
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:  # a bug must fail the requests in flight, not kill the server
                    log.exception("engine step failed")
                    self._fail_all(e)
                    continue
                self._send_step(outputs)
        except BrokenPipeError:  # a step's outputs sent after the HTTP process ended (a server stopped mid-stream)
            return

    def _handle_commands(self, block: bool) -> bool:
        """Handle what has come (when idle, wait for something); False once told to stop or the other end is gone."""
        try:
            while self._arrived.poll(None if block else 0):
                block = False
                if not self._handle(self.commands.recv()):
                    return False
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            self.events.send(("reply", command[1], self._add(command[2])))
        elif kind == "abort":
            self._started.discard(command[1])
            self._held.pop(command[1], None)
            if command[1] in self.engine.requests:
                self.engine.abort_request(command[1])
                self._aborted += 1
                self._send_step([], True)
        elif kind == "snapshot":
            self.events.send(("reply", command[1], self._snapshot()))
        return kind != "stop"

    def _add(self, jobs: list[tuple[str, list[int], object]]) -> Exception | None:
        """Start all of one HTTP request's engine requests, or none: the error that stopped them."""
        engine = self.engine
        if len(engine.scheduler.waiting) + len(jobs) > self.max_waiting:
            return QueueFullError(f"the server is busy: {len(engine.scheduler.waiting)} requests are waiting (limit {self.max_waiting})")
        added = []
        try:
            for _, token_ids, params in jobs:
                engine.check_request(token_ids, params)
            for request_id, token_ids, params in jobs:
                engine.add_request(token_ids, params, request_id=request_id)
                added.append(request_id)
        except Exception as e:
            for request_id in added:
                engine.abort_request(request_id)
            return e if isinstance(e, KVServeError) else RuntimeError(f"{type(e).__name__}: {e}")
        return None

    def _send_step(self, outputs: list[RequestOutput], flush: bool = False) -> None:
        """The step's outputs, with the stats when `flush` (an abort, a failed step), when a request's first or last
        output is among them (those carry its prompt's fields) or when they are due; nothing when neither has
        anything."""
        started = self._started
        wired = [to_wire(out, out.request_id not in started) for out in outputs]
        for out in outputs:
            if out.finished:
                started.discard(out.request_id)
            else:
                started.add(out.request_id)
        stats = None
        if flush or any(item[3] is not None for item in wired) or time.perf_counter() - self._flushed >= STATS_PERIOD_S:
            engine, self._flushed = self.engine, time.perf_counter()
            stats = {"scheduler": engine.scheduler.stats, "usage": engine.kv_manager.usage(),  # the pool only: a Redis
                     "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting)}  # tier's counts cost round trips
        elif not outputs:
            return
        if self.stream_interval > 1:
            wired = self._hold(wired)
            if not wired and stats is None:
                return
        self.events.send(("step", wired, stats, self._aborted))
        self._aborted = 0

    def _hold(self, wired: list[tuple]) -> list[tuple]:
        """What to send of these outputs, each merged with what its request held: a request's first and last
        outputs, and any with stream_interval steps; the others wait."""
        send = []
        for item in wired:
            if (held := self._held.pop(item[0], None)) is not None:
                item = merge_wire(held, item)
            if item[3] is not None or item[4] >= self.stream_interval:  # item[3]: a first or last output's prompt fields
                send.append(item)
            else:
                self._held[item[0]] = item
        return send

    def _fail_all(self, error: Exception) -> None:
        failed = list(self.engine.requests)
        for request_id in failed:
            self.engine.abort_request(request_id)
            self._started.discard(request_id)
            self._held.pop(request_id, None)
        self.events.send(("lost", [(r, f"the engine failed on this request's step: {error}") for r in failed]))
        self._send_step([], True)

    def _snapshot(self) -> dict:
        """The pool's blocks (ids: the main pool's, then the residual pool's) that are held or cached; the others are
        free. Only those are listed: a dict per block of a small model's pool (262,144 blocks in 1 GiB) took 4 s a
        snapshot and 19 MB of JSON."""
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
                "evicted_tokens": engine.scheduler.stats.num_evicted_tokens, "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting)}
