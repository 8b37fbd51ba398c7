"""KV tiers: prefix-cache blocks saved past the pool (CPU RAM, a disk) come back with the same values, after the
pool evicted them and after a restart, and never leave a block listed whose values were not loaded."""
from __future__ import annotations

import os
import random
import subprocess

import pytest
import torch

from kvserve import LLM, KVServeError, SamplingParams
from kvserve.kv.tiers import Tiers, parse_tier
from kvserve.kv.tiers.disk import DiskStore
from kvserve.kv.tiers.host import HostStore
from tests.conftest import greedy

BS = 4


def test_host_store_keeps_the_most_recently_used_within_its_size():
    store = HostStore(30)
    for key in (b"a", b"b", b"c"):
        store.put(key, bytes(10))
    assert store.get(b"a") == bytes(10)  # now the most recent
    store.put(b"d", bytes(10))
    assert b"b" not in store and all(k in store for k in (b"a", b"c", b"d")) and store.nbytes == 30
    store.put(b"e", bytes(31))  # larger than the whole store: not kept
    assert b"e" not in store and len(store) == 3


def test_disk_store_survives_a_restart_and_a_file_removed_behind_its_back(tmp_path):
    store = DiskStore(str(tmp_path), 3 * 8)
    for key in (b"\x01", b"\x02", b"\x03"):
        store.put(key, key * 8)
    store.get(b"\x01")
    store.put(b"\x04", b"\x04" * 8)  # evicts the least recently used: \x02
    assert b"\x02" not in store and not (tmp_path / "02.kvblock").exists()
    again = DiskStore(str(tmp_path), 3 * 8)
    assert again.get(b"\x04") == b"\x04" * 8 and again.nbytes == 24 and len(again) == 3
    (tmp_path / "01.kvblock").unlink()
    assert again.get(b"\x01") is None and b"\x01" not in again and again.nbytes == 16
    assert DiskStore(str(tmp_path), 8).nbytes == 8  # a smaller size at start drops the oldest files


def test_a_disk_store_removes_only_the_partial_files_no_live_process_is_writing(tmp_path):
    writer = subprocess.Popen(["sleep", "60"])  # another engine on this directory, mid-write
    gone = subprocess.Popen(["true"])
    gone.wait()
    names = ["05.partial", f"06.{gone.pid}.partial", f"07.{os.getpid()}.partial", f"08.{writer.pid}.partial"]
    try:
        for name in names:
            (tmp_path / name).write_bytes(b"\x05" * 3)  # a crash mid-write left it, or a live writer is at it
        store = DiskStore(str(tmp_path), 8)
        assert sorted(p.name for p in tmp_path.iterdir()) == [names[3]] and len(store) == 0
        store.put(b"\x09", b"\x09" * 8)  # its own partial name, then the block's
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["09.kvblock", names[3]])
    finally:
        writer.kill()


def test_tiers_check_tokens_and_size_and_copy_into_faster_tiers(tmp_path):
    tiers = Tiers(["cpu:1MiB", f"disk:{tmp_path}:1MiB"], block_bytes=6)
    tiers.save(b"k", (1, 2), b"values")
    assert tiers.load(b"k", (1, 3)) is None  # another block's tokens under this key
    tiers.stores[0].entries.clear()
    assert tiers.load(b"k", (1, 2)) == b"values" and b"k" in tiers.stores[0]  # read from disk, kept in RAM too
    assert Tiers([f"disk:{tmp_path}:1MiB"], block_bytes=7).load(b"k", (1, 2)) is None  # another layout's block size


@pytest.mark.parametrize("spec,message", [("gpu:1GiB", "unknown KV tier 'gpu:1GiB'"), ("cpu:lots", "invalid size 'lots'"),
                                          ("cpu:", "unknown KV tier"), ("disk:/dev/null/x", "KV tier directory /dev/null/x")])
def test_bad_tier_specs(spec, message):
    with pytest.raises(KVServeError, match=message):
        parse_tier(spec)


def _engine(model_dir, tiers, num_blocks: int = 24, **kw) -> LLM:
    return LLM(str(model_dir), num_blocks=num_blocks, block_size=BS, kv_tiers=tiers, **kw)


def _flush(llm: LLM) -> None:
    """Other prompts through the pool until none of its blocks holds what it held."""
    for start in range(100, 220, 20):
        llm.generate(list(range(start, start + 40)), greedy(2), use_tqdm=False)


def _run(llm: LLM, prompt: list[int]):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True), use_tqdm=False)[0]


def _same(a, b) -> bool:
    return a.outputs[0].token_ids == b.outputs[0].token_ids and all(
        x.logprob == pytest.approx(y.logprob, abs=1e-5) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))


