from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.errors import KVServeError

if TYPE_CHECKING:
    import torch

# The RoPE scalings kvserve computes, with the numbers each reads from the config
ROPE_FIELDS = {"default": (), "linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# How K and V may be stored: "auto", then kvserve.kv.formats.FORMATS' names (named here, where settings are read
# without torch)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "kivi2")


@dataclass(slots=True)
class ModelConfig:
    """A decoder's architecture, read from a Hugging Face config.json; each architecture adds its own
    settings (`CausalLM.hf_options`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    layer_types: tuple[str, ...] = ()  # "full_attention" or "sliding_attention" per layer
    local_rope_theta: float | None = None  # sliding layers' RoPE base, where it differs (Gemma 3)
    rope_freq_factors: list[float] | None = None  # a GGUF file's rope_freqs: each frequency divided by its factor
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # MLA (DeepSeek): the cache holds a kv_lora_rank latent and a qk_rope_head_dim key per token (head_dim is the latter)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek's RoPE pairs adjacent dims; rows are reordered to rotate-half at load

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> ModelConfig:
        """`where`: what a bad size is said to be in (a GGUF file's settings come from its metadata)."""
        from kvserve.memory.spec import hf_layer_types
        from kvserve.models.registry import model_class

        arch = model_class(cfg)
        check_hf_sizes(cfg, where=where)
        _check_settings(cfg, where)
        if cfg.get("mlp_bias"):
            raise KVServeError("mlp_bias is not supported")
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope_settings(cfg, where)
        eos = cfg.get("eos_token_id")
        layer_types = hf_layer_types(cfg)
        config = cls(
            model_type=cfg["model_type"],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            layer_types=layer_types,
            rope_freq_factors=cfg.get("rope_freq_factors"),
            qkv_bias=bool(cfg.get("attention_bias")),
            o_bias=bool(cfg.get("attention_bias")),
            hidden_act=cfg.get("hidden_act") or "silu",
        )
        for name, value in arch.hf_options(cfg).items():
            setattr(config, name, value)
        if config.hidden_act not in ACTIVATIONS:
            raise KVServeError(f"unsupported hidden_act {config.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        return config

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# On AMX a GGUF model's steps of more tokens than this attend their prompts in bf16 (bf16_prompt_attention): prefill
# of 2,048 tokens 1.58x as fast; a chunk of a prompt gets the same numbers whatever its length up to here.
BF16_PROMPT_ATTENTION_ROWS = 192
HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")  # what every config.json gives
_OPTIONAL_SIZES = ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_hf_sizes(cfg: dict, required: tuple[str, ...] = (*HF_SIZES, "intermediate_size"), where: str = "config.json") -> None:
    """config.json's sizes, before they size tensors: a missing or bad one was a KeyError or torch's own error."""
    for key in HF_SIZES + _OPTIONAL_SIZES:
        value = cfg.get(key)
        if (value is not None or key in required) and (type(value) is not int or value <= 0):
            raise KVServeError(f"{where}: {key} must be a positive integer, got {value!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv_heads:
        raise KVServeError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if type(eps) not in (int, float) or not 0 <= eps < 1:
        raise KVServeError(f"{where}: rms_norm_eps must be a small non-negative number, got {eps!r}")


def _check_settings(cfg: dict, where: str) -> None:
    """config.json's other values the engine reads, whose wrong types were taken as they came (attention_bias "no" is
    true; an eos_token_id "2" never ended a request)."""
    for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise KVServeError(f"{where}: {key} must be true or false, got {cfg[key]!r}")
    for key in ("bos_token_id", "eos_token_id"):
        value = cfg.get(key)
        if not all(type(t) is int and t >= 0 for t in (value if isinstance(value, list) else [] if value is None else [value])):
            raise KVServeError(f"{where}: {key} must be a token id or a list of them, got {value!r}")
    window, types = cfg.get("sliding_window"), cfg.get("layer_types")
    if window is not None and (type(window) is not int or window < 0):
        raise KVServeError(f"{where}: sliding_window must be a number of tokens, got {window!r}")
    if types is not None and (not isinstance(types, list) or len(types) != cfg["num_hidden_layers"]
                              or not set(types) <= {"full_attention", "sliding_attention"}):
        raise KVServeError(f"{where}: layer_types must name full_attention or sliding_attention for each of the "
                           f"{cfg['num_hidden_layers']} layers, got {types!r:.120}")


def _rope_settings(cfg: dict, where: str) -> tuple[float, dict | None]:
    """transformers 5 writes `rope_parameters` (per layer type for hybrid models: the global layers' here);
    older configs write `rope_theta` and `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    params = params.get("full_attention", params) if isinstance(params, dict) else params
    if not isinstance(params, dict):
        raise KVServeError(f"{where}: rope_parameters must be an object, got {params!r:.80}")
    params = dict(params)
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_FIELDS:
        raise KVServeError(f"unsupported RoPE scaling {rope_type!r}; supported: {', '.join(ROPE_FIELDS)}")
    for name, value in (("rope_theta", theta), *((key, params.get(key)) for key in ROPE_FIELDS[rope_type])):
        if type(value) not in (int, float) or value <= 0:
            raise KVServeError(f"{where}: RoPE's {name} must be a positive number, got {value!r}")
    return float(theta), (None if rope_type == "default" else {**params, "rope_type": rope_type})


def memory_share(value: str | int) -> float | None:
    """'50%' -> 0.5; None for a size in bytes."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(value.strip()[:-1]) / 100
        except ValueError:
            raise KVServeError(f"invalid share {value!r}; use a percentage such as 50%") from None
    return None


def parse_named(text: str, what: str) -> tuple[str, dict[str, str]]:
    """'NAME:key=value,...' -> (NAME, {key: value}); `what` names the option in errors (an item not name=value, a
    key given twice)."""
    name, _, args = text.strip().partition(":")
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in args.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key or not value:
            raise KVServeError(f"{what} option {item!r} is not name=value")
        if key in values:
            raise KVServeError(f"{what} option {key} is given twice ({values[key]} and {value})")
        values[key] = value
    return name.strip(), values


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, 1024 -> 1024."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise KVServeError(f"invalid size {value!r}; use bytes or a unit such as 512MiB or 2GiB")
    number, unit, binary = m.groups()
    base = 1024 if binary or not unit else 1000
    return int(float(number) * base ** " kmgt".index(unit.lower() or " "))


_OPTION_TYPES = {"int": int, "str": str, "bool": bool, "None": type(None), "list[str]": list}


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; `validate` turns bad values into one clear error."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else CPU
    block_size: int = 16
    # The KV pool: bytes ("2GiB") or a share of the memory free once the weights are loaded ("50%");
    # None: 1GiB on CPU (RAM others use too), 50% on CUDA (validate sets it).
    kv_cache_memory: int | str | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # tokens a step holds; None: 512 on CPU, 8192 on CUDA (validate sets it)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_tiers: list[str] = field(default_factory=list)  # KV tiers past the pool, fastest first: "cpu:4GiB", "disk:DIR[:SIZE]"
    preemption_mode: str = "recompute"
    scheduler: str = "continuous"
    use_kv_cache: bool = True
    # CPU fp32: kvserve.kernels for decode attention and a GGUF file's own 4/8-bit blocks; CUDA: Triton RoPE and SiLU-and-mul
    native_kernels: bool = True
    # float32 models: "bfloat16" keeps the linear layers' weights in bf16 (fp32 activations cast at each matmul,
    # ~4x the FLOP/s on CPUs with AVX512-BF16 or AMX); "auto" does so on such CPUs; both multiply a GGUF file's
    # own blocks by int8-quantized activations (per 32 values, as llama.cpp does); "float32" is fp32 throughout.
    matmul_dtype: str = "auto"
    # How K and V are stored (kvserve.kv.formats): "auto" is float16 unless the matmuls are fp32 (bf16, or a GGUF
    # file's int8 ones: see kv_dtypes), else the model's dtype;
    # cache_type_k / cache_type_v set one of them apart. kivi2 keeps each request's newest kivi_residual tokens in
    # 16-bit floats (residual_dtype).
    kv_cache_dtype: str = "auto"
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    kivi_residual: int = 128
    kv_policy: str | None = None  # which cached tokens requests keep, e.g. "streaming:sinks=4,window=1024" (kvserve.kv.policies)
    speculative: str | None = None  # a proposer, e.g. "ngram:k=4" (kvserve.spec_decode)
    # A prompt's tokens attend as decode queries (the decode kernel, each over its own context), and every step's rows
    # multiply as int8 (on AMX too, whose bf16 tiles would take steps of many rows), so a request's numbers never depend
    # on what shares its steps or how its prompt is chunked; long prompts prefill slower.
    batch_invariant: bool = False
    enforce_eager: bool = False  # CUDA: run decode steps op by op instead of replaying CUDA graphs of them (vLLM's flag)
    seed: int = 0

    def validate(self) -> None:
        for f in fields(self):  # by the annotations: "int | None" and so on (a bool is not an int here)
            names, value = [t.strip() for t in f.type.split("|")], getattr(self, f.name)
            allowed = tuple(_OPTION_TYPES[t] for t in names)
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed) or (
                    isinstance(value, list) and not all(isinstance(v, str) for v in value)):
                raise KVServeError(f"{f.name} must be {' or '.join(names)}, got {value!r}")
        checks = [
            (self.dtype in ("float32", "bfloat16", "float16"), f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}"),
            (self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"),
            (self.num_blocks is None or self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}"),
            (self.preemption_mode in ("recompute", "swap"), f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}"),
            (self.scheduler in ("continuous", "static"), f"scheduler must be continuous or static, got {self.scheduler!r}"),
            (self.use_kv_cache or self.scheduler == "continuous", "use_kv_cache=False needs the continuous scheduler"),
            (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64, f"seed must be a 64-bit integer, got {self.seed!r}"),
            (self.matmul_dtype in ("auto", "float32", "bfloat16"), f"matmul_dtype must be auto, float32 or bfloat16, got {self.matmul_dtype!r}"),
            *((name in KV_CACHE_DTYPES, f"{flag} must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
              for flag, name in (("kv_cache_dtype", self.kv_cache_dtype), ("cache_type_k", self.cache_type_k or "auto"),
                                 ("cache_type_v", self.cache_type_v or "auto"))),
        ]
        for ok, message in checks:
            if not ok:
                raise KVServeError(message)
        _check_device(self.device)  # before kv_dtypes, which asks for the device
        cuda = self.torch_device.type == "cuda"
        if self.max_num_batched_tokens is None:  # a CPU step's cost grows with its tokens; a GPU's is mostly fixed per step
            self.max_num_batched_tokens = 8192 if cuda else 512
        if self.kv_cache_memory is None:
            self.kv_cache_memory = "50%" if cuda else "1GiB"
        if "kivi2" in self.kv_dtypes and (self.kivi_residual < 0 or self.kivi_residual % self.block_size):
            raise KVServeError(f"kivi_residual must be a multiple of the block size ({self.block_size}), got {self.kivi_residual}")
        if self.speculative is not None:
            from kvserve.spec_decode.proposers import parse_speculative

            parse_speculative(self.speculative)
            if self.scheduler == "static":
                raise KVServeError("speculative decoding needs the continuous scheduler")
        if self.batch_invariant and "kivi2" in self.kv_dtypes:
            raise KVServeError("batch_invariant cannot run with a kivi2 cache: it packs a request's older tokens to 2 bits between "
                               "steps, so what a prompt's later tokens attend to depends on how the prompt is chunked")
        if self.scheduler == "static" and "kivi2" in self.kv_dtypes:
            raise KVServeError("the static baseline reserves whole requests up front and has no kivi2 residual; use the continuous scheduler")
        share = memory_share(self.kv_cache_memory)
        if (share is None and parse_size(self.kv_cache_memory) <= 0) or (share is not None and not 0 < share <= 1):
            raise KVServeError(f"kv_cache_memory must be a positive size or a share of free memory in (0%, 100%], "
                               f"got {self.kv_cache_memory!r}")

    @staticmethod
    def check_names(names) -> None:
        """Each name an engine option: LLM(bogus=1) was Python's TypeError, which named no choices."""
        known = [f.name for f in fields(EngineConfig) if f.name != "model"]
        for name in names:
            if name not in known:
                raise KVServeError(f"unknown engine option {name!r}; choose from {', '.join(known)}")

    @property
    def torch_device(self) -> torch.device:
        import torch  # here, not at the top: `kvserve serve`'s HTTP process reads settings without torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def bf16_matmuls(self) -> bool:
        """Whether a float32 model's linear layers multiply in bf16 (see matmul_dtype)."""
        if self.dtype != "float32":
            return False
        auto = self.matmul_dtype == "auto" and self.torch_device.type == "cpu" and cpu_has_native_bf16()
        return self.matmul_dtype == "bfloat16" or auto

    @property
    def bf16_prompt_attention(self) -> bool:
        """Whether the prompt tokens of a step of more than BF16_PROMPT_ATTENTION_ROWS tokens attend in bf16 (SDPA
        over bf16 queries, keys and values; decode attention stays fp32): a GGUF model's int8 matmuls on a CPU with
        AMX, whose kernels multiply such steps in bf16 already (kernels/quant_matmul.cpp; not with batch_invariant,
        which keeps them on int8 rows). A dense model's bf16 matmuls take every step alike, and so does its attention:
        a request's numbers do not depend on the tokens beside it."""
        return self.int8_matmuls and cpu_has_amx() and not self.batch_invariant

    @property
    def int8_matmuls(self) -> bool:
        """Whether a GGUF model's linear layers multiply its packed blocks by int8 activations (the CPU kernels,
        where the runner finds them built; see matmul_dtype)."""
        from kvserve.models.registry import is_gguf

        cpu_kernels = self.native_kernels and self.dtype == "float32" and self.torch_device.type == "cpu"
        return cpu_kernels and self.matmul_dtype != "float32" and is_gguf(self.model)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def residual_dtype(self) -> str:
        """kivi2's newest tokens: float16 for a float32 model (KIVI keeps them in fp16; half the bytes of fp32,
        and on SmolLM2 float16 KV gives float32's greedy tokens), else the model's dtype."""
        return "float16" if self.dtype == "float32" else self.dtype

    @property
    def kv_dtypes(self) -> tuple[str, str]:
        """The KV cache dtypes of K and V, "auto" resolved: float16 where the linear layers do not multiply in fp32
        (bf16, or int8 activations against a GGUF file's blocks), as llama.cpp's default cache: half the bytes,
        perplexity unchanged to 0.01%; else the model's dtype."""
        auto = "float16" if self.bf16_matmuls or self.int8_matmuls else self.dtype
        resolve = lambda name: auto if name == "auto" else name  # noqa: E731
        base = self.kv_cache_dtype
        return resolve(self.cache_type_k or base), resolve(self.cache_type_v or base)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; none where there is no such file)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN multiplies bf16 in hardware (elsewhere it emulates, no faster than fp32)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_amx() -> bool:
    """AMX tiles: oneDNN's bf16 GEMMs and the kernels' steps of many rows run on them."""
    return "amx_bf16" in cpu_flags()


def _check_device(device: str) -> None:
    if device in ("auto", "cpu"):
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise KVServeError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise KVServeError(f"device {device!r} was asked for, but torch sees no CUDA GPU (torch {torch.__version__})")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise KVServeError(f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
