"""Server limits on a tiny model: API key, bounded waiting queue, clean shutdown on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import save_tiny_llama
from tests.server_utils import FailingEngine, PausingEngine, SlowEngine, free_port, kv_usage, running_server

BODY = {"model": "test-model", "prompt": [1, 2, 3, 4], "max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def secured_app(tiny_model_dir):
    with running_server(str(tiny_model_dir), api_key="s3cret", max_waiting=2, make_engine=SlowEngine, max_num_seqs=1) as served:
        yield served


@pytest.fixture(scope="module")
def secured(secured_app):
    return secured_app[0]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cre"},
                                     {"Authorization": "Bearer s3cret2"}, {"Authorization": ""}])
def test_missing_or_wrong_api_key(secured, headers):
    r = httpx.post(f"{secured}/v1/completions", json=BODY, headers=headers)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_right_api_key_and_open_routes(secured):
    r = httpx.post(f"{secured}/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{secured}/health").status_code == 200
    assert httpx.get(f"{secured}/metrics").status_code == 200


def test_full_waiting_queue_gets_503_with_retry_after(secured):
    """One request runs (max_num_seqs 1), two wait (max_waiting 2): the next is turned away until they are done."""
    auth, long = {"Authorization": "Bearer s3cret"}, {**BODY, "max_tokens": 400}
    _fill_the_queue(secured, auth, long)
    assert httpx.post(f"{secured}/v1/completions", json=BODY, headers=auth).status_code == 200


def _fill_the_queue(secured: str, auth: dict, long: dict) -> None:
    post = lambda: pool.submit(httpx.post, f"{secured}/v1/completions", json=long, headers=auth, timeout=120)  # noqa: E731
    with ThreadPoolExecutor(3) as pool:
        busy, deadline = [post()], time.time() + 30
        while _gauge(secured, "num_requests_running") < 1:  # the first runs before the next two come (else all three queue)
            assert time.time() < deadline, "the first request never ran"
            time.sleep(0.01)
        busy += [post(), post()]
        while _gauge(secured, "num_requests_waiting") < 2:
            assert time.time() < deadline, "the queue never filled"
            time.sleep(0.01)
        r = httpx.post(f"{secured}/v1/completions", json=BODY, headers=auth)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "2 requests are waiting" in r.json()["error"]["message"]
        assert all(f.result().status_code == 200 for f in busy)


def test_more_prompts_than_the_queue_holds_is_a_400(secured):
    r = httpx.post(f"{secured}/v1/completions", json={**BODY, "prompt": [[1, 2]] * 2, "n": 2}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "one request may carry at most 2 prompts x n; this one has 2 prompt(s) x n=2 = 4"


def test_kv_state_needs_the_key(secured):
    assert httpx.get(f"{secured}/kv/state").status_code == 401
    state = httpx.get(f"{secured}/kv/state", headers={"Authorization": "Bearer s3cret"}).json()
    # a tiny model's 1 GiB pool: 262,144 blocks, of which only those held or cached are listed
    assert state["grid"]["blocks"] == state["usage"]["num_blocks"] > 100_000 and len(state["blocks"]) < 1_000


def _gauge(url: str, name: str) -> float:
    line = next(l for l in httpx.get(f"{url}/metrics").text.splitlines() if l.startswith(f"kvserve:{name}{{"))
    return float(line.split()[-1])


def test_a_stream_interval_sends_the_same_completion_in_fewer_events(tiny_model_dir):
    """Interval 4: 17 tokens come in 5 events (the first token alone, then 4 at a time), streamed or not the same
    tokens and logprobs; /metrics counts every token and every gap between two; a client that leaves mid-stream
    still frees its blocks."""
    body = {**BODY, "max_tokens": 17, "temperature": 0, "logprobs": 1}
    with running_server(str(tiny_model_dir), stream_interval=4) as (url, _):
        whole = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        parts = [e["choices"][0]["logprobs"] for e in events]
        assert [len(p["tokens"]) for p in parts] == [1, 4, 4, 4, 4]
        assert sum((p["tokens"] for p in parts), []) == whole["tokens"] and len(whole["tokens"]) == 17
        assert sum((p["token_logprobs"] for p in parts), []) == whole["token_logprobs"]
        assert (_gauge(url, "generation_tokens_total"), _gauge(url, "inter_token_latency_seconds_count")) == (34, 32)
        idle = kv_usage(url)
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 400, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            assert kv_usage(url) > idle
        deadline = time.time() + 20
        while kv_usage(url) != idle:
            assert time.time() < deadline, "the request that left kept its KV blocks"
            time.sleep(0.05)


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(tiny_model_dir):
    with running_server(str(tiny_model_dir), make_engine=FailingEngine) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "max_tokens": 13})
        assert r.status_code == 503 and "the engine failed on this request's step: a bug" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "max_tokens": 13, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and "a bug" in events[-2] and events[-1] == "data: [DONE]"  # the status went out first
        assert httpx.post(f"{url}/v1/completions", json=BODY).json()["usage"]["completion_tokens"] == 3
        assert kv_usage(url) == 0.0 and httpx.get(f"{url}/health").status_code == 200


def test_a_dead_engine_process_fails_health_and_requests(tiny_model_dir):
    with running_server(str(tiny_model_dir)) as (url, app):
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 200
        engine = app.state.server.async_engine
        engine.process.kill()
        engine.process.join()
        deadline = time.time() + 10
        while httpx.get(f"{url}/health").status_code != 503:  # the HTTP process sees its pipe close
            assert time.time() < deadline, "the server never noticed"
            time.sleep(0.05)
        r = httpx.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


@pytest.mark.parametrize("n", [1, 2])
def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event(tiny_model_dir, n):
    """The status is already sent: the stream's last events are one OpenAI error payload and [DONE]."""
    with running_server(str(tiny_model_dir), make_engine=SlowEngine) as (url, app):
        body = {**BODY, "max_tokens": 500, "n": n, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(next(events))["choices"][0]["text"] is not None
            engine = app.state.server.async_engine
            engine.process.kill()
            engine.process.join()
            rest = list(events)
        assert rest[-1] == "[DONE]" and len(rest) < 500
        errors = [json.loads(e) for e in rest[:-1] if '"error"' in e]
        assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error" and "exited" in errors[0]["error"]["message"]


def test_a_big_request_and_big_outputs_crossing_at_once_do_not_deadlock(tmp_path):
    """A 40,000-token prompt (~80 KB down the pipe) sent while the engine makes another's prompt logprobs (MBs back):
    the HTTP process must go on reading the engine's outputs while the request waits to be written, or both ends
    block on full pipes."""
    save_tiny_llama(tmp_path, max_position_embeddings=65536, num_hidden_layers=1)  # one layer: the pipes matter, not the model
    body = {**BODY, "max_tokens": 1, "echo": True, "logprobs": 1, "prompt": [7] * 40_000}
    post = lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # noqa: E731
    with running_server(str(tmp_path), make_engine=PausingEngine, kv_cache_memory="64MiB",
                        max_num_batched_tokens=40_960) as (url, _), ThreadPoolExecutor(2) as pool:
        first = pool.submit(post)
        time.sleep(0.25)  # into the first one's step, which sends its prompt's logprobs when it ends
        answers = [pool.submit(post).result(), first.result()]
    assert [len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) for r in answers] == [40_001, 40_001]


