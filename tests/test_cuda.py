"""The CUDA path: the same scheduling guarantees as on CPU (they run where torch sees a GPU), and the
device setting's errors (they run everywhere)."""
from __future__ import annotations

import sys

import pytest
import torch

from kvserve import LLM, KVServeError
from tests.conftest import FP32, greedy, save_tiny

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")
PROMPTS = [list(range(1, 9)), list(range(40, 97)), [7] * 30, list(range(200, 203))]
NEW = 16


def _outputs(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)
    assert llm.engine.kv_manager.pool.num_used == 0
    return [o.outputs[0].token_ids for o in outs]


def test_bad_device_is_a_clear_error(tiny_model_dir):
    with pytest.raises(KVServeError, match="device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        LLM(str(tiny_model_dir), device="tpu")
    missing = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(KVServeError, match=f"device '{missing}'"):
        LLM(str(tiny_model_dir), device=missing)


def test_auto_device_picks_cuda_when_present(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_blocks=16)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert llm.engine.runner.kv_cache.device.type == expected
    assert next(llm.engine.runner.model.parameters()).device.type == expected


@needs_cuda
@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=7),  # prefill chunks mixed with decodes
    dict(num_blocks=20, block_size=4, preemption_mode="recompute"),
    dict(num_blocks=20, block_size=4, preemption_mode="swap"),
    dict(scheduler="static"),
], ids=["chunked", "recompute", "swap", "static"])
def test_cuda_batched_equals_alone(tiny_model_dir, options):
    alone_llm = LLM(str(tiny_model_dir), device="cuda", enable_prefix_caching=False)
    alone = [alone_llm.generate(p, greedy(NEW), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    llm = LLM(str(tiny_model_dir), device="cuda", enable_prefix_caching=False, **options)
    assert _outputs(llm) == alone
    if "preemption_mode" in options:
        assert llm.engine.scheduler.stats.num_preemptions > 0


@needs_cuda
def test_cuda_bfloat16_halves_kv_and_tracks_fp32(tiny_model_dir):
    fp32 = LLM(str(tiny_model_dir), device="cuda", num_blocks=16)
    bf16 = LLM(str(tiny_model_dir), device="cuda", num_blocks=16, dtype="bfloat16")
    assert bf16.engine.runner.kv_cache.nbytes * 2 == fp32.engine.runner.kv_cache.nbytes
    assert bf16.engine.layout.bytes_per_token * 2 == fp32.engine.layout.bytes_per_token
    a = fp32.generate(PROMPTS[1], greedy(1), use_tqdm=False)[0]
    b = bf16.generate(PROMPTS[1], greedy(1), use_tqdm=False)[0]
    la, lb = fp32.engine.runner.last_logits, bf16.engine.runner.last_logits
    assert la.dtype == lb.dtype == torch.float32
    assert (la - lb).abs().max() < 0.05 * la.abs().max()
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@needs_cuda
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8", "int4", "kivi2"])
def test_cuda_quantized_kv_tracks_the_cpu(tiny_model_dir_d32, dtype):
    """Every KV format runs on CUDA (SDPA over dequantized blocks) and holds what the CPU path holds."""
    options = dict(num_blocks=64, block_size=4, kv_cache_dtype=dtype, kivi_residual=8, **FP32)  # bf16 CPU matmuls would differ
    cpu, cuda = LLM(str(tiny_model_dir_d32), device="cpu", **options), LLM(str(tiny_model_dir_d32), device="cuda", **options)
    for llm in (cpu, cuda):
        llm.generate(PROMPTS, greedy(NEW), use_tqdm=False)  # fills, packs (kivi2) and frees blocks
        assert llm.engine.kv_manager.pool.num_used == 0
    steps = []
    for llm in (cpu, cuda):
        llm.engine.add_request(PROMPTS[1], greedy(1))
        llm.engine.step()
        steps.append(llm.engine.runner.last_logits[0].cpu())
    torch.testing.assert_close(steps[1], steps[0], atol=1e-3, rtol=1e-3)


# The CUDA backend's kernels and decode path: on a GPU, natively; elsewhere, in Triton's interpreter (conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _attention_over_gathered_blocks(q, keys, values, tables, lens, scale, window, hidden=None):
    """hidden [B]: bit j set, query b skips the key j + 1 slots before its own; its window counts the keys it sees."""
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        skipped = [n - 2 - j for j in range(64) if hidden is not None and int(hidden[b]) >> j & 1]
        first = max(0, n - window - len(skipped)) if window else 0
        seen = [t for t in range(first, n) if t not in skipped]
        k, v = (c[tables[b]].flatten(0, 1)[seen].float() for c in (keys, values))
        rep = q.shape[1] // k.shape[1]
        scores = torch.einsum("hd,thd->ht", q[b].float(), k.repeat_interleave(rep, 1)) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v.repeat_interleave(rep, 1)))
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads,dim,block,window,dtype", [
    (9, 3, 64, 32, None, torch.float32),  # SmolLM2's GQA; 384 keys: three tiles
    (4, 4, 32, 4, 5, torch.float32),  # MHA, a window shorter than a block's span
    (8, 1, 16, 8, None, torch.float16),  # MQA
    (6, 2, 48, 16, 20, torch.bfloat16),  # a head dim that is no power of two
    (9, 3, 64, 32, 150, torch.float32),  # a window across two tiles
])
@pytest.mark.parametrize("span", [0, 128], ids=["whole", "split"])  # split: a program per 128 keys, then combined
def test_paged_decode_equals_attention_over_gathered_blocks(heads, kv_heads, dim, block, window, dtype, span):
    from kvserve.attention.cuda import paged_decode

    torch.manual_seed(0)
    keys, values = (torch.randn(40, block, kv_heads, dim, device=DEVICE).to(dtype) for _ in range(2))
    tables = torch.stack([torch.randperm(40, device=DEVICE)[:12] for _ in range(5)])
    lens = torch.tensor([1, 17, 12 * block, 3, 6 * block + 1], device=DEVICE)
    q = torch.randn(5, heads, dim, device=DEVICE).to(dtype)
    out = paged_decode(q, keys, values, tables, lens, 0.3, window, span)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _attention_over_gathered_blocks(q, keys, values, tables, lens, 0.3, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    lens[3] = 0  # a CUDA graph's padding row: no keys, zeros, and the other rows unchanged
    padded = paged_decode(q, keys, values, tables, lens, 0.3, window, span)
    assert not padded[3].any() and torch.equal(padded[[0, 1, 2, 4]], out[[0, 1, 2, 4]])


@pytest.mark.parametrize("window", [None, 5, 150])
@pytest.mark.parametrize("span", [0, 128], ids=["whole", "split"])
def test_paged_decode_skips_the_keys_of_a_trees_other_branches(window, span):
    """A tree's guess attends to its ancestors only: the kernel skips the keys its mask names (bit j: the key j + 1
    slots before its own), and a window reaches back past as many keys as it skips."""
    from kvserve.attention.cuda import paged_decode

    torch.manual_seed(0)
    keys, values = (torch.randn(40, 32, 3, 64, device=DEVICE) for _ in range(2))
    tables = torch.stack([torch.randperm(40, device=DEVICE)[:12] for _ in range(4)])
    lens = torch.tensor([9, 200, 300, 33], device=DEVICE)
    hidden = torch.tensor([0b101, 0b110, 1 << 62 | 1, 0], device=DEVICE)  # the last skips nothing: a chain's row
    q = torch.randn(4, 9, 64, device=DEVICE)
    out = paged_decode(q, keys, values, tables, lens, 0.3, window, span, hidden=hidden)
    expected = _attention_over_gathered_blocks(q, keys, values, tables, lens, 0.3, window, hidden)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    plain = paged_decode(q, keys, values, tables, lens, 0.3, window, span)
    assert torch.equal(out[3], plain[3]) and not torch.allclose(out[:3], plain[:3], atol=1e-3)


def test_decode_splits_long_contexts_where_the_gpu_has_idle_multiprocessors():
    from kvserve.attention.cuda import SPLIT_KEYS, split_span

    cpu = torch.device("cpu")  # counted as an H100's 132 multiprocessors
    assert split_span(1, 3, 8192, cpu) == SPLIT_KEYS and split_span(43, 3, 8192, cpu) == SPLIT_KEYS
    assert split_span(44, 3, 8192, cpu) == 0  # 132 programs fill the GPU
    assert split_span(1, 3, SPLIT_KEYS, cpu) == 0  # one span: nothing to split


def test_write_slots_casts_and_skips_negative_slots():
    from kvserve.attention.cuda import write_slots

    cache = torch.zeros(10, 4, 3, 8, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(6, 3 * 8 + 5, device=DEVICE)[:, :24].view(6, 3, 8)  # rows of a fused projection's output
    write_slots(cache, x, torch.tensor([0, 5, -1, 39, 7, -1], device=DEVICE))
    flat = cache.flatten(0, 1)
    assert torch.equal(flat[[0, 5, 39, 7]], x[[0, 1, 3, 4]].bfloat16())
    assert int(flat.flatten(1).any(1).sum()) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_pointwise_ops_equal_torch(dtype):
    """RoPE in place on q and k viewed in a fused projection's rows, and SiLU-and-mul over more than one block."""
    import torch.nn.functional as F

    from kvserve.kernels import pointwise_triton as ops
    from kvserve.layers.rotary import RotaryEmbedding, apply_rotary

    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    qkv = torch.randn(5, (4 + 2 * 2) * 16, device=DEVICE, dtype=dtype)  # 4 query heads, 2 KV heads of 16
    q, k, v = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].clone()
    cos, sin = RotaryEmbedding(16, 64, 10000.0, None).to(DEVICE).tables(torch.tensor([0, 1, 9, 30, 63], device=DEVICE), dtype)
    want = [apply_rotary(t.float(), cos.float(), sin.float()) for t in (q, k)]
    ops.rope_(q, cos, sin)
    ops.rope_(k, cos, sin)
    torch.testing.assert_close(q.float(), want[0], **tol)
    torch.testing.assert_close(k.float(), want[1], **tol)
    assert torch.equal(qkv[:, 96:], v)
    x = torch.randn(3, 2 * 1500, device=DEVICE, dtype=dtype)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x).float(), F.silu(gate) * up, **tol)
    assert ops.silu_and_mul(x[:0]).shape == (0, 1500)


