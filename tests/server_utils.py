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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str, api_key: str | None = None, max_waiting: int = 256, **engine_options):
    engine = LLMEngine(EngineConfig(model=model, **engine_options))
    app = create_app(engine, "test-model", api_key=api_key, max_waiting=max_waiting)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    threading.Thread(target=app.state.server.async_engine.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def kv_usage(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvserve:kv_cache_usage_perc{"):
            return float(line.split()[-1])
    raise AssertionError("kv_cache_usage_perc missing from /metrics")
