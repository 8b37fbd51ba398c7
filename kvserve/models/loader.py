"""Load a model argument into a ModelConfig, its weights and its tokenizer."""
from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import ModelConfig
from kvserve.errors import KVServeError
from kvserve.layers.quantized import GGUFTensor
from kvserve.models.gguf_convert import TYPES_KEY, WEIGHTS_FILE, converted_dir, copy_without_tokenizer, fast_gguf
from kvserve.models.registry import resolve_model_path


@dataclass(slots=True)
class Checkpoint:
    name: str
    path: Path
    hf_config: dict
    config: ModelConfig
    tokenizer: object | None  # a transformers tokenizer, or None for a directory that ships none


def open_checkpoint(model: str) -> Checkpoint:
    path = resolve_model_path(model)
    directory = converted_dir(path) if path.suffix == ".gguf" else path
    try:
        hf_config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KVServeError(f"cannot read {directory / 'config.json'}: {e}") from e
    if not isinstance(hf_config, dict):
        raise KVServeError(f"{directory / 'config.json'} holds a JSON {type(hf_config).__name__}, not an object")
    config = ModelConfig.from_hf(hf_config, f"{path.name}'s metadata" if path.suffix == ".gguf" else "config.json")
    return Checkpoint(model, path, hf_config, config, _load_tokenizer(directory))


def weights_digest(checkpoint: Checkpoint) -> str:
    """sha256 of the files the model's values come from (a GGUF file; a directory's config.json and safetensors):
    what names the model to a KV tier that outlives the process or serves other machines, where a path and a
    time would miss files rewritten in place and copies elsewhere (~0.07 s for SmolLM2's 98 MB)."""
    path = checkpoint.path
    files = [path] if path.is_file() else [path / "config.json", *_weight_files(path)]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}|{file.stat().st_size}|".encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor | GGUFTensor]:
    """The checkpoint's tensors by Hugging Face name: a GGUF file's quantized ones as their blocks."""
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor | GGUFTensor] = {}
    for file in _weight_files(_weights_dir(checkpoint)):
        try:
            handle = safe_open(file, framework="pt")
        except SafetensorError as e:
            raise KVServeError(f"cannot read {file}: {e}") from e
        with handle as f:
            quantized = json.loads((f.metadata() or {}).get(TYPES_KEY, "{}"))  # name -> [type, rows, columns]
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name in quantized:
                    weights[name] = GGUFTensor(tensor, quantized[name][0], tuple(quantized[name][1:]))
                else:  # a GGUF's few float tensors leave the file's mapping, which closes once the blocks are packed
                    weights[name] = tensor.clone() if quantized else tensor
    return weights


def transformers_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model of a model path (a GGUF file: transformers dequantizes it): the reference kvserve
    is compared with, and the start of a distilled draft."""
    from transformers import AutoModelForCausalLM

    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp, fast_gguf():  # the tokenizer's arrays would cost transformers
        light = Path(tmp) / path.name  # seconds, twice
        copy_without_tokenizer(path, light)
        return AutoModelForCausalLM.from_pretrained(light.parent, gguf_file=light.name, dtype=dtype)


def _weight_files(directory: Path) -> list[Path]:
    """The files transformers reads: the shards an index names, else model.safetensors (or kvserve's conversion of a
    GGUF file). Not every *.safetensors: a feature draft distilled into the same directory left eagle.safetensors,
    whose tensors then did not match the model."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise KVServeError(f"cannot read {index}: {type(e).__name__}: {e}") from e
    files = [directory / name for name in ("model.safetensors", WEIGHTS_FILE) if (directory / name).is_file()]
    if not files:
        raise KVServeError(f"no model.safetensors (or model.safetensors.index.json) in {directory}")
    return files


def _weights_dir(checkpoint: Checkpoint) -> Path:
    return checkpoint.path if checkpoint.path.is_dir() else converted_dir(checkpoint.path)


def _load_tokenizer(directory: Path):
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        if (directory / "tokenizer.json").is_file():  # the fast path: AutoTokenizer imports seconds of model code
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # damaged files raise whatever their parser hits (tokenizers' Rust errors are plain Exception)
        raise KVServeError(f"cannot load the tokenizer in {directory}: {type(e).__name__}: {e}") from e
