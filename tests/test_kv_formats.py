"""KV formats: round trips within each format's bound, and attention over quantized blocks (the native kernel
for decode, SDPA for prefill chunks) equal to attention over the dequantized copy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import KVServeError
from kvserve.attention.cpu_native import NativeCPUBackend
from kvserve.attention.sdpa import SDPABackend
from kvserve.engine.model_runner import _group
from kvserve.kernels import native_ops
from kvserve.kv.cache import KVCache
from kvserve.kv.formats import FORMATS, get_format, pack_bits, unpack_bits
from kvserve.kv.spec import build_layout
from kvserve.memory import ModelSpec

G = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def _seeded():
    """Each test draws the same values whatever ran before it (pytest-xdist can split a file between workers)."""
    G.manual_seed(0)


def _values(*shape: int) -> torch.Tensor:
    """Normal values with a few large outliers in fixed channels, as real keys have."""
    x = torch.randn(*shape, generator=G)
    x[..., 3] *= 8
    return x


def test_pack_bits_round_trips():
    for bits in (2, 4):
        codes = torch.randint(0, 2**bits, (5, 3, 64), generator=G, dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert packed.shape == (5, 3, 64 * bits // 8)
        assert torch.equal(unpack_bits(packed, bits), codes)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_per_group_integers_within_half_a_step(name):
    fmt, x = get_format(name, "k"), _values(40, 2, 64)
    y = fmt.dequantize_tokens(fmt.quantize_tokens(x), torch.float32)
    groups = x.unflatten(-1, (-1, 32))
    step = groups.abs().amax(-1) / 127 if name == "int8" else (groups.amax(-1) - groups.amin(-1)) / 15
    err = (y - x).abs().unflatten(-1, (-1, 32)).amax(-1)
    assert (err <= step / 2 * 1.01 + 1e-6).all()  # fp16 scales round by at most 2^-11
    assert (err > 0).any()


def test_kivi2_keys_per_channel_values_per_token():
    x = _values(3, 16, 2, 64)  # [blocks, block_size, heads, dim]
    keys, values = get_format("kivi2", "k"), get_format("kivi2", "v")
    assert not keys.per_token and values.per_token
    k = keys.dequantize_blocks(keys.quantize_blocks(x), torch.float32)
    k_step = (x.amax(1) - x.amin(1)) / 3  # per block, head and channel: over the block's tokens
    assert ((k - x).abs().amax(1) <= k_step / 2 * 1.01 + 1e-6).all()
    v = values.dequantize_blocks(values.quantize_blocks(x), torch.float32)
    groups = x.unflatten(-1, (-1, 32))
    v_step = (groups.amax(-1) - groups.amin(-1)) / 3  # per token and group of 32 channels
    assert ((v - x).abs().unflatten(-1, (-1, 32)).amax(-1) <= v_step / 2 * 1.01 + 1e-6).all()
    # per channel suits keys' outlier channels: a smaller error than per token on the same values
    per_token = values.dequantize_blocks(values.quantize_blocks(x), torch.float32)
    assert (k - x).abs().mean() < (per_token - x).abs().mean()


@pytest.mark.parametrize("name,rel", [("bfloat16", 2**-8), ("float16", 2**-11), ("fp8_e4m3", 2**-4), ("fp8_e5m2", 2**-3)])
def test_float_formats_round_to_their_precision(name, rel):
    fmt, x = get_format(name, "k"), torch.randn(100, 2, 32, generator=G) + 3  # away from fp8's subnormals
    y = fmt.dequantize_tokens(fmt.quantize_tokens(x), torch.float32)
    assert ((y - x).abs() <= x.abs() * rel).all()


def test_fp8_saturates_instead_of_overflowing():
    fmt = get_format("fp8_e4m3", "k")
    y = fmt.dequantize_tokens(fmt.quantize_tokens(torch.tensor([[[1e4, -1e4, 1.0]]])), torch.float32)
    assert y.tolist() == [[[448.0, -448.0, 1.0]]]

def test_auto_kv_dtype_follows_the_matmul_precision():
    """auto: float16 where the linear layers multiply in bf16 or a GGUF file's blocks by int8 activations, the
    model's dtype where they are fp32; a dtype named for K or V alone still wins."""
    from kvserve.config import EngineConfig, cpu_has_native_bf16

    assert EngineConfig(device="cpu", matmul_dtype="bfloat16").kv_dtypes == ("float16", "float16")
    assert EngineConfig(device="cpu", matmul_dtype="float32").kv_dtypes == ("float32", "float32")
    assert EngineConfig(device="cpu", model="smollm2-135m").kv_dtypes == ("float16", "float16")  # int8 activations
    dense = "float16" if cpu_has_native_bf16() else "float32"  # auto matmuls are bf16 only where the CPU has them
    assert EngineConfig(device="cpu", model="/m/model.gguf", native_kernels=False).kv_dtypes == (dense, dense)  # no int8 kernels
    assert EngineConfig(device="cpu", model="/m/hf-model-dir").kv_dtypes == (dense, dense)
    assert EngineConfig(device="cpu", dtype="bfloat16").kv_dtypes == ("bfloat16", "bfloat16")
    assert EngineConfig(device="cpu", matmul_dtype="bfloat16", cache_type_k="int8").kv_dtypes == ("int8", "float16")