@pytest.mark.parametrize("tier", ["cpu:1MiB", "disk"])
def test_evicted_prefix_comes_back_from_a_tier(tiny_model_dir, tmp_path, tier):
    prompt = list(range(3, 45))  # 10 full blocks before the last token's
    plain = _run(LLM(str(tiny_model_dir), enable_prefix_caching=False), prompt)
    llm = _engine(tiny_model_dir, [tier if tier != "disk" else f"disk:{tmp_path}"])
    first = _run(llm, prompt)
    _flush(llm)
    again = _run(llm, prompt)  # every block from the tier: the pool kept none of them
    assert first.metrics.cached_tokens == 0 and again.metrics.cached_tokens == again.metrics.tier_tokens == 40
    assert llm.engine.scheduler.stats.tier_loaded_blocks == 10
    assert _same(plain, first) and _same(plain, again)
    assert llm.engine.kv_manager.pool.num_used == 0


def test_a_restart_finds_the_disk_tier_but_another_model_does_not(tiny_model_dir, tiny_model_dir_d32, tmp_path):
    prompt = list(range(7, 40))
    first = _run(_engine(tiny_model_dir, [f"disk:{tmp_path}"]), prompt)
    restarted = _engine(tiny_model_dir, [f"disk:{tmp_path}"])
    again = _run(restarted, prompt)
    assert again.metrics.cached_tokens == 28 and _same(first, again)
    assert _run(_engine(tiny_model_dir_d32, [f"disk:{tmp_path}"]), prompt).metrics.cached_tokens == 0
    assert _run(_engine(tiny_model_dir, [f"disk:{tmp_path}"], dtype="bfloat16"), prompt).metrics.cached_tokens == 0
    # the matmuls as they ran, not as asked: "auto" shares blocks with "bfloat16" where it means bf16 (this CPU?)
    _run(_engine(tiny_model_dir, [f"disk:{tmp_path / 'bf16'}"], matmul_dtype="bfloat16"), prompt)
    auto = _engine(tiny_model_dir, [f"disk:{tmp_path / 'bf16'}"], matmul_dtype="auto")
    assert _run(auto, prompt).metrics.cached_tokens == (28 if auto.engine.config.bf16_matmuls else 0)


def test_the_tier_names_the_model_by_its_files_contents(tiny_model_dir, tmp_path):
    """A copy of the model elsewhere (another machine's) shares a tier; the same directory with its weights
    rewritten in place does not."""
    import shutil

    from safetensors.torch import load_file, save_file

    prompt, tier = list(range(7, 40)), [f"disk:{tmp_path / 'tier'}"]
    first = _run(_engine(tiny_model_dir, tier, matmul_dtype="float32"), prompt)
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    again = _run(_engine(copy, tier, matmul_dtype="float32"), prompt)
    assert again.metrics.tier_tokens == 28 and _same(first, again)
    weights = load_file(copy / "model.safetensors")
    name = next(n for n in weights if "layers.0.self_attn.k_proj" in n)
    weights[name] = weights[name] * 1.5
    save_file(weights, tmp_path / "new.safetensors", metadata={"format": "pt"})
    shutil.copyfile(tmp_path / "new.safetensors", copy / "model.safetensors")  # cp over it: the directory's time stays
    changed = _run(_engine(copy, tier, matmul_dtype="float32"), prompt)
    assert changed.metrics.cached_tokens == 0


def test_a_tier_serves_no_engine_whose_blocks_mean_something_else(tiny_model_dir, tmp_path, monkeypatch):
    """Blocks of equal size whose bytes mean something else miss: MiniCache merged with another weight, or a
    kvserve whose block byte layout changed."""
    from kvserve.kv import cache

    prompt, tier = list(range(7, 40)), [f"disk:{tmp_path}"]
    merged = dict(kv_policy="minicache:start=0", matmul_dtype="float32")
    _run(_engine(tiny_model_dir, tier, **merged), prompt)
    assert _run(_engine(tiny_model_dir, tier, **merged), prompt).metrics.tier_tokens == 28
    assert _run(_engine(tiny_model_dir, tier, kv_policy="minicache:start=0,t=0.3", matmul_dtype="float32"), prompt).metrics.cached_tokens == 0
    monkeypatch.setattr(cache, "BLOCK_BYTES_VERSION", cache.BLOCK_BYTES_VERSION + 1)
    monkeypatch.setattr("kvserve.kv.manager.BLOCK_BYTES_VERSION", cache.BLOCK_BYTES_VERSION)
    assert _run(_engine(tiny_model_dir, tier, **merged), prompt).metrics.cached_tokens == 0


def test_sliding_window_groups_load_only_the_window(tiny_sliding_dir, tmp_path):
    prompt = list(range(5, 50))
    plain = _run(LLM(str(tiny_sliding_dir), enable_prefix_caching=False), prompt)
    llm = _engine(tiny_sliding_dir, ["cpu:1MiB"], num_blocks=40)  # two groups: a block of tokens takes two
    _run(llm, prompt)
    _flush(llm)
    loaded = llm.engine.scheduler.stats.tier_loaded_blocks
    again = _run(llm, prompt)
    assert again.metrics.cached_tokens == again.metrics.tier_tokens == 40 and _same(plain, again)
    assert llm.engine.scheduler.stats.tier_loaded_blocks - loaded == 10 + 2  # the full group's 10 blocks, the sliding one's window


