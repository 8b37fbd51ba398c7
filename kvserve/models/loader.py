"""Load a model argument into a ModelConfig, its weights and its tokenizer."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import ModelConfig
from kvserve.errors import KVServeError
from kvserve.models.gguf_convert import BLOCKS_FILE, converted_dir
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
    return Checkpoint(model, path, hf_config, ModelConfig.from_hf(hf_config), _load_tokenizer(directory))


def load_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    directory = _weights_dir(checkpoint)
    files = [f for f in sorted(directory.glob("*.safetensors")) if f.name != BLOCKS_FILE]
    if not files:
        raise KVServeError(f"no *.safetensors files in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def load_gguf_blocks(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """A GGUF checkpoint's Q4_0/Q4_1/Q8_0 weights as their raw blocks [rows, bytes], by HF name; {} for others."""
    from safetensors.torch import load_file

    file = _weights_dir(checkpoint) / BLOCKS_FILE
    return load_file(file) if checkpoint.path.suffix == ".gguf" and file.is_file() else {}


def _weights_dir(checkpoint: Checkpoint) -> Path:
    return checkpoint.path if checkpoint.path.is_dir() else converted_dir(checkpoint.path)


def _load_tokenizer(directory: Path):
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    if (directory / "tokenizer.json").is_file():  # the fast path: AutoTokenizer imports seconds of model code
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
