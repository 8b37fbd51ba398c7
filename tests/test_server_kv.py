"""`kvserve serve --kv-cache-dtype int8`: the server answers from a quantized pool and shows its layout on
/metrics and the live page's /kv/state."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest import FP32
from tests.server_utils import running_server


@pytest.fixture(scope="module")
def server():
    with running_server("smollm2-135m", kv_cache_memory="64MiB", kv_cache_dtype="int8", **FP32) as (url, app):
        yield url


def test_chat_from_an_int8_pool(server):
    body = {"model": "test-model", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 24}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_layout_on_metrics_and_live_page(server):
    per_token = 2 * 30 * 3 * (64 + 2 * 2)  # int8 values and one fp16 scale per 32 of them
    metrics = httpx.get(f"{server}/metrics").text
    assert f"kvserve:kv_cache_bytes_per_token{{model_name=\"test-model\"}} {float(per_token)}" in metrics
    layout = [line for line in metrics.splitlines() if line.startswith("kvserve:kv_cache_layout_info")][0]
    assert 'k_dtype="int8"' in layout and 'v_dtype="int8"' in layout and 'block_size="16"' in layout
    total = [line for line in metrics.splitlines() if line.startswith("kvserve:kv_cache_total_bytes")][0]
    assert 60 * 2**20 < float(total.split()[-1]) <= 64 * 2**20
    state = httpx.get(f"{server}/kv/state").json()
    assert state["layout"]["bytes_per_token"] == per_token and "KV int8" in state["layout"]["description"]
    assert state["grid"]["blocks"] == state["grid"]["residual_from"] == state["usage"]["num_blocks"] == 64 * 2**20 // (16 * per_token)
    # after the chat above, only its prefix's cached blocks are listed (held by no one); every other block is free
    cached = [b for b in state["blocks"] if b["cached"]]
    assert cached and cached == state["blocks"] and len(cached) == state["usage"]["cached_blocks"]
    assert all(b["ref"] == 0 and not b["owners"] for b in cached) and len({b["id"] for b in cached}) == len(cached)


def test_a_request_picks_a_kv_policy(server):
    """The extra field kv_policy: usage names it and counts the evicted tokens, /metrics and /kv/state add them up; a
    bad policy is a 400 that says why."""
    per_token = 2 * 30 * 3 * (64 + 2 * 2)
    body = {"model": "test-model", "prompt": "The history of Paris, from the Romans to today. " * 12, "max_tokens": 16,
            "temperature": 0, "kv_policy": "h2o:budget=32"}
    reply = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    usage = reply["usage"]
    assert usage["kv_policy"]["name"] == "h2o:budget=32,recent=0.5"
    assert usage["kv_policy"]["evicted_tokens"] >= usage["prompt_tokens"] - 32
    assert 0 < usage["kv_bytes"] <= (32 + 15) * per_token
    metrics = httpx.get(f"{server}/metrics").text
    evicted = [line for line in metrics.splitlines() if line.startswith("kvserve:kv_evicted_tokens_total")][0]
    assert float(evicted.split()[-1]) >= usage["kv_policy"]["evicted_tokens"]
    assert httpx.get(f"{server}/kv/state").json()["evicted_tokens"] >= usage["kv_policy"]["evicted_tokens"]
    plain = httpx.post(f"{server}/v1/completions", json={**body, "kv_policy": None}, timeout=60).json()["usage"]
    assert "kv_policy" not in plain and plain["kv_bytes"] > usage["kv_bytes"]
    bad = httpx.post(f"{server}/v1/completions", json={**body, "kv_policy": "h2o:budget=0"}, timeout=60)
    assert bad.status_code == 400 and "budget must be > 0" in bad.json()["error"]["message"]


def test_a_restarted_server_answers_a_repeated_prompt_from_its_disk_tier(tiny_model_dir, tmp_path):
    body = {"model": "test-model", "prompt": list(range(3, 60)), "max_tokens": 4, "temperature": 0, "logprobs": 0}
    options = dict(num_blocks=64, block_size=4, kv_tiers=[f"disk:{tmp_path}"])
    with running_server(str(tiny_model_dir), **options) as (url, _):
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    with running_server(str(tiny_model_dir), **options) as (url, _):
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(f"{url}/metrics").text
        tiers = httpx.get(f"{url}/kv/state").json()["layout"]["tiers"]
    assert tiers.startswith(f"KV tiers disk {tmp_path}") and tiers.endswith("(15 blocks held)")  # the prompt's and its answer's
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 52, "kv_tier_tokens": 52}
    assert "kv_tier_tokens" not in first["usage"]["prompt_tokens_details"]
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    loaded = [line for line in metrics.splitlines() if line.startswith("kvserve:kv_tier_loaded_blocks_total")]
    assert float(loaded[0].split()[-1]) == 13  # 52 tokens of blocks of 4
