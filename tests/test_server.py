"""The OpenAI-compatible server, driven by the official openai client and raw HTTP on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvserve import SamplingParams
from tests.conftest import FP32
from tests.server_utils import kv_usage, running_server

LONG_SYSTEM = "You are a helpful assistant who answers questions about geography briefly and precisely. " * 4


@pytest.fixture(scope="module")
def server():
    with running_server("smollm2-135m", kv_cache_memory="256MiB", **FP32) as (url, app):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def chat(client, content: str, **kw):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": content}]
    return client.chat.completions.create(model="test-model", messages=messages, **kw)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["test-model"]
    assert client.models.retrieve("test-model").id == "test-model"
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.models.retrieve("gpt-4")
    assert httpx.get(f"{server}/health").status_code == 200


def test_chat_non_streaming_and_cached_usage(client):
    first = chat(client, "What is the capital of France?", temperature=0, max_tokens=20)
    assert "Paris" in first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    u = first.usage
    assert u.prompt_tokens > 32 and 0 < u.completion_tokens <= 20
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    again = chat(client, "What is the capital of France?", temperature=0, max_tokens=20)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert again.choices[0].message.content == first.choices[0].message.content


def test_chat_streaming_with_usage(client):
    stream = chat(client, "Name a color.", temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    plain = chat(client, "Name a color.", temperature=0, max_tokens=12)
    assert text == plain.choices[0].message.content


def test_completions_streamed_and_not(client):
    full = client.completions.create(model="test-model", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.usage.completion_tokens == 8
    streamed = client.completions.create(model="test-model", prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text


def test_n_greater_than_one_and_seed(client):
    kw = dict(model="test-model", prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=123, n=3,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 30


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": ["Once upon a time", "The sea"]}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_streamed_usage_counts_each_completion_once(server, path, prompt):
    """n > 1 with every completion ending in the same step (max_tokens=1): the streamed usage counted the request's
    last output once per completion it ended, n times over (3 x 2 tokens a prompt here, for 2)."""
    body = {"model": "test-model", **prompt, "n": 3, "max_tokens": 1, "temperature": 0, "seed": 1}
    plain = httpx.post(f"{server}{path}", json=body, timeout=60).json()["usage"]
    with httpx.stream("POST", f"{server}{path}", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = events[-1]["usage"]
    prompts = len(prompt.get("prompt", [None]))
    assert streamed["completion_tokens"] == plain["completion_tokens"] == 3 * prompts
    assert streamed["forked_blocks"] == plain["forked_blocks"] and streamed["kv_bytes"] == plain["kv_bytes"]


def test_n_choices_fork_one_prefill(server):
    """n = 4 prefills the prompt once: the other three share its full blocks (usage.forked_blocks), and each
    choice i is what a single request with seed + i gives."""
    body = {"model": "test-model", "prompt": LONG_SYSTEM, "max_tokens": 8, "temperature": 0.9, "seed": 40, "ignore_eos": True}
    forked = httpx.post(f"{server}/v1/completions", json={**body, "n": 4}, timeout=60).json()
    blocks = len(httpx.post(f"{server}/tokenize", json={"prompt": LONG_SYSTEM}).json()["tokens"]) // 16
    assert forked["usage"]["forked_blocks"] == 3 * blocks > 0
    singles = [httpx.post(f"{server}/v1/completions", json={**body, "seed": 40 + i}, timeout=60).json()["choices"][0]["text"]
               for i in range(4)]
    assert [c["text"] for c in sorted(forked["choices"], key=lambda c: c["index"])] == singles


def test_stop_strings(server, client):
    full = client.completions.create(model="test-model", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    stop = full.choices[0].text.strip().split(",")[1].strip()
    cut = client.completions.create(model="test-model", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert cut.choices[0].stop_reason == stop and full.choices[0].stop_reason is None  # vLLM's: which stop ended it
    streamed = client.completions.create(model="test-model", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop], stream=True)
    assert [c.choices[0].stop_reason for c in streamed][-1] == stop
    ended = chat(client, "Say hi.", temperature=0, max_tokens=64, stream=True)
    assert [c.choices[0].stop_reason for c in ended if c.choices and c.choices[0].finish_reason] == [None]  # EOS or length
    ids = httpx.post(f"{server}/tokenize", json={"prompt": full.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    by_token = client.completions.create(model="test-model", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, extra_body={"stop_token_ids": ids})
    assert by_token.choices[0].finish_reason == "stop" and by_token.choices[0].stop_reason in ids  # the token id


def test_chat_content_as_text_parts(client):
    """OpenAI's list of parts: text parts are joined (the engine's PromptEncoder does it for the server and the API
    alike); an image part is refused."""
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "yes."}]
    answers = [client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": c}], temperature=0,
                                              max_tokens=4).choices[0].message.content for c in (parts, "Say yes.")]
    assert answers[0] == answers[1]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="test-model", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_logprobs(client):
    out = chat(client, "Say yes.", temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and len(content[0].top_logprobs) == 2
    comp = client.completions.create(model="test-model", prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.token_logprobs) == 3


def test_logprobs_that_are_not_finite_are_valid_json():
    """A model whose logits overflow gives NaN logprobs: the answer was a 500, the stream's JSON invalid (NaN)."""
    from kvserve.outputs import TokenLogprob
    from kvserve.server.protocol import chat_logprobs, completion_logprobs

    logprobs = [None, TokenLogprob(5, float("nan"), {5: float("nan"), 6: -float("inf")}), TokenLogprob(6, -0.5, {6: -0.5})]
    shown = [completion_logprobs(logprobs, [4, 5, 6], str, lambda t: b"x", 0), chat_logprobs(logprobs[1:], str, lambda t: b"x")]
    text = json.dumps(shown, allow_nan=False)  # raises on NaN or infinity
    assert shown[0]["token_logprobs"] == [None, -9999.0, -0.5] and shown[0]["top_logprobs"][1] == {"5": -9999.0, "6": -9999.0}
    assert [c["logprob"] for c in shown[1]["content"]] == [-9999.0, -0.5] and "-9999.0" in text


