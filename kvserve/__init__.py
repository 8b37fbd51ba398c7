"""kvserve: a small LLM inference engine built around the KV cache."""
from kvserve.entrypoints.llm import LLM
from kvserve.errors import KVServeError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "KVServeError"]
