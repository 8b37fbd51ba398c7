"""kvserve: a small LLM inference engine built around the KV cache."""
from kvserve.errors import KVServeError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "KVServeError"]


def __getattr__(name: str):
    """LLM on first use: `kvserve serve`'s HTTP process imports kvserve's modules without torch."""
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "LLM"})
