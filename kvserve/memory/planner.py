"""KV-cache arithmetic: bytes per token, totals, capacity on a device, and a roofline of prefill and decode."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import KVServeError
from kvserve.kv.formats import FORMATS
from kvserve.kv.policies.minicache import MiniCache
from kvserve.kv.spec import KVLayout, build_layout
from kvserve.memory.spec import ModelSpec


# The planner's short names; anything else is a KV cache dtype of the engine (kvserve.kv.formats).
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "fp8_e4m3", "2bit": "kivi2"}
PLANNER_BLOCK_SIZE = 16
PLANNER_RESIDUAL_DTYPE = "bfloat16"  # kivi2's newest tokens, as a GPU server keeps them


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


def kv_layout(spec: ModelSpec, dtype: str = "bf16", block_size: int = PLANNER_BLOCK_SIZE, merge: MiniCache | None = None) -> KVLayout:
    """The engine's layout for `spec` with KV dtype `dtype`: one name for K and V, or "K/V" (e.g. "int8/int4");
    `merge`: MiniCache's merged layer pairs."""
    k, slash, v = dtype.partition("/")
    v = v if slash else k  # "int8/" names no V
    k, v = ALIASES.get(k, k), ALIASES.get(v, v)
    for name in (k, v):
        if name not in FORMATS:
            raise KVServeError(f"unknown KV dtype {name!r}; choose from {', '.join([*ALIASES, *FORMATS])} or K/V pairs")
    return build_layout(spec, k, v, block_size, residual_dtype=PLANNER_RESIDUAL_DTYPE, merge=merge)


def kv_bytes_per_token(spec: ModelSpec, dtype: str = "bf16") -> float:
    """Bytes one more token adds while every layer still holds it (short contexts), scales included."""
    return kv_layout(spec, dtype).bytes_per_token


def kv_bytes(spec: ModelSpec, context: int, batch: int = 1, dtype: str = "bf16") -> float:
    """KV bytes of `batch` sequences of `context` tokens; sliding-window layers hold at most their window."""
    return batch * kv_layout(spec, dtype).bytes_held(context)


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


def roofline(spec: ModelSpec, batch: int, context: int, dtype: str = "bf16", weight_bits: int = 16,
             weight_bytes: int | None = None) -> tuple[Phase, Phase]:
    """Prefill of `batch` prompts of `context` tokens, and one decode step of `batch` sequences at `context`."""
    weights = weight_bytes if weight_bytes is not None else spec.active_params() * weight_bits / 8
    attn_width = spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim if spec.is_mla else spec.head_dim)
    matmul = 2 * spec.active_params()
    prefill_attention = 2 * spec.num_layers * batch * context * context * attn_width  # QK^T and PV, causal half
    prefill = Phase("prefill", matmul * batch * context + prefill_attention, weights + kv_bytes(spec, context, batch, dtype))
    decode_attention = 4 * spec.num_layers * batch * context * attn_width
    decode = Phase("decode", matmul * batch + decode_attention, weights + kv_bytes(spec, context, batch, dtype))
    return prefill, decode
