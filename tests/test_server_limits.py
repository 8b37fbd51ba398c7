"""Server limits on a tiny model: API key, bounded waiting queue, clean shutdown on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server_utils import free_port, running_server

BODY = {"model": "test-model", "prompt": [1, 2, 3, 4], "max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def secured(tiny_model_dir):
    with running_server(str(tiny_model_dir), api_key="s3cret", max_waiting=2) as (url, _):
        yield url


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}])
def test_missing_or_wrong_api_key(secured, headers):
    r = httpx.post(f"{secured}/v1/completions", json=BODY, headers=headers)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_right_api_key_and_open_routes(secured):
    r = httpx.post(f"{secured}/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{secured}/health").status_code == 200
    assert httpx.get(f"{secured}/metrics").status_code == 200


def test_full_waiting_queue_gets_503_with_retry_after(secured):
    r = httpx.post(f"{secured}/v1/completions", json={**BODY, "n": 3}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    ok = httpx.post(f"{secured}/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


def test_sigterm_shuts_down_cleanly(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port), "--kv-cache-memory", "8MiB"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline and proc.poll() is None, "server did not come up"
            time.sleep(0.2)
        body = {**BODY, "model": str(tiny_model_dir)}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()
        assert "Application shutdown complete" in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
