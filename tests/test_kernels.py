"""kvserve.kernels: quantized weights (packing, dequantizing, matmuls) equal the gguf package's values and plain torch; paged
decode attention and the small ops equal torch; the engine answers the same with them."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM
from kvserve.kernels import Activations, native_ops
from tests.conftest import FP32, assert_fused_paths_agree, greedy

pytestmark = pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A GGUF tensor's blocks [rows, bytes]: quantized by the gguf package where it can (legacy types), else random
    bytes with small fp16 super-block scales (K-quants, which it only dequantizes)."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    weights, nbytes = gguf.constants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    scales = lambda: (rng.random((rows, cols // weights, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == T.Q6_K:
        blocks[..., 208:210] = scales()
    else:
        blocks[..., 0:2], blocks[..., 2:4] = scales(), scales()  # d, dmin
    return blocks.reshape(rows, -1)


def packed(qtype, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernels' packed weight, the gguf package's dequantized values)."""
    blocks = random_blocks(qtype, rows, cols, seed)
    values = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    return native_ops().gguf_pack(torch.from_numpy(blocks), int(qtype)), values


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8-activation kernels see it: each block of 32 values rounded to a multiple of max|x| / 127."""
    g = x.unflatten(-1, (-1, 32))
    scale = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((g * inv).round() * scale).flatten(-2)


def _widths(qtype) -> list[int]:
    """Row widths: whole groups of four blocks and tails of one to three (legacy types); one to three super-blocks."""
    return [32, 96, 160, 576] if gguf.constants.GGML_QUANT_SIZES[qtype][0] == 32 else [256, 768]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_weights_dequantize_to_the_gguf_packages_values(qtype, isa):
    for cols in _widths(qtype):
        w, values = packed(qtype, 37, cols, seed=cols)
        assert torch.equal(native_ops().gguf_dequantize(w, int(qtype), cols, torch.float32), values), cols
        assert torch.equal(native_ops().gguf_dequantize(w, int(qtype), cols, torch.bfloat16), values.bfloat16()), cols


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_selected_rows_are_those_rows(qtype, isa):
    """Rows picked out of panels and out of the rows past them (an embedding lookup, a draft's vocabulary) come out
    packed as rows of their own: the same values, and the same products."""
    cols = _widths(qtype)[-1]
    w, values = packed(qtype, 45, cols, seed=3)  # two panels of 16 rows, then 13
    for ids in ([44, 0, 17, 33, 5], list(range(44, -1, -2)), list(range(45))):
        rows = native_ops().gguf_select(w, torch.tensor(ids), int(qtype), cols)
        assert torch.equal(native_ops().gguf_dequantize(rows, int(qtype), cols, torch.float32), values[ids])
        assert torch.equal(native_ops().gguf_rows(w, torch.tensor(ids), int(qtype), cols), values[ids])  # dequantized in place
        x = torch.randn(3, cols)
        assert torch.equal(native_ops().gguf_matmul(x, rows, int(qtype), True), native_ops().gguf_matmul(x, w, int(qtype), True)[:, ids])
    for op in (native_ops().gguf_select, native_ops().gguf_rows):
        with pytest.raises(RuntimeError, match="row 45 is past 45 rows"):
            op(w, torch.tensor([3, 45]), int(qtype), cols)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_equals_dequantized_fp32(qtype, int8, isa):
    """Every type, rows 1..64, odd row counts and widths: fp32 math on the gguf package's values (and, for int8
    activations, on the activations as the kernel quantizes them; on AMX, from 32 rows, on both rounded to bf16), to
    float rounding."""
    for cols in _widths(qtype):
        w, values = packed(qtype, 45, cols, seed=cols)
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 31, 32, 33, 64):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
            x[0, :32] = 0  # a block of zeros: scale 0
            out = native_ops().gguf_matmul(x, w, int(qtype), int8)
            if int8 and isa == "amx" and rows >= 32:
                a, b = x.bfloat16().float(), values.bfloat16().float()
            else:
                a, b = (int8_rows(x) if int8 else x), values
            want = a @ b.T
            bound = 1e-5 * (a.abs() @ b.abs().T) + 1e-6  # float rounding of the sum of |x w| terms
            assert ((out - want).abs() <= bound).all(), (cols, rows, float(((out - want).abs() / bound).max()))


@pytest.mark.parametrize("activations", list(Activations), ids=lambda a: a.name)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(qtype, activations, isa):
    """Speculative verification multiplies a sequence's guesses with its last token, and batch_invariant every
    step's rows: each row must come out bit for bit as it would alone, so that verified tokens equal one-token
    decoding. On AMX, int8 activations take the bf16 tiles from 32 rows (other numbers), unless told not to."""
    w, _ = packed(qtype, 40, 256)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([native_ops().gguf_matmul(x[i:i + 1], w, int(qtype), activations) for i in range(40)])
    tiles = isa == "amx" and activations == Activations.INT8
    for rows in range(2, 41):
        same = torch.equal(native_ops().gguf_matmul(x[:rows], w, int(qtype), activations), alone[:rows])
        assert same == (not tiles or rows < 32), rows


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_argmax_is_numpys_argmax_of_its_output(qtype, int8, threads, isa):
    """The LM head's greedy tokens, found as each thread's outputs land: NumPy's argmax of the same output, the first
    of tied largest values (a row's twin in another thread's columns), a NaN counted as largest."""
    w_rows, cols = 100, 256
    blocks = random_blocks(qtype, w_rows, cols)
    blocks[90] = blocks[3]  # twins: x near row 3's values makes them the largest outputs, tied
    blocks[60] = blocks[20]
    nan_blocks = blocks.copy()
    nan_blocks[70, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # a NaN scale: row 70's outputs are NaN
    values = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    x = torch.cat([values[[3, 20]], torch.randn(3, cols, generator=torch.Generator().manual_seed(2))])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (blocks, nan_blocks):
            w = native_ops().gguf_pack(torch.from_numpy(b), int(qtype))
            for rows in range(1, len(x) + 1):
                out, argmax = native_ops().gguf_matmul_argmax(x[:rows], w, int(qtype), int8)
                torch.testing.assert_close(out, native_ops().gguf_matmul(x[:rows], w, int(qtype), int8), rtol=0, atol=0, equal_nan=True)
                assert argmax.tolist() == out.numpy().argmax(-1).tolist(), rows
            assert argmax[:2].tolist() == ([3, 20] if b is blocks else [70, 70])
    finally:
        torch.set_num_threads(before)


def test_kernel_isa_can_be_forced():
    before = native_ops().kernel_isa()
    native_ops().set_kernel_isa("avx2")
    assert native_ops().kernel_isa() == "avx2"
    native_ops().set_kernel_isa(before)
    with pytest.raises(RuntimeError, match="kernel ISA must be avx2, avx512_vnni or amx, got sse"):
        native_ops().set_kernel_isa("sse")


def test_kernel_timers_count_attention_apart_from_the_matmuls():
    """bench/decode.py splits a step's kernel time: attention adds to both counters, a matmul to the kernels' only."""
    ops = native_ops()
    cache = torch.randn(64, 16, 2, 64)
    tables, lens = torch.arange(64).view(1, 64), torch.tensor([1000])
    kernels, attention = ops.kernel_seconds(), ops.attention_seconds()
    ops.paged_decode_attention(torch.randn(1, 4, 64), [cache], [cache], tables, lens, 0.125, 0, 0, [], [], 0)
    spent = ops.attention_seconds() - attention
    assert spent > 0 and ops.kernel_seconds() - kernels >= spent - 1e-9  # the same nanoseconds, in doubles
    w, _ = packed(T.Q8_0, 256, 128)
    kernels, attention = ops.kernel_seconds(), ops.attention_seconds()
    ops.gguf_matmul(torch.randn(1, 128), w, int(T.Q8_0))
    assert ops.kernel_seconds() > kernels and ops.attention_seconds() == attention


def test_unsupported_type_and_mismatched_rows_are_clear_errors():
    with pytest.raises(RuntimeError, match="GGUF type 10 has no kvserve kernel"):
        native_ops().gguf_pack(torch.zeros(4, 84, dtype=torch.uint8), 10)  # Q2_K
    w, _ = packed(T.Q4_1, 4, 64)
    with pytest.raises(RuntimeError, match="expected packed rows of 20 bytes"):
        native_ops().gguf_matmul(torch.randn(1, 32), w, int(T.Q4_1))
    parts = ([w], [int(T.Q4_1)])  # rows of 64 weights, against x of 32: the fused layer ops check them as gguf_matmul does
    layer = torch.classes.kvserve.DecodeLayer(torch.ones(32), 1e-6, *parts, None, torch.ones(32), 1e-6, *parts, None, *parts, *parts,
                                              False, 1, 1, 1.0)
    with pytest.raises(RuntimeError, match="expected packed rows of 20 bytes"):
        layer.pre(torch.randn(1, 32), torch.ones(1, 1, 2), torch.zeros(1, 1, 2))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1), (10, 2)], ids=["mha", "gqa", "mqa", "gqa5"])
@pytest.mark.parametrize("dim", [20, 64, 72, 128])  # vectors and a scalar tail; one register tile; two (AVX-512: 64 and 128)
@pytest.mark.parametrize("window", [0, 5, 9])  # 0: none; windows that start mid-block
def test_paged_decode_attention_equals_sdpa(heads, kv_heads, dim, window, isa):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    block_size, lens = 16, [1, 7, 16, 23, 50]  # lengths end mid-block and on a block boundary, with 16-key runs and tails
    k_cache, v_cache = (torch.randn(24, block_size, kv_heads, dim, generator=g) for _ in range(2))
    tables = torch.randperm(24, generator=g)[:20].view(len(lens), 4)  # scattered, non-contiguous blocks
    if window:  # blocks wholly before the window are never read: point them past the pool
        for b, n in enumerate(lens):
            tables[b, :max(0, n - window) // block_size] = 10**6
    q = torch.randn(len(lens), heads, dim, generator=g)
    out = native_ops().paged_decode_attention(q, [k_cache], [v_cache], tables, torch.tensor(lens), 0.3, 0, 0, [], [], 0, window)
    for b, n in enumerate(lens):
        first = max(0, n - window) if window else 0
        keys, values = (c[tables[b].clamp(max=23)].flatten(0, 1)[first:n].transpose(0, 1) for c in (k_cache, v_cache))
        expected = F.scaled_dot_product_attention(q[b, :, None], keys, values, scale=0.3, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[b], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dim", [16, 64, 72])  # a vector of values; two 32-value runs; two and a vector
@pytest.mark.parametrize("window", [0, 5, 40])  # 0: none; windows shorter than a tile of queries and longer than 16 keys
@pytest.mark.parametrize("block_size", [8, 16, 48])
def test_paged_prompt_attention_equals_sdpa(heads, kv_heads, dim, window, block_size):
    """Chunks of 1-70 queries after 0-90 cached keys (tiles of 16 queries, runs of 16 keys, across blocks of other
    sizes), each query seeing the keys up to its own (its last `window`): SDPA over the gathered keys, row by row."""
    g = torch.Generator().manual_seed(heads * 100 + dim + window + block_size)
    counts, before = [1, 17, 70, 33, 5], [0, 90, 3, 16, 40]
    lens = [c + p for c, p in zip(counts, before)]
    width = max(-(-n // block_size) for n in lens)
    blocks = len(lens) * width
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, dim, generator=g).half() for _ in range(2))
    tables = torch.randperm(blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(sum(counts), heads, dim, generator=g)
    offsets = np.cumsum([0] + counts)
    index = torch.tensor([[o + min(i, c - 1) for i in range(max(counts))] for o, c in zip(offsets, counts)])  # padding repeats the last
    out = native_ops().paged_prompt_attention(q, [k_cache], [v_cache], tables, torch.tensor(lens), index, 0.3, 1, 1, [], [], 0, window)
    assert out.shape == q.shape
    for b, (n, c) in enumerate(zip(lens, counts)):
        keys, values = (x[tables[b]].flatten(0, 1)[:n].float().transpose(0, 1) for x in (k_cache, v_cache))
        pos = torch.arange(n - c, n)[:, None]
        mask = (torch.arange(n)[None] <= pos) & ((torch.arange(n)[None] > pos - window) if window else True)
        expected = F.scaled_dot_product_attention(q[offsets[b]:offsets[b + 1]].transpose(0, 1), keys, values, attn_mask=mask,
                                                  scale=0.3, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[offsets[b]:offsets[b + 1]], expected, rtol=1e-5, atol=1e-5)


def test_paged_prompt_attention_rejects_bad_query_rows():
    cache = torch.zeros(4, 4, 1, 8)
    attend = lambda index, lens: native_ops().paged_prompt_attention(  # noqa: E731
        torch.zeros(3, 1, 8), [cache], [cache], torch.tensor([[0, 1]]), torch.tensor([lens]), torch.tensor([index]), 1.0, 0, 0, [], [], 0)
    with pytest.raises(RuntimeError, match="query index 3 is outside q"):
        attend([0, 3], 5)
    with pytest.raises(RuntimeError, match="sequence 0 has more queries than keys"):
        attend([0, 1, 2], 2)
    assert attend([0, 1, 2], 5).shape == (3, 1, 8)


@pytest.mark.parametrize("length", [70, 130, 300, 700, 2000])
def test_paged_decode_attention_of_a_row_does_not_depend_on_its_batch(length, isa):
    """A query's output is bit for bit the same alone and beside others: a speculative step's verification
    rows (contexts L, L + 1, ..., over one block table, whose chunks the threads take in turn) then equal the
    one-token steps they stand for, and greedy outputs match."""
    g = torch.Generator().manual_seed(length)
    block_size, blocks = 16, -(-(length + 600) // 16)
    k_cache, v_cache = (torch.randn(blocks, block_size, 2, 64, generator=g).half() for _ in range(2))
    tables = torch.randperm(blocks, generator=g).view(1, blocks).repeat(5, 1)
    tables[3] = torch.randperm(blocks, generator=g)  # another sequence's, between two rows of the first's
    q = torch.randn(5, 6, 64, generator=g)
    attend = lambda rows, lens: native_ops().paged_decode_attention(  # noqa: E731
        q[rows], [k_cache], [v_cache], tables[rows], torch.tensor(lens), 0.125, 1, 1, [], [], 0)
    lens = [length, length + 1, length + 600, length + 2, length + 3]
    alone = [attend([row], [n])[0] for row, n in enumerate(lens)]
    assert torch.equal(attend([0, 1], lens[:2])[0], alone[0])
    batch = attend(list(range(5)), lens)
    assert all(torch.equal(batch[row], alone[row]) for row in range(5))


@pytest.mark.parametrize("prefix", [5, 16, 70, 126, 300])  # the tree starts mid-block, on a boundary, near a chunk's edge
@pytest.mark.parametrize("window", [0, 9])
def test_a_tree_guess_attends_as_the_one_token_step_of_its_branch(prefix, window, isa):
    """A tree of guesses in consecutive slots after `prefix` keys: a guess that skips the other branches' keys
    (hidden) gives, bit for bit, the output of a query whose branch lies in consecutive slots: its chunks, window
    and sums count the keys it sees."""
    from kvserve.spec_decode import hidden_keys, path

    g = torch.Generator().manual_seed(prefix + window)
    parents = [-1, 0, -1, 2, 2, 1, 4]  # two branches under the newest token, a fork under the second
    bs, blocks = 16, 48
    k_cache, v_cache = (torch.randn(blocks, bs, 2, 64, generator=g) for _ in range(2))
    tables = torch.randperm(blocks // 2, generator=g).view(1, -1)
    branch_tables = tables + blocks // 2  # the same prefix, then a branch's keys in consecutive slots
    for cache in (k_cache, v_cache):
        cache.flatten(0, 1)[(branch_tables[0] * bs)[:, None] + torch.arange(bs)] = cache.flatten(0, 1)[(tables[0] * bs)[:, None] + torch.arange(bs)]
    slot = lambda t, p: int(t[0, p // bs]) * bs + p % bs  # noqa: E731
    q = torch.randn(1, 6, 64, generator=g)
    masks = hidden_keys(parents)
    for node in range(len(parents)):
        branch = path(parents, node)
        for cache in (k_cache, v_cache):  # the branch's keys, in order, right after the prefix
            for i, n in enumerate(branch):
                cache.flatten(0, 1)[slot(branch_tables, prefix + 1 + i)] = cache.flatten(0, 1)[slot(tables, prefix + 1 + n)]
        tree = native_ops().paged_decode_attention(q, [k_cache], [v_cache], tables, torch.tensor([prefix + 2 + node]), 0.125, 0, 0,
                                                   [], [], 0, window, hidden=torch.tensor([masks[node]]))
        one = native_ops().paged_decode_attention(q, [k_cache], [v_cache], branch_tables, torch.tensor([prefix + 1 + len(branch)]),
                                                  0.125, 0, 0, [], [], 0, window)
        assert torch.equal(tree, one), node
    assert any(masks)
    with pytest.raises(RuntimeError, match="hides keys before its first"):
        native_ops().paged_decode_attention(q, [k_cache], [v_cache], tables, torch.tensor([3]), 0.125, 0, 0, [], [], 0,
                                            hidden=torch.tensor([0b100]))


def test_paged_decode_attention_rejects_lengths_past_the_table():
    cache = torch.zeros(4, 4, 1, 8)
    with pytest.raises(RuntimeError, match="context length 9 does not fit 2 blocks"):
        native_ops().paged_decode_attention(torch.zeros(1, 1, 8), [cache], [cache], torch.tensor([[0, 1]]), torch.tensor([9]),
                                            1.0, 0, 0, [], [], 0)


def test_paged_decode_attention_rejects_blocks_and_slots_outside_the_pool():
    cache, q, new = torch.zeros(4, 4, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    attend = lambda tables, slots: native_ops().paged_decode_attention(  # noqa: E731
        q, [cache], [cache], torch.tensor([tables]), torch.tensor([5]), 1.0, 0, 0, [], [], 0, 0, new, new, torch.tensor([slots]))
    with pytest.raises(RuntimeError, match="block id out of range"):
        attend([0, 4], 4)
    with pytest.raises(RuntimeError, match="slot 16 is outside the pool"):
        attend([0, 1], 16)
    assert attend([0, 1], 4).shape == (1, 1, 8)


def test_rms_norm_equals_torch():
    x, w = torch.randn(5, 3, 96), torch.randn(96)
    torch.testing.assert_close(native_ops().rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6))


@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_rope_in_place_equals_apply_rotary_on_strided_views(tokens):
    """q and k as the fused qkv projection's strided views, rotated in place; v untouched."""
    from kvserve.layers.rotary import RotaryEmbedding, apply_rotary

    heads, kv_heads, dim = 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    before = qkv.clone()
    cos, sin = RotaryEmbedding(dim, 512, 10000.0, None).tables(torch.randint(0, 512, (tokens,)), torch.float32)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    native_ops().rope_(q, cos, sin)
    native_ops().rope_(k, cos, sin)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], before[:, (heads + kv_heads) * dim:])