def test_every_kv_dtype_the_settings_accept_has_formats():
    """config names the KV dtypes (it is read without torch); kv.formats has a pair of formats for each."""
    from kvserve.config import KV_CACHE_DTYPES

    assert KV_CACHE_DTYPES == ("auto", *FORMATS)


def test_bad_kv_dtypes_are_clear_errors(tiny_model_dir):
    from kvserve import LLM

    with pytest.raises(KVServeError, match="kv_cache_dtype must be one of auto, float32.*kivi2, got 'int3'"):
        LLM(str(tiny_model_dir), kv_cache_dtype="int3")
    with pytest.raises(KVServeError, match="cache_type_v must be one of"):
        LLM(str(tiny_model_dir), cache_type_v="q4_0")
    with pytest.raises(KVServeError, match="kivi_residual must be a multiple of the block size \\(16\\), got 100"):
        LLM(str(tiny_model_dir), kv_cache_dtype="kivi2", kivi_residual=100)
    with pytest.raises(KVServeError, match="int4 quantizes groups of 32 values along head_dim, but head_dim is 16"):
        LLM(str(tiny_model_dir), kv_cache_dtype="int4")
    with pytest.raises(KVServeError, match="static baseline"):
        LLM(str(tiny_model_dir), kv_cache_dtype="kivi2", scheduler="static")


# Attention over quantized blocks -------------------------------------------------------------------------------

SPEC = ModelSpec("attn", num_layers=1, hidden_size=256, num_heads=6, num_kv_heads=2, head_dim=64, intermediate_size=1, vocab_size=1)
LENS = [1, 15, 16, 17, 40]  # ragged, ending before, on and after block boundaries
BS = 16
NUM_BLOCKS = 24