def test_a_model_on_the_triton_pointwise_ops_gives_torch_s_logits(tiny_model_dir, monkeypatch):
    """What a CUDA runner sets (ModelRunner: use_fused_ops), set after start-up (so op by op: graphs captured
    before would replay torch's ops): every layer's RoPE and SiLU-and-mul go to the Triton kernels, and each step's
    logits stay torch's."""
    from kvserve.kernels import pointwise_triton

    calls = []
    for name in ("rope_", "silu_and_mul"):
        real = getattr(pointwise_triton, name)
        monkeypatch.setattr(pointwise_triton, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    options = dict(device=DEVICE, num_blocks=64, block_size=4, enable_prefix_caching=False, native_kernels=False,
                   enforce_eager=True, **FP32)
    reference, llm = LLM(str(tiny_model_dir), **options), LLM(str(tiny_model_dir), **options)
    llm.engine.runner.model.use_fused_ops(pointwise_triton)
    _assert_same_steps(reference, llm, PROMPTS, [6] * len(PROMPTS))
    layers = len(llm.engine.runner.model.layers)
    assert calls.count("rope_") == 2 * calls.count("silu_and_mul") == 2 * layers * 6  # q and k; six steps


@needs_cuda
def test_cuda_models_run_the_triton_pointwise_ops(tiny_model_dir):
    from kvserve.kernels import pointwise_triton

    options = dict(device="cuda", num_blocks=64, block_size=4, enable_prefix_caching=False, **FP32)
    plain, llm = LLM(str(tiny_model_dir), native_kernels=False, **options), LLM(str(tiny_model_dir), **options)
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.ops is layer.mlp.ops is layer.input_layernorm.ops is pointwise_triton
    assert plain.engine.runner.model.layers[0].self_attn.ops is None
    _assert_same_steps(plain, llm, PROMPTS, [NEW] * len(PROMPTS))


def _assert_same_steps(reference: LLM, llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> None:
    """Both engines, given these prompts together, take the same steps with the same logits (1e-4) and free every block."""
    logits = [[], []]
    for engine, steps in zip((reference.engine, llm.engine), logits):
        for prompt, n in zip(prompts, max_tokens):
            engine.add_request(prompt, greedy(n))
        while engine.has_unfinished_requests():
            engine.step()
            steps.append(engine.runner.last_logits.cpu())
        assert engine.kv_manager.pool.num_used == 0
    assert len(logits[0]) == len(logits[1])
    for a, b in zip(*logits):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


# a random feature draft's tree: two guesses deep, the first with two runners-up beside it
TREE = "eagle:model={},k=2,width=3,lookup=0,min_acceptance=0,min_speedup=0"


@pytest.fixture(scope="module")
def tiny_feature_draft(tmp_path_factory):
    """A random feature draft for the tiny models' 64-wide states."""
    from kvserve.spec_decode.eagle import FeatureDraft

    path = tmp_path_factory.mktemp("tiny-feature-draft")
    torch.manual_seed(0)
    FeatureDraft(64, 64, 1e-5).save(path, None)
    return path


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    """Gemma 3: sliding layers (12 tokens) between global ones, head dim 16, its own query scale."""
    from tests.test_architectures import GEMMA

    path = tmp_path_factory.mktemp("tiny-gemma3")
    save_tiny(path, "gemma3_text", **GEMMA)
    return path


@pytest.mark.parametrize("model,options", [
    ("tiny_model_dir", {}),
    ("tiny_sliding_dir", {}),
    ("tiny_gemma3_dir", {}),
    ("tiny_model_dir", dict(kv_policy="streaming:sinks=2,window=16")),  # compacted caches, positions apart from slots
    ("tiny_model_dir", dict(speculative="ngram:k=3,min_speedup=0")),  # guesses: a row each, over its own context
    ("tiny_sliding_dir", dict(speculative=TREE)),  # a tree's rows skip their other branches' keys, a window past them
], ids=["llama", "sliding-layer", "gemma3", "streaming", "ngram", "tree"])
def test_cuda_backend_decodes_as_sdpa(model, options, request, monkeypatch):
    """The in-place decode path gives SDPA's logits at every step, with prefill chunks and decodes mixed; on CUDA
    op by op here (graphs: the tests below)."""
    from kvserve.attention import cuda

    path = str(request.getfixturevalue(model))
    if options.get("speculative") == TREE:
        options = dict(options, speculative=TREE.format(request.getfixturevalue("tiny_feature_draft")))
    options = dict(device=DEVICE, num_blocks=160, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=40,
                   native_kernels=False, enforce_eager=True, **FP32, **options)
    llms = [LLM(path, **options) for _ in range(2)]
    llms[0].engine.runner.backend = llms[0].engine.runner.sdpa
    llms[1].engine.runner.backend = cuda.CUDABackend(llms[1].engine.runner.kv_cache)
    real, calls, masked = cuda.paged_decode, [], []
    monkeypatch.setattr(cuda, "paged_decode", lambda *a, **k: calls.append(len(a[0])) or masked.append(k.get("hidden") is not None)
                        or real(*a, **k))
    _assert_same_steps(*llms, PROMPTS, [8] * len(PROMPTS))
    assert calls
    if "speculative" in options:
        assert max(calls) > len(PROMPTS)  # guesses attended in place: more rows than sequences
    assert any(masked) == ("width" in options.get("speculative", ""))  # a tree's rows skip keys in place


@needs_cuda
@pytest.mark.parametrize("model,speculative", [("tiny_model_dir", None), ("tiny_sliding_dir", None), ("tiny_sliding_dir", TREE)],
                         ids=["llama", "sliding-layer", "tree"])
def test_cuda_graphs_replay_what_eager_steps_compute(model, speculative, request):
    path = str(request.getfixturevalue(model))
    prompts = PROMPTS + [list(range(5, 25))]  # 5 sequences: the bucket of 8, with 3 padding rows
    if speculative == TREE:  # a tree's masks in the graphs' buffer, cleared for the one-token steps after
        speculative = TREE.format(request.getfixturevalue("tiny_feature_draft"))
    options = dict(device="cuda", num_blocks=64, block_size=4, enable_prefix_caching=False, speculative=speculative, **FP32)
    eager, graphs = LLM(path, enforce_eager=True, **options), LLM(path, **options)
    assert eager.engine.runner.graphs is None and graphs.engine.runner.graphs is not None
    outputs = []
    for llm in (eager, graphs):
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(NEW), use_tqdm=False)])
        assert llm.engine.kv_manager.pool.num_used == 0
    assert outputs[0] == outputs[1]
    assert {size for size, _ in graphs.engine.runner.graphs.graphs} == {1, 2, 4, 8, 16, 32, 48, 64}  # all captured at start-up
    steps = []
    for llm in (eager, graphs):
        llm.engine.add_request(prompts[1], greedy(2))
        llm.engine.step()  # the prompt
        llm.engine.step()  # a decode: the bucket of 1
        steps.append(llm.engine.runner.last_logits.cpu())
    torch.testing.assert_close(steps[1], steps[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("speculative", [None, "ngram:k=3,min_speedup=0", TREE], ids=["none", "ngram", "tree"])
def test_decode_graph_buffers_give_the_eager_steps(tiny_sliding_dir, monkeypatch, speculative, request):
    """The graphs' fixed buffers (bucketed batch sizes, padding rows that write no K/V, block tables as wide as
    the context window; with guesses, a row a token) give what the step's own tensors give; on the CPU each
    "replay" runs the model over the buffers eagerly (the capture itself: the next test, on CUDA)."""
    from kvserve.attention.cuda import CUDABackend
    from kvserve.engine.cuda_graphs import DecodeGraphs

    class Replay:
        def __init__(self, graphs, size, width):
            self.run = lambda: graphs.model(graphs.input_ids[:size], graphs.context(size, width))
            self.hidden, self.width = self.run(), width

        def replay(self):
            replayed.append(self.width)
            self.hidden.copy_(self.run())

    def capture(graphs, size, width):
        return (replay := Replay(graphs, size, width)), replay.hidden

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    if speculative == TREE:
        speculative = TREE.format(request.getfixturevalue("tiny_feature_draft"))
    options = dict(device=DEVICE, num_blocks=200, block_size=4, enable_prefix_caching=False, native_kernels=False, enforce_eager=True,
                   max_num_seqs=20, speculative=speculative, **FP32)
    # 6 sequences, then fewer as the shorter requests finish; the first, 268 tokens, splits while it runs
    prompts = [list(range(1, 250)) + list(range(1, 20))] + PROMPTS + [list(range(5, 25))]
    llms = [LLM(str(tiny_sliding_dir), **options) for _ in range(2)]
    llms[0].engine.runner.backend = llms[0].engine.runner.sdpa
    runner = llms[1].engine.runner
    runner.backend = CUDABackend(runner.kv_cache)
    runner.graphs = DecodeGraphs(runner.model, runner.backend, 20, 512 // 4)
    assert runner.graphs.sizes == [1, 2, 4, 8, 16, 20]
    runner.graphs.capture()  # over the empty buffers: writes no K/V
    # each bucket twice: tables 512 keys wide (split, at these sizes) and 256 (SPLIT_KEYS, not split)
    assert set(runner.graphs.graphs) == {(size, width) for size in (1, 2, 4, 8, 16, 20) for width in (128, 64)}
    assert not any(t.any() for store in runner.kv_cache.k + runner.kv_cache.v for t in store.values())
    rows, run, replayed, trees = [], DecodeGraphs.run, [], []
    monkeypatch.setattr(DecodeGraphs, "run", lambda graphs, ids, ctx: rows.append(len(ids))
                        or trees.append(ctx.groups[0].hidden is not None) or run(graphs, ids, ctx))
    _assert_same_steps(*llms, prompts, [4 + 3 * i for i in range(len(prompts))])
    assert replayed.index(64) > 0 and set(replayed[replayed.index(64):]) == {64}  # the long one's steps, then the short graphs
    assert any(trees) == ("width" in (speculative or ""))  # a tree's steps replayed, each row's skipped keys in a buffer
    if speculative:
        assert max(rows) > len(prompts)  # the sequences' guesses replayed as rows of their own
    else:
        assert set(rows) == {1, 2, 3, 4, 5, 6}  # the batch shrinking as requests finish: buckets 1, 2, 4 and 8


def test_decode_graphs_clear_a_trees_masks_for_the_steps_after():
    """A tree's step leaves its rows' masks in the graphs' buffer; the next step without one clears them all (a row
    that was padding then may be a sequence's next)."""
    from types import SimpleNamespace

    from kvserve.attention import ForwardContext, QueryGroup
    from kvserve.engine.cuda_graphs import DecodeGraphs

    cache = SimpleNamespace(device=torch.device("cpu"), block_size=4, k=[])
    graphs = DecodeGraphs(None, SimpleNamespace(windows=[None], cache=cache), 8, 16)
    graphs.graphs = {(size, 16): (SimpleNamespace(replay=lambda: None), torch.zeros(size, 2)) for size in graphs.sizes}

    def step(n: int, hidden: torch.Tensor | None) -> list[int]:
        rows = torch.arange(n)
        group = QueryGroup(rows[:, None], rows, [torch.zeros(n, 2, dtype=torch.long)], [None], rows, [torch.full((n,), 5)],
                           in_order=True, hidden=hidden)
        backend = SimpleNamespace(step_arguments=lambda ctx: None)
        graphs.run(torch.zeros(n, dtype=torch.long), ForwardContext(rows, [rows], [group], backend))
        return graphs.hidden.tolist()

    assert step(4, torch.tensor([5, 0, 3, 1])) == [5, 0, 3, 1, 0, 0, 0, 0]
    assert step(2, torch.tensor([2, 0])) == [2, 0, 3, 1, 0, 0, 0, 0]  # rows 2 and 3: padding now, attending over nothing
    assert step(2, None) == [0] * 8
    assert step(4, None) == [0] * 8


def test_cuda_backend_choice_follows_the_layout_triton_and_enforce_eager(tiny_model_dir, tiny_model_dir_d32, monkeypatch):
    from kvserve.attention.cuda import CUDABackend
    from kvserve.engine.cuda_graphs import DecodeGraphs
    from kvserve.engine.model_runner import _cuda_backend

    def choice(path, **options):
        runner = LLM(str(path), device="cpu", native_kernels=False, num_blocks=16, **options).engine.runner
        backend, graphs = _cuda_backend(runner.model, runner.sdpa, runner.config, 512)
        return "sdpa" if backend is runner.sdpa else type(backend).__name__, graphs

    backend, graphs = choice(tiny_model_dir)
    assert backend == "CUDABackend" and isinstance(graphs, DecodeGraphs) and graphs.tables.shape[2] == 512 // 16
    assert choice(tiny_model_dir, enforce_eager=True) == ("CUDABackend", None)
    assert choice(tiny_model_dir_d32, kv_cache_dtype="int8") == ("sdpa", None)  # quantized blocks: SDPA dequantizes them
    assert CUDABackend.supports(LLM(str(tiny_model_dir), device="cpu", num_blocks=16, dtype="bfloat16").engine.runner.kv_cache)
    monkeypatch.setitem(sys.modules, "kvserve.attention.cuda", None)  # as if Triton were missing
    assert choice(tiny_model_dir) == ("sdpa", None)


def test_the_startup_line_says_how_cuda_decode_steps_run():
    from types import SimpleNamespace

    from kvserve.entrypoints.cli import startup_note

    def note(device, graphs):
        return startup_note(SimpleNamespace(tiers=None, config=SimpleNamespace(kv_cache_memory="1GiB", num_blocks=None),
                                            runner=SimpleNamespace(device=torch.device(device), graphs=graphs)))

    graphs = SimpleNamespace(sizes=[1, 2, 4], graphs=dict.fromkeys(range(5)), capture_seconds=1.234)
    assert note("cuda", graphs) == "; decode steps as CUDA graphs (5 for 3 batch sizes, captured in 1.2 s)"
    assert note("cuda", None) == "; decode steps op by op (no CUDA graphs)"
    assert note("cpu", None) == ""


def test_the_default_step_budget_and_pool_follow_the_device(monkeypatch):
    """512 tokens a step on a CPU, 8192 on a GPU (where a step's cost is mostly fixed); a 1 GiB KV pool on a CPU
    (RAM other programs use too), half the free memory on a GPU; an explicit value stays."""
    from kvserve.config import EngineConfig

    def defaults(**options) -> tuple[int, str]:
        config = EngineConfig(**options)
        config.validate()
        return config.max_num_batched_tokens, config.kv_cache_memory

    assert defaults(device="cpu") == (512, "1GiB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert defaults() == (8192, "50%") and defaults(max_num_batched_tokens=64, kv_cache_memory="2GiB") == (64, "2GiB")
    assert defaults(device="cpu") == (512, "1GiB")


@needs_cuda
def test_free_cuda_memory_counts_what_torch_holds_unused():
    from kvserve.kv.cache import free_memory

    device = torch.device("cuda")
    before = free_memory(device)
    held = torch.empty(2**30, dtype=torch.uint8, device=device)
    assert free_memory(device) == pytest.approx(before - 2**30, abs=64 * 2**20)
    del held  # back to torch's cache, not to the driver: still free for the pool
    assert torch.cuda.mem_get_info(device)[0] < before - 2**29
    assert free_memory(device) == pytest.approx(before, abs=64 * 2**20)


@needs_cuda
def test_a_cuda_pool_takes_half_the_memory_free_after_loading(tiny_model_dir, monkeypatch):
    from kvserve.kv import cache

    monkeypatch.setattr(cache, "free_memory", lambda device: 8 * 2**20 if device.type == "cuda" else 0)
    engine = LLM(str(tiny_model_dir), device="cuda", **FP32).engine
    block = engine.layout.block_bytes()
    assert engine.kv_manager.num_blocks == 4 * 2**20 // block and engine.kv_usage()["total_bytes"] <= 4 * 2**20
    assert engine.runner.kv_cache.device.type == "cuda"


@needs_cuda
def test_mixed_steps_compile_no_kernel_variant_of_their_own(tiny_sliding_dir, monkeypatch):
    """The decode kernel compiled when the graphs were captured serves decodes beside prefill chunks too, whatever
    their block tables' widths and windows: a compile mid-run stalls every request for a second or so."""
    import triton

    llm = LLM(str(tiny_sliding_dir), device="cuda", num_blocks=64, block_size=4, max_num_batched_tokens=40,
              enable_prefix_caching=False, **FP32)
    from kvserve.attention import cuda

    compiled, beside = [], []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda *a, **kw: compiled.append(str(kw.get("repr"))))
    attend = cuda.CUDABackend.attend
    monkeypatch.setattr(cuda.CUDABackend, "attend", lambda self, g, j, q, group, *a: beside.append(cuda.in_place(group))
                        or attend(self, g, j, q, group, *a))
    prompts = PROMPTS + [list(range(5, 60))]  # chunked over several steps beside the others' decodes
    llm.generate(prompts, greedy(NEW), use_tqdm=False)
    assert any(beside)  # decodes attended in place in mixed steps
    assert not [r for r in compiled if "_paged_decode" in r or "_write_slots" in r], compiled