def test_32_concurrent_streams_equal_alone(server):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]

    async def run() -> tuple[list[str], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")

        async def one(prompt: str) -> str:
            stream = await aclient.completions.create(model="test-model", prompt=prompt, max_tokens=12, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts[:6]]
        await aclient.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert together[:6] == alone
    assert all(len(t) > 0 for t in together)


def _counter(url: str, name: str, label: str = "") -> float:
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(f"kvserve:{name}{{") and label in line]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_disconnect_mid_stream_stops_generating_and_frees_kv(server):
    idle, aborts = kv_usage(server), _counter(server, "request_success_total", 'finished_reason="abort"')
    generated = _counter(server, "generation_tokens_total")
    body = {"model": "test-model", "prompt": "Tell me a very long story.", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept open: breaking out of a for loop over it would close the stream
        for _ in range(7):
            next(lines)
        assert kv_usage(server) > idle
    deadline = time.time() + 20
    while kv_usage(server) != idle:
        assert time.time() < deadline, "the aborted request kept its KV blocks"
        time.sleep(0.1)
    time.sleep(0.5)  # a request still generating would go on adding tokens meanwhile
    assert _counter(server, "generation_tokens_total") - generated < 200  # of the 2,000 it asked for
    assert _counter(server, "request_success_total", 'finished_reason="abort"') == aborts + 1


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Tell me a very long story.", "n": 2}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]})])
def test_a_client_that_leaves_a_non_streaming_request_aborts_it(server, path, body):
    """Without max_tokens an answer runs to the context window: a client that gave up left it generating for minutes."""
    idle, aborts = kv_usage(server), _counter(server, "request_success_total", 'finished_reason="abort"')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}{path}", json={"model": "test-model", "max_tokens": 2000, "ignore_eos": True, **body}, timeout=1.5)
    # under load the request may not have started when the client leaves: wait for its abort, not only for an idle pool
    deadline, aborted = time.time() + 20, lambda: _counter(server, "request_success_total", 'finished_reason="abort"')
    while kv_usage(server) != idle or _counter(server, "num_requests_running") or aborted() == aborts:
        assert time.time() < deadline, "the left request kept generating"
        time.sleep(0.1)
    assert aborted() == aborts + 1  # n completions: one request


