"""The FastAPI app: OpenAI routes, tokenizer routes, health, Prometheus metrics and the live KV page."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.engine.detokenizer import serial, token_bytes, token_text
from kvserve.engine.prompts import PromptEncoder
from kvserve.errors import KVServeError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.engine_core import EngineDeadError, QueueFullError
from kvserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingRequest,
                                     TokenizeRequest, chat_logprobs, completion_logprobs, envelope, new_id, usage)

STATIC = Path(__file__).parent / "static"
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/kv/")  # /kv/state names live requests


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def merge(streams: list[AsyncIterator[tuple[int, RequestOutput]]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Several requests' outputs, each with its request's index, as they come; closing this closes (and aborts) them
    all. One request's stream is its own (n=1, the common case: no task, queue or generator more per token)."""
    return streams[0] if len(streams) == 1 else _interleave(streams)


async def _interleave(streams: list[AsyncIterator[tuple[int, RequestOutput]]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as e:
            queue.put_nowait(e)
        queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, answer: Awaitable):
    """The answer, unless its client leaves first: a non-streaming answer can take minutes (without max_tokens it runs
    to the context window), and nothing else tells it the client is gone. Cancelled, it closes its requests' streams,
    which aborts them (a stream aborts its own request when closed); a streaming answer returns at once."""
    task, gone = asyncio.ensure_future(answer), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)  # nobody reads it (nginx's code for a client that closed the connection)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":  # the body is read: the next message is the disconnect
        pass


