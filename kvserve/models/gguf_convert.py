"""Convert a GGUF file once into a Hugging Face-style directory under the kvserve cache.

Reading a GGUF (its 49k-entry tokenizer arrays) takes seconds; loading the converted directory takes well
under a second, so every later start reads the cache. Weights keep the file's own format: quantized
tensors are stored as their rows of blocks (WEIGHTS_FILE, the type of each in its metadata), never
dequantized, so the cache holds about the file's size.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import struct
import tempfile
import threading
import types
from pathlib import Path

import numpy as np
import torch

from kvserve.errors import KVServeError

CONVERTER_VERSION = 4
WEIGHTS_FILE = "gguf_weights.safetensors"
TYPES_KEY = "ggml_types"  # WEIGHTS_FILE's metadata entry: a JSON object, name -> [GGUF type, rows, columns] of each quantized tensor
_FLOAT_TYPES = ("F32", "F16")  # stored as arrays; every other type as its blocks
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}  # general.architecture ->

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms both sides of attention and MLP: its ffn_norm comes before the MLP
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma's chat template (the GGUF files of the base model carry none), for text-only conversations
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] | trim + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


# What the gguf package raises on a damaged or foreign file (KVServeError, a ValueError, passes through _unreadable)
_GGUF_ERRORS = (ValueError, KeyError, IndexError, struct.error)


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
    except _GGUF_ERRORS as e:
        raise _unreadable(gguf_path, e) from e
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


def read_gguf(path: Path):
    """gguf's reader of a file, made fast (fast_gguf)."""
    import gguf

    with fast_gguf():
        try:
            return gguf.GGUFReader(path)
        except _GGUF_ERRORS as e:
            raise _unreadable(path, e) from e


def _unreadable(path: Path, error: Exception) -> KVServeError:
    """One of _GGUF_ERRORS said as ours."""
    return error if isinstance(error, KVServeError) else KVServeError(f"cannot read GGUF file {path}: {error}")


_GGUF_PATCHED = threading.Lock()


@contextlib.contextmanager
def fast_gguf():
    """The gguf package without two of its costs, while kvserve or transformers reads a file through it. Its reader
    parses a vocabulary value by value through views of a numpy.memmap, whose subclass makes each view cost 3x a
    plain array's (Gemma 3's 262k tokens: ~18 s a reading): it gets a plain array over the same map. transformers
    builds gguf's tensor-name map (a function of the architecture and layer count) again for every module of the
    model (6 of the 10 s SmolLM2 took to load): it is built once."""
    import gguf
    import gguf.gguf_reader as reader

    with _GGUF_PATCHED:  # one thread at a time, so each puts back what it found
        numpy, name_map = reader.np, gguf.get_tensor_name_map
        reader.np = types.SimpleNamespace(**{**vars(numpy), "memmap": lambda *a, **kw: numpy.memmap(*a, **kw).view(numpy.ndarray)})
        gguf.get_tensor_name_map = functools.cache(name_map)
        try:
            yield
        finally:
            reader.np, gguf.get_tensor_name_map = numpy, name_map


@fast_gguf()
def _convert(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    config = _hf_config(reader)
    arch = config["model_type"]
    tensors, types = {}, {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # Llama 3.1's RoPE scaling, one factor per frequency
            config["rope_freq_factors"] = _dequantize(tensor).astype(float).tolist()
            continue
        name, qtype = _hf_name(tensor.name, arch), tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        array = np.asarray(tensor.data) if qtype in _FLOAT_TYPES else np.asarray(tensor.data).reshape(shape[0], -1)
        if arch == "gemma3_text" and name.endswith("norm.weight"):
            array, qtype = _dequantize(tensor) - 1, "F32"  # llama.cpp stores Gemma's 1 + weight; Hugging Face stores the weight
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            array = _unpermute_rope(array.reshape(shape[0], -1), heads)  # whole rows move, blocks and all
        if qtype not in _FLOAT_TYPES:
            _check_type(tensor)
            types[name] = [qtype, *shape]
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array).copy())  # a copy: the file is mapped read-only
    save_file(tensors, out / WEIGHTS_FILE, metadata={TYPES_KEY: json.dumps(types)})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if "tokenizer.ggml.model" in reader.fields:  # else prompts come as token ids
        _save_tokenizer(gguf_path, out, arch)


