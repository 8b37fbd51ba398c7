"""The offline Python API, in the style of vLLM: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import KVServeError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}
Message = dict[str, str]


class LLM:
    def __init__(self, model: str = "smollm2-135m", **engine_options):
        EngineConfig.check_names(engine_options)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._streams: dict[str, deque[RequestOutput]] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm.tokenizer = llm.engine.tokenizer
        llm._streams = {}
        return llm

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, add_special_tokens: bool = True) -> list[RequestOutput]:
        """Run every prompt through the engine together; results come back in input order, each with
        `params.n` completions in `.outputs`. `params` is one for all prompts or, as in vLLM, one per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise KVServeError(f"prompts must be a prompt or a list of them, got {type(prompts).__name__}")
        params = SamplingParams() if params is None else params
        each = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in each):
            raise KVServeError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")
        if len(each) != len(prompts):
            raise KVServeError(f"{len(each)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        parsed = [self._prompt(p, add_special_tokens) for p in prompts]
        for (ids, _), p in zip(parsed, each):  # reject a bad prompt before any work starts
            self.engine.check_request(ids, p)
        ids = [self.engine.add_request(t, p, prompt_text=text) for (t, text), p in zip(parsed, each)]
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
                prefill = decode = seconds = 0.0
                while len(results) < len(ids):
                    for out in self._step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
                    step = self.engine.last_step
                    prefill, decode, seconds = prefill + step.prefill_tokens, decode + step.decode_tokens, seconds + step.seconds
                    bar.set_postfix_str(f"prefill {prefill / max(seconds, 1e-9):.0f} tok/s, decode {decode / max(seconds, 1e-9):.0f} tok/s", refresh=False)
        finally:  # interrupted (Ctrl-C in a notebook): the requests left would hold their blocks and run in the next call
            for request_id in ids:
                self.engine.abort_request(request_id)
        return [results[i] for i in ids]

    def _prompt(self, prompt: Prompt, add_special_tokens: bool) -> tuple[list[int], str | None]:
        """A prompt's token ids and text."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self.engine.tokenize(prompt["prompt"], add_special_tokens), prompt["prompt"]
            raise KVServeError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return self.engine.tokenize(prompt, add_special_tokens), prompt if isinstance(prompt, str) else None

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               add_special_tokens: bool = True) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that adds to it; the last one is finished. Streams may be
        read in turns, and a `generate` may run while one is open: each step's outputs wait for their stream."""
        ids, text = self._prompt(prompt, add_special_tokens)
        request_id = self.engine.add_request(ids, params or SamplingParams(), prompt_text=text)
        waiting = self._streams[request_id] = deque()
        try:
            while True:
                while not waiting:
                    self._step()
                out = waiting.popleft()
                yield out
                if out.finished:
                    return
        finally:
            del self._streams[request_id]
            self.engine.abort_request(request_id)

    def _step(self) -> list[RequestOutput]:
        """One engine step: the outputs of open streams' requests go to their streams, the others are returned."""
        if not self.engine.has_unfinished_requests():  # a request's last output was lost: a bug, not a wait forever
            raise RuntimeError("the engine has no requests left to step, but a caller still waits for one")
        rest = []
        for out in self.engine.step():
            waiting = self._streams.get(out.request_id)
            if waiting is not None:
                waiting.append(out)
            else:
                rest.append(out)
        return rest

    def chat(self, messages: list[Message] | list[list[Message]], params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several; returns one output per conversation."""
        if not isinstance(messages, list):
            raise KVServeError(f"messages must be a list of messages or of conversations, got {type(messages).__name__}")
        conversations = messages if messages and all(isinstance(c, list) for c in messages) else [messages]
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm, add_special_tokens=False)

    def apply_chat_template(self, messages: list[Message]) -> str:
        return self.engine.apply_chat_template(messages)