class RequireAPIKey:
    """`Authorization: Bearer <key>` on the API routes. Plain ASGI: Starlette's BaseHTTPMiddleware would
    pass every streamed chunk through an extra memory stream."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, _digest(f"Bearer {api_key}".encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            # compared in constant time, as digests: how long a wrong key took must not say how much of it was right
            if not hmac.compare_digest(_digest(dict(scope["headers"]).get(b"authorization", b"")), self.expected):
                response = error_response(401, "missing or wrong API key: send Authorization: Bearer <key>",
                                          "authentication_error", "invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class Server:
    """Request handling shared by the routes: validation, submission, response shapes."""

    def __init__(self, async_engine: AsyncEngine, model_name: str):
        self.async_engine, self.model_name, self.facts = async_engine, model_name, async_engine.facts
        self.metrics = async_engine.metrics
        self.tokenizer = serial(self.facts.tokenizer)
        self.prompts = PromptEncoder(self.tokenizer, self.facts.model)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "not_found_error", "model_not_found")

    def decode(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or "bytes:\\xNN..." for part of a UTF-8 character."""
        return token_text(self.tokenizer, token_id) if self.tokenizer else str(token_id)

    def raw(self, token_id: int) -> bytes:
        return token_bytes(self.tokenizer, token_id) if self.tokenizer else b""

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        text = self.prompts.apply_chat_template([m.model_dump() for m in req.messages])
        return self.prompts.tokenize(text, add_special_tokens=False)

    async def submit(self, req: SamplingRequest, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None,
                     prefix: str, prompt_logprobs: int | None = None) -> tuple[str, list[AsyncIterator[RequestOutput]]]:
        """Start one engine request per prompt, each with n completions (they share its prefill), all or none (the
        engine validates every prompt before any starts); choice index = prompt * n + completion."""
        req.check_supported()
        if max_tokens is not None and max_tokens < 1 and prompt_logprobs is None:  # SamplingParams' message names its own field
            hint = " (or 0 with echo: true, to return the prompt alone)" if isinstance(req, CompletionRequest) else ""
            raise APIError(400, f"max_tokens must be >= 1{hint}, got {max_tokens}")
        if len(prompts) * req.n > self.async_engine.max_waiting:  # could never fit, however idle the server: not a 503
            raise APIError(400, f"one request may carry at most {self.async_engine.max_waiting} prompts x n; this one has "
                                f"{len(prompts)} prompt(s) x n={req.n} = {len(prompts) * req.n}")
        request_id = new_id(prefix)  # no max_tokens: the engine's None, up to the request's limit
        jobs = [(f"{request_id}-{k}", ids, req.sampling_params(max_tokens, logprobs, prompt_logprobs)) for k, ids in enumerate(prompts)]
        return request_id, await self.async_engine.add(jobs)

    async def complete(self, req: CompletionRequest):
        self.check_model(req.model)
        given = [req.prompt] if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)) else req.prompt
        if not given:
            raise APIError(400, "prompt must not be empty")
        prompts = [self.prompts.tokenize(p) for p in given]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        request_id, streams = await self.submit(req, prompts, max_tokens, req.logprobs, "cmpl", req.prompt_logprobs)
        texts = self._prompt_texts(given, prompts) if req.echo else [""] * len(prompts)
        prompt_tokens = sum(map(len, prompts))
        if req.stream:
            return self._stream(self._completion_chunks(req, request_id, streams, prompt_tokens, texts))
        finals = await self._collect(streams)
        choices = [{"index": i * req.n + c.index, **self._completion_body(req, out, texts[i], c.text, c.token_ids, c.logprobs, 0, req.echo),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, out in enumerate(finals) for c in out.outputs]
        return envelope("text_completion", request_id, self.model_name, choices, usage=usage(prompt_tokens, finals))

    def _completion_body(self, req: CompletionRequest, out: RequestOutput, prompt_text: str, text: str, token_ids: list[int],
                         logprobs: list | None, offset: int, echo: bool) -> dict:
        """`text` and the logprobs of `token_ids` (starting at `offset` in the choice's text), after the prompt's if `echo`."""
        if echo:
            text, token_ids, offset = prompt_text + text, out.prompt_token_ids + token_ids, 0
            logprobs = None if logprobs is None else out.prompt_logprobs + logprobs
        shown = req.logprobs is not None and logprobs is not None
        return {"text": text, "logprobs": completion_logprobs(logprobs, token_ids, self.decode, self.raw, offset) if shown else None}

    async def chat(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        ids = self.chat_prompt(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens  # 0 is an error, not "unset"
        request_id, streams = await self.submit(req, [ids], max_tokens, logprobs, "chatcmpl")
        if req.stream:
            return self._stream(self._chat_chunks(req, request_id, streams, len(ids)))
        finals = await self._collect(streams)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason, "logprobs": chat_logprobs(c.logprobs, self.decode, self.raw) if c.logprobs is not None else None}
                   for c in finals[0].outputs]
        return envelope("chat.completion", request_id, self.model_name, choices, usage=usage(len(ids), finals))

    def _prompt_texts(self, prompts: list, ids: list[list[int]]) -> list[str]:
        """Each prompt's text, what echo repeats: token ids decoded after the engine checked them."""
        decode = self.tokenizer.decode if self.tokenizer else lambda _: ""
        return [p if isinstance(p, str) else decode(t) for p, t in zip(prompts, ids)]

    async def _collect(self, streams: list[AsyncIterator[tuple[int, RequestOutput]]]) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(merge(streams)) as merged:
            async for index, out in merged:
                if out.finished:
                    finals[index] = out
        return [finals[i] for i in range(len(streams))]

    def _stream(self, chunks: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _completion_chunks(self, req, request_id, streams, prompt_tokens, texts) -> AsyncIterator[str]:
        created, finals, extra, echoed = int(time.time()), {}, _usage_field(req), set()
        async for update in choice_updates(streams, req.n):
            if isinstance(update, dict):
                yield sse(update)
                break
            index, c, out = update
            first, prompt_text = index not in echoed, texts[index // req.n]
            echoed.add(index)
            new = c.new_token_ids
            logprobs = c.logprobs[len(c.logprobs) - len(new):] if c.logprobs is not None else None
            offset = len(prompt_text) * req.echo + len(c.text) - len(c.new_text)
            body = self._completion_body(req, out, prompt_text, c.new_text, new, logprobs, offset, req.echo and first)
            choice = {"index": index, **body, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            yield sse(envelope("text_completion", request_id, self.model_name, [choice], created, **extra))
            if out.finished:  # each completion that ended in this output brings it: counted once
                finals[index // req.n] = out
        if extra:
            yield sse(envelope("text_completion", request_id, self.model_name, [], created,
                               usage=usage(prompt_tokens, list(finals.values()))))
        yield sse("[DONE]")

    async def _chat_chunks(self, req, request_id, streams, prompt_tokens) -> AsyncIterator[str]:
        created, finals, extra = int(time.time()), {}, _usage_field(req)

        def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None, stop: int | str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}
            return sse(envelope("chat.completion.chunk", request_id, self.model_name, [choice], created, **extra))

        for index in range(req.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for update in choice_updates(streams, req.n):
            if isinstance(update, dict):
                yield sse(update)
                break
            index, c, out = update
            new = c.logprobs[len(c.logprobs) - len(c.new_token_ids):] if c.logprobs is not None else None
            logprobs = chat_logprobs(new, self.decode, self.raw) if new else None
            if c.new_text or logprobs:
                yield chunk(index, {"content": c.new_text}, logprobs=logprobs)
            if c.finished:
                yield chunk(index, {}, c.finish_reason, stop=c.stop_reason)
            if out.finished:  # each completion that ended in this output brings it: counted once
                finals[index // req.n] = out
        if extra:
            yield sse(envelope("chat.completion.chunk", request_id, self.model_name, [], created,
                               usage=usage(prompt_tokens, list(finals.values()))))
        yield sse("[DONE]")


async def choice_updates(streams, n: int) -> AsyncIterator[tuple[int, CompletionOutput, RequestOutput] | dict]:
    """Each completion's updates as its prompt's request streams: (choice index = prompt * n + completion,
    the completion, its request's output); a failure mid-stream becomes one OpenAI error payload (the status is
    already sent). Closing this closes (and aborts) the requests."""
    done = set()
    async with aclosing(merge(streams)) as merged:
        try:
            async for i, out in merged:
                for c in out.outputs:
                    index = i * n + c.index
                    if index not in done and (c.new_token_ids or c.new_text or c.finished):
                        if c.finished:
                            done.add(index)
                        yield index, c, out
        except (KVServeError, EngineDeadError) as e:
            yield {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}


def _usage_field(req: SamplingRequest) -> dict:
    return {"usage": None} if req.stream_options and req.stream_options.include_usage else {}


def create_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app for a started engine (AsyncEngine.start); the app's shutdown stops it."""
    server = Server(async_engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.attach(asyncio.get_running_loop())
        yield
        async_engine.stop()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)

    if api_key:
        app.add_middleware(RequireAPIKey, api_key=api_key)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await until_disconnect(request, server.complete(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await until_disconnect(request, server.chat(req))

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "kvserve",
                "max_model_len": server.facts.max_request_tokens}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve; ids may hold slashes
    async def model(model: str):
        server.check_model(model)
        return card()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt or messages")
        ids = server.chat_prompt(req) if req.messages is not None else server.prompts.tokenize(req.prompt, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.facts.max_request_tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        server.check_model(req.model)
        vocab = server.facts.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})")
        if server.tokenizer is None:
            raise APIError(400, f"{server.facts.model} has no tokenizer")
        return {"prompt": server.tokenizer.decode(req.tokens)}

    @app.get("/health")
    async def health():
        if not server.async_engine.alive:
            return error_response(503, "the engine process is not running", "server_error")
        return {}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv/state")
    async def kv_state():
        return {"model": model_name, **await server.async_engine.snapshot()}

    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.kind, e.code)

    @app.exception_handler(KVServeError)
    async def bad_request(request: Request, e: KVServeError):
        return error_response(400, str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}"
                             for err in e.errors()[:5])
        return error_response(400, f"invalid request: {problems}")

    @app.exception_handler(QueueFullError)
    async def busy(request: Request, e: QueueFullError):
        return error_response(503, str(e), "server_error", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def dead(request: Request, e: EngineDeadError):
        return error_response(503, str(e), "server_error")
