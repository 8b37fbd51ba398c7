"""Convert a GGUF file once into a Hugging Face-style directory under the kvserve cache.

Reading a GGUF (its 49k-entry tokenizer arrays, dequantization) takes ~20 s for SmolLM2; loading the
converted directory takes well under a second, so every later start reads the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvserve.errors import KVServeError

CONVERTER_VERSION = 2
BLOCKS_FILE = "gguf_blocks.safetensors"  # the file's own 4/8-bit blocks, for kvserve.kernels
_KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def converted_dir(gguf_path: Path) -> Path:
    """The cached conversion of `gguf_path`, made on first use; keyed by the file's SHA-256."""
    target = cache_root() / f"{_file_digest(gguf_path)}-v{CONVERTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        _convert(gguf_path, staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent conversion that won the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _file_digest(path: Path) -> str:
    """SHA-256 of the file, remembered per (path, size, mtime): hashing 100 MB costs seconds at every start."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index_file = cache_root() / "digests.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, json.JSONDecodeError):
        index = {}
    if key not in index:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        index[key] = digest.hexdigest()[:24]
        index_file.parent.mkdir(parents=True, exist_ok=True)
        staging = index_file.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(index))
        os.replace(staging, index_file)
    return index[key]


def _convert(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    config = _hf_config(reader)
    weights, blocks = {}, {}
    for tensor in reader.tensors:
        name, array = _hf_name(tensor.name), _dequantize(tensor)
        raw = np.asarray(tensor.data).reshape(array.shape[0], -1) if tensor.tensor_type.name in _KERNEL_TYPES else None
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            array = _unpermute_rope(array, heads)
            raw = None if raw is None else _unpermute_rope(raw, heads)  # whole rows move, blocks and all
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: the file is mapped read-only
        if raw is not None:
            blocks[name] = torch.from_numpy(np.array(raw, dtype=np.uint8))
    save_file(weights, out / "model.safetensors")
    save_file(blocks, out / BLOCKS_FILE)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, out)


def _dequantize(tensor) -> np.ndarray:
    import gguf

    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise KVServeError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf package "
                           f"(version {_gguf_version()}) cannot dequantize; convert the file to another type") from None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise KVServeError(f"unsupported GGUF architecture {arch!r}; supported: llama")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise KVServeError("GGUF files with rope_freqs (Llama 3.1 scaling) are not supported yet")
    hidden, heads = _field(reader, "llama.embedding_length"), _field(reader, "llama.attention.head_count")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", heads),
        "head_dim": _field(reader, "llama.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, "llama.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if _field(reader, "llama.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _field(reader, "llama.rope.scaling.factor")}
    return config


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[-1]}"
    if parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[-1]}"
    raise KVServeError(f"unexpected tensor {gguf_name!r} in GGUF file")


def _unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; undo it to get Hugging Face's rotate-half layout."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
