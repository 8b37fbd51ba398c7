"""The offline Python API, in the style of vLLM: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import threading
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
        self._start(LLMEngine(EngineConfig(model=model, **engine_options)))

    def _start(self, engine: LLMEngine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer
        # Every call's requests share the engine's steps: a stream's or another thread's outputs wait in their call's
        # queue, and the lock lets one thread at a time touch the engine (whose state is not thread-safe).
        self._outputs: dict[str, deque[RequestOutput]] = {}
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(LLMEngine(config))
        return llm

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, add_special_tokens: bool = True) -> list[RequestOutput]:
        """Run every prompt through the engine together; results come back in input order, each with
        `params.n` completions in `.outputs`. `params` is one for all prompts or, as in vLLM, one per prompt.
        Calls from several threads run together, batched in the same steps."""
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
        with self._lock:
            parsed = [self._prompt(p, add_special_tokens) for p in prompts]
            for (ids, _), p in zip(parsed, each):  # reject a bad prompt before any work starts
                self.engine.check_request(ids, p)
            arrived: deque[RequestOutput] = deque()
            ids = [self._add(t, p, text, arrived) for (t, text), p in zip(parsed, each)]
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
                prefill = decode = seconds = 0.0
                while True:
                    with self._lock:
                        while arrived:
                            if (out := arrived.popleft()).finished:
                                results[out.request_id] = out
                                bar.update(1)
                        if len(results) == len(ids):
                            break
                        self._step()
                        step = self.engine.last_step
                    prefill, decode, seconds = prefill + step.prefill_tokens, decode + step.decode_tokens, seconds + step.seconds
                    bar.set_postfix_str(f"prefill {prefill / max(seconds, 1e-9):.0f} tok/s, decode {decode / max(seconds, 1e-9):.0f} tok/s", refresh=False)
        finally:  # interrupted (Ctrl-C in a notebook): the requests left would hold their blocks and run in the next call
            self._drop(ids)
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
        with self._lock:
            ids, text = self._prompt(prompt, add_special_tokens)
            request_id = self._add(ids, params or SamplingParams(), text, deque())
        try:
            while True:
                with self._lock:
                    while not self._outputs[request_id]:
                        self._step()
                    out = self._outputs[request_id].popleft()
                    if out.finished:  # its queue goes now, not when the generator is closed or collected
                        del self._outputs[request_id]
                yield out
                if out.finished:
                    return
        finally:
            self._drop([request_id])

    def _add(self, ids: list[int], params: SamplingParams, text: str | None, outputs: deque[RequestOutput]) -> str:
        """Add a request whose outputs go to `outputs` (its call's queue)."""
        request_id = self.engine.add_request(ids, params, prompt_text=text)
        self._outputs[request_id] = outputs
        return request_id

    def _step(self) -> None:
        """One engine step, its outputs to their requests' queues (outputs of requests added elsewhere are dropped); an
        output its reader has not taken yet is merged into the request's new one."""
        if not self.engine.has_unfinished_requests():  # a request's last output was lost: a bug, not a wait forever
            raise RuntimeError("the engine has no requests left to step, but a caller still waits for one")
        for out in self.engine.step():
            if (waiting := self._outputs.get(out.request_id)) is not None:
                if waiting and waiting[-1].request_id == out.request_id:
                    out = out.after(waiting.pop())
                waiting.append(out)

    def _drop(self, request_ids: list[str]) -> None:
        """Abort these requests (those still running) and forget their outputs."""
        with self._lock:
            for request_id in request_ids:
                self._outputs.pop(request_id, None)
                self.engine.abort_request(request_id)

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