@pytest.mark.parametrize("width", [8, 1536, 13])  # one vector; SmolLM2's; a scalar tail only
def test_silu_and_mul_equals_torch(width):
    x = torch.randn(4, 2 * width) * 8  # large magnitudes: exp's clamped range
    x[0, 0], x[1, 1] = 100.0, -100.0
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(native_ops().silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_native_decode_step_equals_plain_torch(tiny_model_dir):
    """Norms, RoPE, SiLU-and-mul and decode attention by kvserve.kernels: the logprobs of plain torch."""
    params = greedy(16, logprobs=2)
    prompt = [(i * 37 + 11) % 250 + 1 for i in range(40)]
    native, plain = (LLM(str(tiny_model_dir), native_kernels=flag, **FP32).generate([prompt], params, use_tqdm=False)[0].outputs[0]
                     for flag in (True, False))
    assert native.token_ids == plain.token_ids
    for a, b in zip(native.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("matmul_dtype", ["auto", "float32"])
def test_fused_decode_layers_give_the_module_paths_logits(matmul_dtype):
    """SmolLM2's decode steps as one native call for the whole layer stack, as fused native ops per layer, and as
    modules: the same greedy tokens, and each step's logprobs equal to float rounding (they run the same kernels
    in the same order)."""
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB", matmul_dtype=matmul_dtype)
    prompts = ["The three primary colors are", "def fibonacci(n):", "Once upon a time"]  # three decodes a step: several rows
    assert_fused_paths_agree(llm, prompts, greedy(24, logprobs=3), tolerance=1e-5)
    stack, layers = llm.engine.runner.backend.stack, llm.engine.runner.model.layers
    x = torch.zeros(1, 576)  # the stack checks a step's arguments before any layer writes
    with pytest.raises(RuntimeError, match="slot 1000000000 is outside the pool"):
        stack.forward(x, torch.tensor([0]), [torch.tensor([[0]])], [torch.tensor([1])], [0], [torch.tensor([10**9])], len(layers), None)
    with pytest.raises(RuntimeError, match="position 1000000000 is past the rotary tables"):
        stack.forward(x, torch.tensor([10**9]), [torch.tensor([[0]])], [torch.tensor([1])], [0], [torch.tensor([0])], len(layers), None)
    whole, table, bs = llm.engine.runner.backend.whole, np.zeros((1, 1, 1), dtype=np.int64), llm.engine.runner.kv_cache.block_size
    with pytest.raises(RuntimeError, match="token id 49152 is past the embedding's 49152 rows"):
        whole.decode([49152], [0], table)
    with pytest.raises(RuntimeError, match=f"position {bs} lies past the block table's 1 blocks"):
        whole.decode([1], [bs], table)
    with pytest.raises(RuntimeError, match="block id out of range"):
        whole.decode([1], [0], table + 10**9)
    with pytest.raises(RuntimeError, match=r"a token and a position per row and block tables \[1 groups"):
        whole.decode([1, 2], [0, 0], table)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3"])
def test_quantized_caches_run_the_stack_with_the_module_paths_logits(kv_dtype):
    """An int8, int4 or fp8 cache's decode steps run as one native call too (the kernel writes their new K/V): the same
    tokens and logprobs as fused layers and as modules."""
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB", kv_cache_dtype=kv_dtype)
    assert_fused_paths_agree(llm, ["The three primary colors are", "def fibonacci(n):"], greedy(16, logprobs=2), tolerance=1e-5)


def test_a_first_build_of_the_kernels_is_announced_and_a_cached_one_is_not(tmp_path, monkeypatch, caplog):
    from kvserve.kernels import announce_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    announce_build("kvserve_kernels_test")
    assert "compiling the native CPU kernels" in caplog.text
    caplog.clear()
    (tmp_path / "kvserve_kernels_test" / "kvserve_kernels_test.so").touch()
    announce_build("kvserve_kernels_test")
    assert caplog.text == ""

    def changed(*args, **kwargs):  # torch's private helper, as another torch version might have it
        raise TypeError("changed")

    monkeypatch.setattr("torch.utils.cpp_extension._get_build_directory", changed)
    announce_build("kvserve_kernels_other")  # no notice, and no error to cost the kernels
    assert caplog.text == ""


def test_the_cpu_description_names_the_first_processor_and_the_kernels_isa(tmp_path):
    from kvserve.kernels import cpu_description

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n\n"
                       "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Other CPU\n")
    isa = native_ops().kernel_isa() if native_ops() is not None else "none (plain torch)"
    assert cpu_description(cpuinfo) == f"AMD EPYC (family 25, model 1), kernels {isa}"
    missing = cpu_description(tmp_path / "absent")  # not Linux: the platform's name, still with the ISA
    assert missing.endswith(f", kernels {isa}") and "family" not in missing