def test_many_requests_on_a_small_pool_with_tiers_equal_the_plain_engine(tiny_model_dir):
    """Shared prefixes, a pool too small to hold them (preemption, admissions that fail after a tier lookup):
    every output equals the engine without any cache reuse, and no block stays held."""
    rng = random.Random(0)
    stems = [[rng.randrange(1, 250) for _ in range(rng.randrange(8, 30))] for _ in range(4)]
    prompts = [rng.choice(stems) + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 10))] for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    llm = _engine(tiny_model_dir, ["cpu:64KiB"], max_num_seqs=6)  # the tier too holds only part of them
    for _ in range(3):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [p.outputs[0].token_ids for p in plain]
    assert llm.engine.scheduler.stats.tier_loaded_blocks > 0 and llm.engine.kv_manager.pool.num_used == 0


def test_tiers_need_prefix_caching(tiny_model_dir):
    with pytest.raises(KVServeError, match="need prefix caching"):
        LLM(str(tiny_model_dir), kv_tiers=["cpu:1MiB"], enable_prefix_caching=False)


def test_block_bytes_round_trip(tiny_model_dir):
    llm = _engine(tiny_model_dir, [])
    cache = llm.engine.runner.kv_cache
    for t in cache._main:
        t.copy_(torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else torch.randint(-100, 100, t.shape).to(t.dtype))
    blobs = cache.read_blocks([3, 5])
    assert len(blobs[0]) == cache.block_nbytes
    cache.write_blocks([(7, blobs[0]), (9, blobs[1]), (9, blobs[0])])  # a later pair for a block wins
    assert all(torch.equal(t[7], t[3]) and torch.equal(t[9], t[3]) for t in cache._main)


@pytest.fixture
def redis_url(tmp_path):
    """A redis-server of our own on a free port (`make test` installs Debian's redis-server)."""
    import shutil
    import socket
    import time

    import redis

    assert shutil.which("redis-server"), "redis-server is missing: make test installs it (apt-get install redis-server)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url, deadline = f"redis://127.0.0.1:{port}/0", time.time() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert time.time() < deadline and server.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    yield url, server
    server.terminate()
    server.wait(timeout=10)


def test_engines_share_a_redis_tier_and_go_on_when_it_is_gone(tiny_model_dir, redis_url, monkeypatch):
    url, server = redis_url
    prompt = list(range(9, 50))
    saver = _engine(tiny_model_dir, [url])
    first = _run(saver, prompt)
    saver.engine.tiers.stores[0].flush()  # its saves went out on a thread of their own
    other = _engine(tiny_model_dir, ["cpu:1MiB", url])  # another engine (a restart, another process): its RAM tier fills from Redis
    again = _run(other, prompt)
    assert again.metrics.cached_tokens == 36 and _same(first, again) and len(other.engine.tiers.stores[0]) == 9
    assert "keys)" in other.engine.tiers.describe()
    gone = _engine(tiny_model_dir, [url])
    server.terminate()  # the server goes away after the engine started: lookups miss, saves are lost
    server.wait(timeout=10)
    store, calls = gone.engine.tiers.stores[0], []
    client = store.client

    class Counting:  # each call to a server that is gone could wait out a socket timeout on the engine thread
        def __getattr__(self, name):
            method = getattr(client, name)
            return lambda *args, **kwargs: calls.append(name) or method(*args, **kwargs)

    store.client = Counting()
    after = _run(gone, prompt)
    store.flush()
    assert after.metrics.cached_tokens == 0 and _same(first, after)
    assert len(calls) == 1  # the first failure; the other lookups and saves wait for RETRY_S to pass
    monkeypatch.setattr("kvserve.kv.tiers.remote.RETRY_S", 0.0)
    assert store.get(b"x") is None and len(calls) == 2  # then it tries again
    with pytest.raises(KVServeError, match=f"KV tier {url}"):
        _engine(tiny_model_dir, [url])


def test_redis_saves_go_out_on_a_thread_of_their_own(redis_url):
    """A save returns before the server has the block (a round trip and its bytes, on the engine's thread each
    step); until sent, lookups find it anyway; past MAX_UNSENT blocks waiting, saves are dropped."""
    import threading

    from kvserve.kv.tiers import remote

    store, sent, release = remote.RedisStore(redis_url[0]), [], threading.Event()
    set_block = store.client.set

    def slow_set(*args, **kwargs):  # a server far away
        release.wait(10)
        sent.append(args[0])
        return set_block(*args, **kwargs)

    store.client.set = slow_set
    for key in (b"a", b"b"):
        store.put(key, key * 8)
    assert not sent and b"a" in store and store.get(b"b") == b"bb" * 4  # not sent yet, found all the same
    release.set()
    store.flush()
    assert sent == [remote.PREFIX + b"a", remote.PREFIX + b"b"] and store.client.get(remote.PREFIX + b"b") == b"bb" * 4
    release.clear()
    for i in range(remote.MAX_UNSENT + 5):
        store.put(b"%d" % i, b"x")
    assert len(store.unsent) == remote.MAX_UNSENT and bytes(b"%d" % remote.MAX_UNSENT) not in store.unsent
    release.set()
    store.flush()
    assert not store.unsent and store.sender is None
