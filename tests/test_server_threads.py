"""The HTTP process's tokenizer (the engine's process has its own) is never entered by two calls at once, however many
requests come together, nor is a SerialTokenizer that threads share: transformers' fast tokenizers change shared
state on every encode."""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvserve.engine.detokenizer import SerialTokenizer
from kvserve.models.loader import open_checkpoint
from tests.conftest import FP32
from tests.server_utils import running_server


class Watch:
    """Counts calls that enter the wrapped object while another call is inside it."""

    def __init__(self, inner):
        self.inner, self.active, self.overlaps, self.calls, self.guard = inner, 0, 0, 0, threading.Lock()

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            with self.guard:
                self.active += 1
                self.calls += 1
                self.overlaps += self.active > 1
            try:
                return value(*args, **kwargs)
            finally:
                with self.guard:
                    self.active -= 1
        return call


def _request(url: str, i: int) -> int:
    kind = i % 4
    if kind == 0:
        body = {"model": "test-model", "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 8,
                "stream": i % 8 == 0, "ignore_eos": True}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code
    if kind == 1:
        body = {"model": "test-model", "prompt": f"Number {i} is", "max_tokens": 8, "logprobs": 1, "ignore_eos": True}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code
    if kind == 2:
        return httpx.post(f"{url}/tokenize", json={"prompt": "many words, " * 20 * i}, timeout=120).status_code
    return httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi " * i}]}, timeout=120).status_code


def _overlaps(tokenizer_of) -> int:
    """Overlapping calls into the SmolLM2 tokenizer when 8 threads encode and decode through `tokenizer_of(watch)`."""
    watch = Watch(open_checkpoint("smollm2-135m").tokenizer)
    tokenizer = tokenizer_of(watch)

    def work(i: int) -> None:
        for j in range(50):
            tokenizer.decode(tokenizer.encode(f"thread {i} says {j} " * 20))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(work, range(8)))
    finally:
        sys.setswitchinterval(interval)
    assert watch.calls == 8 * 50 * 2
    return watch.overlaps


def test_threads_sharing_a_serial_tokenizer_take_turns():
    """A caller's threads may share an LLM and so its tokenizer; the bare tokenizer shows the watch sees overlaps."""
    assert _overlaps(lambda t: t) > 0
    assert _overlaps(SerialTokenizer) == 0


def test_100_concurrent_requests_never_share_the_tokenizer_at_once():
    with running_server("smollm2-135m", kv_cache_memory="64MiB", **FP32) as (url, app):
        tokenizer = app.state.server.tokenizer
        watch = Watch(tokenizer._tokenizer)
        tokenizer._tokenizer = watch
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # threads take turns often, so a call made from two threads at once shows up
        try:
            with ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(lambda i: _request(url, i), range(100)))
        finally:
            sys.setswitchinterval(interval)
    assert statuses == [200] * 100
    assert watch.calls > 300 and watch.overlaps == 0