def _filled_cache(k_dtype: str, v_dtype: str) -> tuple[KVCache, list[torch.Tensor]]:
    """A cache holding random K/V for sequences of LENS tokens in scattered blocks (kivi2: packed, with
    the newest 16 tokens still in residual blocks)."""
    layout = build_layout(SPEC, k_dtype, v_dtype, BS, residual_tokens=16, residual_dtype="float16")  # as the engine keeps it
    num_blocks, num_residual = NUM_BLOCKS, 24
    cache = KVCache(layout, num_blocks, num_residual if layout.has_residual else 0, torch.float32)
    order = torch.randperm(num_blocks, generator=G).tolist()
    tables = []
    for n in LENS:
        blocks = -(-n // BS)
        ids = [order.pop() + (num_blocks if layout.has_residual else 0) for _ in range(blocks)]
        slots = torch.tensor([ids[t // BS] * BS + t % BS for t in range(n)])
        cache.write(0, _values(n, 2, 64), _values(n, 2, 64), slots)
        if layout.has_residual:  # pack every block older than the newest 16 tokens
            packed = max(0, (n - 16) // BS)
            fresh = [order.pop() for _ in range(packed)]
            if packed:
                cache.pack(list(zip(ids[:packed], fresh)))
            ids[:packed] = fresh
        tables.append(torch.tensor(ids + [0] * (3 - len(ids))))
    return cache, tables


def _reference(cache: KVCache, table: torch.Tensor, q: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Plain softmax attention over the dequantized copy: query i sees keys 0..positions[i]."""
    keys, values = (x[0].repeat_interleave(3, dim=1) for x in cache.gather(0, table[None]))  # [L, H, D]
    out = []
    for qi, p in zip(q, positions):
        scores = torch.einsum("hd,lhd->hl", qi, keys[: p + 1]) / 8
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values[: p + 1]))
    return torch.stack(out)


DTYPES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"), ("fp8_e4m3", "fp8_e4m3"),
          ("fp8_e5m2", "fp8_e5m2"), ("int8", "int8"), ("int4", "int4"), ("kivi2", "kivi2"), ("int8", "int4"), ("kivi2", "int8")]


@pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
@pytest.mark.parametrize("k_dtype,v_dtype", DTYPES, ids=lambda d: d)
def test_native_decode_equals_attention_over_dequantized_copy(k_dtype, v_dtype, isa):
    cache, tables = _filled_cache(k_dtype, v_dtype)
    lens = torch.tensor(LENS)
    q = torch.randn(len(LENS), 6, 64, generator=G)
    group = _group(np.ones(len(LENS), dtype=bool), lens.numpy() - 1, np.ones(len(LENS), dtype=np.int64),
                   np.arange(len(LENS)), [torch.stack(tables).numpy()], BS, [None])
    out = NativeCPUBackend(cache).attend(0, 0, q, group, 1 / 8)
    for b, n in enumerate(LENS):
        torch.testing.assert_close(out[b], _reference(cache, tables[b], q[b:b + 1], [n - 1])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
@pytest.mark.parametrize("k_dtype,v_dtype", [d for d in DTYPES if "float" not in d[0] + d[1]], ids=lambda d: d)
def test_native_decode_reads_codes_as_the_values_they_dequantize_to(k_dtype, v_dtype, isa):
    """Whether the kernel widens a block's codes in registers (AVX-512) or dequantizes them into a buffer first, it reads
    the values the format dequantizes to: its output is bit for bit its output over a float32 copy of them."""
    cache, tables = _filled_cache(k_dtype, v_dtype)
    blocks = NUM_BLOCKS + cache.num_residual  # kivi2's residual blocks' ids follow the main pool's
    copy = KVCache(build_layout(SPEC, "float32", "float32", BS), blocks, 0, torch.float32)
    for store, values in zip((copy.k, copy.v), cache.gather(0, torch.arange(blocks)[None])):
        store[0]["data"].copy_(values.view(store[0]["data"].shape))
    q, lens = torch.randn(len(LENS), 6, 64, generator=G), torch.tensor(LENS)
    out, expected = (native_ops().paged_decode_attention(q, s[0], s[1], torch.stack(tables), lens, 1 / 8, *s[2:])
                     for s in (NativeCPUBackend(c).stores[0] for c in (cache, copy)))
    assert torch.equal(out, expected)


@pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
@pytest.mark.parametrize("k_dtype,v_dtype", [("int8", "int8"), ("float16", "int8"), ("int8", "float32"), ("int4", "int4"), ("int4", "int8"),
                                             ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"), ("fp8_e4m3", "float16"),
                                             ("bfloat16", "float16")], ids=lambda d: d)
@pytest.mark.parametrize("op", ["decode", "write"])
def test_native_decode_writes_new_tokens_as_the_format_quantizes_them(k_dtype, v_dtype, op):
    """A step's new K/V, written by the kernels (the decode op's, or paged_write_kv for a prompt's: float, fp8, int8 and
    int4 stores), are byte for byte what the format's own quantize_tokens writes, so the native and the Python paths
    leave the same cache."""
    layout = build_layout(SPEC, k_dtype, v_dtype, BS)
    native, python = (KVCache(layout, 4, 0, torch.float32) for _ in range(2))
    steps = 64
    k, v = _values(steps, 2, 64), _values(steps, 2, 64) * 1e-3
    k[5, 0, :32] = 0.0  # an all-zero group: scale 0
    # past fp8's ranges (they saturate), ties between fp8 codes (to even), an fp8 subnormal, a half-precision one
    k[6, 1, :10] = torch.tensor([448.0, 464.0, -1e4, 6e4, -1e6, 1.0625, 1.1875, 2.0 ** -8 * 1.5, 3e-7, 2.5])
    slots = torch.randperm(4 * BS, generator=G)[:steps]
    python.write(0, k, v, slots)
    stores = NativeCPUBackend(native).stores[0]
    tables = torch.arange(4).repeat(steps, 1)  # every row sees the whole pool; its new token sits at its slot
    if op == "decode":
        native_ops().paged_decode_attention(torch.randn(steps, 6, 64, generator=G), stores[0], stores[1], tables, slots + 1, 1 / 8,
                                            *stores[2:], 0, k, v, slots)
    else:
        native_ops().paged_write_kv(*stores, k, v, slots)
    for store in ("k", "v"):
        for name, part in getattr(python, store)[0].items():
            assert torch.equal(getattr(native, store)[0][name], part), (store, name)


@pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_native_decode_reads_every_fp8_code_as_torch_does(name):
    """One cached token per sequence: attention returns its V row, so the kernel's reading of all 256 codes (subnormals,
    the largest, NaN) shows, against torch's own conversion."""
    layout = build_layout(SPEC, name, name, BS)
    cache = KVCache(layout, 2, 0, torch.float32)
    codes = torch.arange(256, dtype=torch.uint8).view(2, 2, 64)  # [sequence, head, dim]
    cache.v[0]["data"][:, 0] = codes  # sequence b's token at slot 0 of block b; K all code 0
    stores = NativeCPUBackend(cache).stores[0]
    out = native_ops().paged_decode_attention(torch.randn(2, 6, 64, generator=G), stores[0], stores[1], torch.arange(2).view(2, 1),
                                              torch.ones(2, dtype=torch.long), 1 / 8, *stores[2:])
    expected = codes.view(layout.v_format.dtype).float().repeat_interleave(3, dim=1)  # query heads 0-2 read KV head 0
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("k_dtype,v_dtype", DTYPES, ids=lambda d: d)
@pytest.mark.parametrize("backend", [SDPABackend, NativeCPUBackend] if native_ops() else [SDPABackend], ids=["sdpa", "native"][:1 + bool(native_ops())])
def test_prefill_chunks_attend_over_dequantized_copy(k_dtype, v_dtype, backend):
    cache, tables = _filled_cache(k_dtype, v_dtype)
    counts = torch.tensor([1, 5, 16, 3, 24])  # each sequence's last `count` tokens are this step's chunk
    starts = torch.tensor(LENS) - counts
    offsets = torch.cumsum(counts, 0) - counts
    q = torch.randn(int(counts.sum()), 6, 64, generator=G)
    group = _group((counts > 0).numpy(), starts.numpy(), counts.numpy(), offsets.numpy(), [torch.stack(tables).numpy()], BS, [None])
    out = torch.empty_like(q)
    out[group.flat_index] = backend(cache).attend(0, 0, q, group, 1 / 8)
    for b, n in enumerate(LENS):
        rows = slice(int(offsets[b]), int(offsets[b] + counts[b]))
        expected = _reference(cache, tables[b], q[rows], list(range(int(starts[b]), n)))
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FORMATS))
def test_formats_declare_the_bytes_they_allocate(name):
    layout = build_layout(SPEC, name, name, BS)
    cache = KVCache(layout, 5, 0, torch.float32)
    assert cache.nbytes == 5 * layout.block_bytes()


@pytest.mark.parametrize("name", ["int4", "kivi2", "fp8_e5m2"])
def test_swap_round_trip_is_byte_exact(name):
    """Swapped-out blocks (packed and residual) come back bit for bit into other blocks of the same pools."""
    cache, tables = _filled_cache(name, name)
    ids = tables[-1][:3].tolist()  # the 40-token sequence: kivi2 has packed and residual blocks among these
    saved = cache.copy_out(ids)
    used = {i for t in tables for i in t.tolist()}
    free_main, free_residual = [b for b in range(24) if b not in used], [b for b in range(24, 48) if b not in used]
    targets = [free_main.pop() if i < cache.num_blocks else free_residual.pop() for i in ids]  # other blocks, same pools
    cache.copy_in(targets, saved)
    for src, dst in zip(ids, targets):
        for a, b in zip(cache.copy_out([src]), cache.copy_out([dst])):
            assert torch.equal(a, b)
    torch.testing.assert_close(cache.gather(0, torch.tensor([targets]))[0], cache.gather(0, torch.tensor([ids]))[0], rtol=0, atol=0)