def _check_type(tensor) -> None:
    """A type the engine cannot read is one error now, not at load."""
    import gguf

    try:
        gguf.quants.dequantize(np.asarray(tensor.data)[:1], tensor.tensor_type)
    except NotImplementedError:
        raise KVServeError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf package "
                           f"(version {_gguf_version()}) cannot dequantize; convert the file to another type") from None


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
    if arch not in MODEL_TYPES:
        raise KVServeError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(MODEL_TYPES)}")
    p = f"{arch}."
    names = {t.name for t in reader.tensors}
    hidden, heads = _field(reader, p + "embedding_length"), _field(reader, p + "attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise KVServeError("the GGUF file lists no vocabulary (tokenizer.ggml.tokens)")
    config = {
        "model_type": MODEL_TYPES[arch],
        "vocab_size": len(tokens.data),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, p + "feed_forward_length"),
        "num_hidden_layers": _field(reader, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, p + "attention.head_count_kv", heads),
        "head_dim": _field(reader, p + "attention.key_length", hidden // heads if heads else None),  # 0 heads: named by check_hf_sizes
        "rms_norm_eps": _field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _field(reader, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, p + "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if _field(reader, p + "rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _field(reader, p + "rope.scaling.factor")}
    if arch == "gemma3":
        end_of_turn = _token_id(tokens, "<end_of_turn>")
        config.update(sliding_window=_field(reader, p + "attention.sliding_window"), sliding_window_pattern=6,
                      rope_local_base_freq=10000.0, query_pre_attn_scalar=config["head_dim"],
                      hidden_activation="gelu_pytorch_tanh",
                      eos_token_id=[t for t in (config["eos_token_id"], end_of_turn) if t is not None])
    return config


def _token_id(tokens, text: str) -> int | None:
    for i, part in enumerate(tokens.data):
        if bytes(tokens.parts[part]) == text.encode():
            return i
    return None


def _hf_name(gguf_name: str, arch: str) -> str:
    parts = gguf_name.split(".")
    layer_names = _GEMMA3_NAMES if arch == "gemma3_text" else _LAYER_NAMES
    if parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[-1]}"
    if parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[-1]}"
    raise KVServeError(f"unexpected tensor {gguf_name!r} in a GGUF file of architecture {arch}")


def _unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; undo it to get Hugging Face's rotate-half layout."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _save_tokenizer(gguf_path: Path, out: Path, model_type: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if model_type == "gemma3_text" and not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


def copy_without_tokenizer(src: Path, dst: Path) -> None:
    """`src` without its tokenizer's arrays (the vocabulary's size kept as `<arch>.vocab_size`), tensors byte
    for byte: the gguf package parses a 262k-token vocabulary in ~20 s, and transformers reads a file twice."""
    from gguf import GGUFValueType

    data = np.memmap(src, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if bytes(buf[:4]) != b"GGUF" or version < 2:  # version 1 counted in 32 bits
        raise KVServeError(f"{src} is not a GGUF file of version 2 or later")
    pos, kept, keys, arch, vocab, alignment = 24, [], set(), None, None, 32
    for _ in range(n_kv):
        start = pos
        key, pos = _read_string(buf, pos)
        (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        value_at = pos
        pos = _skip_value(buf, pos, vtype)
        if key == "general.architecture":
            arch = _read_string(buf, value_at)[0]
        elif key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, value_at)[0]
        elif key == "tokenizer.ggml.tokens":
            vocab = struct.unpack_from("<Q", buf, value_at + 4)[0]
        if not (key.startswith("tokenizer.ggml.") and vtype == GGUFValueType.ARRAY):
            kept.append(bytes(buf[start:pos]))
            keys.add(key)
    if vocab is not None and f"{arch}.vocab_size" not in keys:
        key = f"{arch}.vocab_size".encode()
        kept.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", GGUFValueType.UINT32, vocab))
    infos_at = pos
    for _ in range(n_tensors):
        _, pos = _read_string(buf, pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * dims + 4 + 8
    tensors_at = -(-pos // alignment) * alignment
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kept)) + b"".join(kept) + bytes(buf[infos_at:pos])
    with open(dst, "wb") as f:
        f.write(head + bytes(-len(head) % alignment))
        f.write(buf[tensors_at:])


def _read_string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8: pos + 8 + n]).decode(), pos + 8 + n


def _skip_value(buf: memoryview, pos: int, vtype: int) -> int:
    from gguf import GGUFReader, GGUFValueType

    if vtype == GGUFValueType.STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    scalars = GGUFReader.gguf_scalar_to_np  # every other type but arrays: numpy's
    if vtype != GGUFValueType.ARRAY:
        return pos + np.dtype(scalars[GGUFValueType(vtype)]).itemsize
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in scalars:
        return pos + count * np.dtype(scalars[GGUFValueType(etype)]).itemsize
    for _ in range(count):
        pos = _skip_value(buf, pos, etype)
    return pos
