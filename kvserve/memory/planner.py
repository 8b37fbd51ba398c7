"""KV-cache arithmetic: bytes per token, totals, capacity on a device, and a roofline of prefill and decode."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import parse_size
from kvserve.errors import KVServeError
from kvserve.memory.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class KVDtype:
    name: str
    bits: int
    scale_bytes_per_group: int  # fp16 scale (and zero point) stored per `group_size` values; 0: per tensor


KV_DTYPES = {
    "fp32": KVDtype("fp32", 32, 0), "bf16": KVDtype("bf16", 16, 0), "fp16": KVDtype("fp16", 16, 0),
    "fp8": KVDtype("fp8", 8, 0), "int8": KVDtype("int8", 8, 2),
    "int4": KVDtype("int4", 4, 4), "2bit": KVDtype("2bit", 2, 4),  # asymmetric: scale + zero point
}
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    memory: int  # bytes
    flops: float  # dense bf16 FLOP/s
    bandwidth: float  # bytes/s


DEVICES = {
    "h100-80gb": Device("H100 SXM 80GB", 80 * 10**9, 989e12, 3.35e12),
    "h100-pcie": Device("H100 PCIe 80GB", 80 * 10**9, 756e12, 2.0e12),
    "h200": Device("H200 141GB", 141 * 10**9, 989e12, 4.8e12),
    "a100-80gb": Device("A100 SXM 80GB", 80 * 10**9, 312e12, 2.039e12),
    "a100-40gb": Device("A100 40GB", 40 * 10**9, 312e12, 1.555e12),
    "l4": Device("L4 24GB", 24 * 10**9, 121e12, 0.3e12),
    "rtx-4090": Device("RTX 4090 24GB", 24 * 10**9, 165e12, 1.008e12),
}


def kv_dtype(name: str) -> KVDtype:
    if name not in KV_DTYPES:
        raise KVServeError(f"unknown KV dtype {name!r}; choose from {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def value_bytes(elements: int, dtype: KVDtype, group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """Bytes for `elements` cached values, quantization scales included."""
    return elements * dtype.bits / 8 + (-(-elements // group_size)) * dtype.scale_bytes_per_group


def kv_bytes_per_token(spec: ModelSpec, dtype: KVDtype | str = "bf16", group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """Bytes one more token adds while every layer still holds it (short contexts)."""
    dtype = kv_dtype(dtype) if isinstance(dtype, str) else dtype
    return spec.num_layers * value_bytes(spec.kv_elements_per_layer(), dtype, group_size)


def kv_bytes(spec: ModelSpec, context: int, batch: int = 1, dtype: KVDtype | str = "bf16",
             group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """KV bytes of `batch` sequences of `context` tokens; sliding-window layers hold at most their window."""
    dtype = kv_dtype(dtype) if isinstance(dtype, str) else dtype
    per_layer = value_bytes(spec.kv_elements_per_layer(), dtype, group_size)
    held = sum(min(context, spec.window_of(i) or context) for i in range(spec.num_layers))
    return batch * held * per_layer


def mha_factor(spec: ModelSpec) -> float:
    """How many times more KV the same model would cache with full multi-head attention."""
    return spec.mha_kv_elements_per_layer() / spec.kv_elements_per_layer()


@dataclass(frozen=True, slots=True)
class Capacity:
    memory: int
    weight_bytes: int
    utilization: float
    kv_budget: int
    max_requests: dict[int, int]  # context length -> requests that fit


def capacity(spec: ModelSpec, memory: int, contexts: list[int], dtype: str = "bf16", weight_bytes: int | None = None,
             weight_bits: int = 16, utilization: float = 0.9) -> Capacity:
    if not 0 < utilization <= 1:
        raise KVServeError(f"utilization must be in (0, 1], got {utilization}")
    weights = weight_bytes if weight_bytes is not None else spec.num_params() * weight_bits // 8
    budget = int(memory * utilization) - weights  # negative when the weights alone do not fit
    fits = {c: max(0, int(budget // kv_bytes(spec, c, 1, dtype))) for c in contexts}
    return Capacity(memory, weights, utilization, budget, fits)


def blocks_that_fit(budget: int | str, block_size: int, bytes_per_token: float) -> int:
    """How many KV blocks a byte budget holds: the engine sizes its pool with this."""
    return int(parse_size(budget) // (block_size * bytes_per_token))


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def bound(self, device: Device) -> str:
        return "compute" if self.intensity > device.flops / device.bandwidth else "memory"

    def seconds(self, device: Device) -> float:
        return max(self.flops / device.flops, self.bytes / device.bandwidth)


def roofline(spec: ModelSpec, batch: int, context: int, dtype: str = "bf16", weight_bits: int = 16) -> tuple[Phase, Phase]:
    """Prefill of `batch` prompts of `context` tokens, and one decode step of `batch` sequences at `context`."""
    weights = spec.active_params() * weight_bits / 8
    attn_width = spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim if spec.is_mla else spec.head_dim)
    matmul = 2 * spec.active_params()
    prefill_attention = 2 * spec.num_layers * batch * context * context * attn_width  # QK^T and PV, causal half
    prefill = Phase("prefill", matmul * batch * context + prefill_attention, weights + kv_bytes(spec, context, batch, dtype))
    decode_attention = 4 * spec.num_layers * batch * context * attn_width
    decode = Phase("decode", matmul * batch + decode_attention, weights + kv_bytes(spec, context, batch, dtype))
    return prefill, decode