def test_a_dropped_stream_whose_step_was_running_leaves_the_others_whole(tiny_model_dir):
    """A client leaves while the engine runs a step that still has its request: that step's outputs must still reach
    the other requests in it (the HTTP process dropped the left one's state when its stream closed)."""
    body = {**BODY, "max_tokens": 4, "stream": True}
    with running_server(str(tiny_model_dir), make_engine=PausingEngine) as (url, _), ThreadPoolExecutor(1) as pool:
        def whole() -> list[str]:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                return [line for line in r.iter_lines() if line.startswith("data: {")]
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 40}, timeout=30) as r:
            other = pool.submit(whole)  # added while the first one's first step runs: the next steps hold both
            next(line for line in r.iter_lines() if line.startswith("data: {"))  # then leave, mid-step
        assert len(other.result()) == 4


def test_the_http_side_and_the_cli_parser_import_without_torch():
    """What `kvserve serve`'s HTTP process imports, and every command's parser, stay clear of torch; kvserve.LLM
    brings it on first use."""
    code = ("import sys, kvserve, kvserve.server.app\n"
            "from kvserve.entrypoints import cli\n"
            "cli.build_parser().parse_args(['distill', '--answers', '8'])\n"
            "assert 'LLM' in dir(kvserve) and 'torch' not in sys.modules, 'torch was imported'\n"
            "assert kvserve.LLM.__name__ == 'LLM' and 'torch' in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


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
        stream = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True, "logprobs": 2})
        assert stream.status_code == 200 and stream.text.count("data: {") == 3
        assert "kvserve:kv_cache_usage_perc" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        _check_placement(proc.pid)
        _check_torch_only_in_engine(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()
        assert "Application shutdown complete" in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def _engine_pid(pid: int) -> int:
    """The engine process `kvserve serve` (pid) spawned."""
    (engine,) = [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()
                 if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    return engine


def _check_torch_only_in_engine(pid: int) -> None:
    """The HTTP process, having served, never loaded torch (~190 MB and ~1.5 s of its start); the engine did."""
    assert "libtorch" in open(f"/proc/{_engine_pid(pid)}/maps").read()
    assert "libtorch" not in open(f"/proc/{pid}/maps").read()


def _check_placement(pid: int) -> None:
    """The engine's OpenMP threads bound to cores, the HTTP process on the last CPU (see kvserve.server.async_engine)."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2 or "OMP_PROC_BIND" in os.environ or "OMP_PLACES" in os.environ:
        return
    environ = dict(v.split("=", 1) for v in open(f"/proc/{_engine_pid(pid)}/environ").read().split("\0") if "=" in v)
    assert environ["OMP_PROC_BIND"] == "close" and environ["OMP_PLACES"] == "cores"
    assert all(os.sched_getaffinity(int(t)) == {max(cpus)} for t in os.listdir(f"/proc/{pid}/task"))
