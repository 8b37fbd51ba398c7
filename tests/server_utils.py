"""Run a kvserve server in this process, on a free loopback port, for the duration of a test."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import create_app
from kvserve.server.async_engine import AsyncEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PausingEngine(LLMEngine):
    """Half a second before each step: what a test sends meanwhile arrives while a step runs."""

    pause = 0.5

    def step(self):
        time.sleep(self.pause)
        return super().step()


class SlowEngine(PausingEngine):
    """5 ms a step at least: the tiny model could finish a request before a test's next one arrives."""

    pause = 0.005


class FailingEngine(LLMEngine):
    """A stand-in for a bug: every step holding a request that asks for 13 tokens raises."""

    def step(self):
        if any(seq.params.max_tokens == 13 for seqs in self.requests.values() for seq in seqs):
            raise RuntimeError("a bug")
        return super().step()


@contextlib.contextmanager
def running_server(model: str, api_key: str | None = None, max_waiting: int = 256, make_engine=None, stream_interval: int = 1,
                   **engine_options):
    """As `kvserve serve` runs: the engine in a process of its own, HTTP on a thread of this one."""
    engine = AsyncEngine.start(EngineConfig(model=model, **engine_options), "test-model", max_waiting, make_engine,
                               stream_interval=stream_interval)
    app = create_app(engine, "test-model", api_key=api_key)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    try:
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        yield url, app
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        engine.stop()


def kv_usage(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvserve:kv_cache_usage_perc{"):
            return float(line.split()[-1])
    raise AssertionError("kv_cache_usage_perc missing from /metrics")