def test_storm_of_dropped_streams_leaves_no_blocks_in_use(server):
    """50 streams, each dropped after a random number of chunks: no block stays in use, and the server answers."""
    rng = random.Random(0)
    body = {"model": "test-model", "max_tokens": 300, "stream": True, "ignore_eos": True}

    def drop_after(i: int) -> None:
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "prompt": f"Story number {i}:"}, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(rng.randint(1, 12)):
                next(lines)

    with ThreadPoolExecutor(50) as pool:
        list(pool.map(drop_after, range(50)))
    deadline = time.time() + 30
    while _counter(server, "num_requests_running") or _counter(server, "num_requests_waiting"):
        assert time.time() < deadline, "dropped streams kept running"
        time.sleep(0.1)
    state = httpx.get(f"{server}/kv/state").json()
    assert state["usage"]["used_blocks"] == 0 and state["running"] == state["waiting"] == 0
    ok = httpx.post(f"{server}/v1/completions", json={"model": "test-model", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


BAD = [
    ({"model": "test-model", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be >= 1"),
    ({"model": "test-model", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "test-model", "prompt": "hi", "temperature": -0.1}, 400, "temperature must be >= 0"),
    ({"model": "test-model", "prompt": "hi", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ({"model": "test-model", "prompt": "word " * 9000}, 400, "tokens, but this engine holds at most 5824 tokens"),
    ({"model": "test-model", "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens 100000 is too large"),
    ({"model": "test-model", "prompt": 42}, 400, "prompt"),
    ({"model": "test-model", "prompt": ""}, 400, "empty"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "The model `gpt-4` does not exist"),
    ({"model": "test-model"}, 400, "prompt: Field required"),
    ({"model": "test-model", "prompt": "hi", "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ({"model": "test-model", "prompt": "hi", "temperature": "0.5"}, 400, "temperature: Input should be a valid number"),
    ({"model": "test-model", "prompt": "hi", "echo": 1}, 400, "echo: Input should be a valid boolean"),
    ({"model": "test-model", "prompt": "hi", "n": 2.0}, 400, "n: Input should be a valid integer"),
    ({"model": "test-model", "prompt": [-1], "echo": True}, 400, "prompt token ids must be ints in [0, 49152)"),
    ({"model": "test-model", "prompt": "hi", "seed": 2**70}, 400, "seed must be an integer"),
    ({"model": "test-model", "prompt": "hi", "suffix": "!"}, 400, "suffix is not supported"),
    ({"model": "test-model", "prompt": "hi", "min_p": 2}, 400, "min_p must be in [0, 1], got 2"),
    ({"model": "test-model", "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens must be in [0, max_tokens], got 5"),
    ({"model": "test-model", "prompt": "hi", "best_of": 3}, 400, "best_of is not supported"),
    ({"model": "test-model", "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias keys must be token ids"),
    ({"model": "test-model", "prompt": "hi", "logit_bias": {"5": 200}}, 400, "biases in [-100, 100]"),
    ({"model": "test-model", "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "past the vocabulary"),
]


@pytest.mark.parametrize("body,status,message", BAD)
def test_bad_completion_requests(server, body, status, message):
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert httpx.post(f"{server}/v1/completions", json={"model": "test-model", "prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body,message", [({"model": "test-model", "messages": []}, "messages"),
                                          ({"model": "test-model", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
                                          ({"model": "test-model", "messages": "hello"}, "messages"),
                                          ({"model": "test-model", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                                           "top_logprobs needs logprobs: true"),
                                          ({"model": "test-model", "messages": [{"role": "user", "content": "x"}],
                                            "response_format": {"type": "json_object"}}, "response_format 'json_object' is not supported"),
                                          ({"model": "test-model", "messages": [{"role": "user", "content": "x"}],
                                            "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools and functions are not supported"),
                                          ({"model": "test-model", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
                                           "max_tokens must be >= 1"),  # not "unset": it ran to the context window
                                          ({"model": "test-model", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0,
                                            "max_tokens": 5}, "max_tokens must be >= 1")])
def test_bad_chat_requests(server, body, message):
    r = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {"prompt": "hi \udcff"}, "the prompt is not valid Unicode: character 3 is a lone surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                           {"role": "user", "content": "\ud800"}]}, "message 2's content is not valid Unicode"),
    ("/tokenize", {"prompt": "\udfff"}, "the prompt is not valid Unicode")])
def test_a_lone_surrogate_in_text_is_a_400(server, path, body, message):
    """JSON may escape half of a surrogate pair; the tokenizer then raised a TypeError: a 500, and uvicorn closed the
    connection."""
    r = httpx.post(f"{server}{path}", content=json.dumps({"model": "test-model", "max_tokens": 2, **body}),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_logit_bias_forces_a_token(server, client):
    """OpenAI's logit_bias (token ids as strings) on both routes: +100 makes every greedy token that one."""
    forced = httpx.post(f"{server}/detokenize", json={"tokens": [42] * 3}).json()["prompt"]
    text = client.completions.create(model="test-model", prompt="Hello", max_tokens=3, temperature=0, logit_bias={"42": 100}).choices[0].text
    reply = chat(client, "Hello", max_tokens=3, temperature=0, logit_bias={"42": 100}).choices[0].message.content
    assert text == reply == forced


def test_malformed_json(server):
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_tokenize_detokenize(server):
    ids = httpx.post(f"{server}/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert httpx.post(f"{server}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.post(f"{server}/detokenize", json={"tokens": [-5]}).status_code == 400


def test_metrics_exposed(server, client):
    for _ in range(2):  # a repeated long prompt, so the prefix-cache hit counter moves
        chat(client, "Name a river.", temperature=0, max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    for name in ("kvserve:time_to_first_token_seconds_bucket", "kvserve:inter_token_latency_seconds_bucket",
                 "kvserve:e2e_request_latency_seconds_count", "kvserve:request_queue_time_seconds_count",
                 "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc",
                 "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total", "kvserve:prefix_cache_queries_total",
                 "kvserve:prefix_cache_hits_total", "kvserve:num_preemptions_total", "kvserve:request_success_total"):
        assert name in text, name
    hits = [l for l in text.splitlines() if l.startswith("kvserve:prefix_cache_hits_total")]
    assert float(hits[0].split()[-1]) > 0


def test_echo_returns_the_prompts_logprobs(server, smollm2):
    """Legacy completions with echo and logprobs score the prompt (max_tokens 0: nothing else), as the engine does."""
    prompt = "The KV cache stores keys and values."
    body = {"model": "test-model", "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    choice = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = smollm2.engine.tokenize(prompt)
    expected = smollm2.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert lp["tokens"] == [smollm2.tokenizer.decode([t]) for t in ids] and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-3)
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:]) and lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    # with a completion after it, streamed or not: the prompt's entries, then the new tokens'
    body.update(max_tokens=4)
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["text"].startswith(prompt) and len(whole["logprobs"]["tokens"]) == len(ids) + 4
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_max_tokens_zero_needs_echo(server):
    body = {"model": "test-model", "prompt": "hi", "max_tokens": 0}
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == 400 and "max_tokens must be >= 1 (or 0 with echo: true, to return the prompt alone)" in r.json()["error"]["message"]
    body.update(echo=True)
    assert httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]["text"] == "hi"


def test_streamed_choices_equal_unstreamed_with_stop_strings(server):
    body = {"model": "test-model", "prompt": "Write one sentence about the sea:", "max_tokens": 24, "n": 2, "seed": 5,
            "temperature": 0.8, "stop": ["th", "e s"]}
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"]
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(2)]
    assert streamed == [c["text"] for c in sorted(whole, key=lambda c: c["index"])]
    assert any(c["finish_reason"] == "stop" for c in whole)


def test_logprob_tokens_carry_their_own_bytes(server, smollm2):
    """A character split over several byte-level tokens: each token's bytes, which concatenate to its UTF-8."""
    word = "日本"
    ids = smollm2.engine.tokenize(word, add_special_tokens=False)
    assert len(ids) > len(word)  # some token holds part of a character
    body = {"model": "test-model", "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0}
    tokens = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    assert any(t.startswith("bytes:") for t in tokens) and "\ufffd" not in "".join(tokens)
    raw = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in tokens)
    assert raw == word.encode()
    messages = [{"role": "user", "content": "Write the Japanese word for Japan, in Japanese script only."}]
    reply = httpx.post(f"{server}/v1/chat/completions", json={"model": "test-model", "messages": messages, "max_tokens": 12,
                                                              "temperature": 0, "logprobs": True}, timeout=60).json()["choices"][0]
    joined = bytes(b for entry in reply["logprobs"]["content"] for b in entry["bytes"])
    text = reply["message"]["content"].encode()  # max_tokens may cut a character short: the text waits for its end
    assert joined.startswith(text) and len(joined) - len(text) < 4
    assert joined.decode(errors="ignore") == reply["message"]["content"]
