"""The OpenAI-compatible server: chat completions (streamed by server-sent events or not), models, and stored
compressed contexts that chat requests name with the ``context_id`` extension field (docs/serving.md).

Every model computation (compressing a document, answering) runs on one worker thread, one request after another:
requests are serialised, never batched, so a context's cache is never used by two answers at once.
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.budget import Budget
from criticalkv.errors import CriticalKVError, StoredContextError
from criticalkv.runtime.session import ContextSession
from criticalkv.serve.metrics import Metrics
from criticalkv.serve.prompts import TextStream, chat_ids, document_ids, question_ids
from criticalkv.serve.store import ContextStore, UnknownContextError

#: disk-full errors of a store write: answered 507 Insufficient Storage
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class HTTPFailure(Exception):
    """A request refused with ``status`` and a message that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's optional fields (name, ...) are accepted and not used

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" for part in self.content):
            raise HTTPFailure(422, "only text message parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a sampling option we do not honour is refused, not ignored

    model: str
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    temperature: float | None = None  # decoding is greedy: only 0 (or unset) is accepted
    n: int | None = None
    user: str | None = None
    context_id: str | None = None  # extension: answer from this stored compressed context


class ContextRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    document: str


@dataclass
class ServerSettings:
    """What ``create_app`` serves.

    Parameters
    ----------
    model, tokenizer
        The model and its tokenizer.
    model_name
        The id ``GET /v1/models`` lists and chat requests must name.
    store
        The stored contexts.
    method, budget, options
        How documents (and conversations without a stored context) are compressed.
    max_document_tokens
        Longer documents are refused with 413.
    default_max_tokens
        Tokens generated when a request does not say.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    store: ContextStore
    method: str = "critical-snapkv"
    budget: Budget = field(default_factory=lambda: Budget(0.2))
    options: dict[str, object] = field(default_factory=dict)
    max_document_tokens: int = 8192
    default_max_tokens: int = 128


def create_app(settings: ServerSettings) -> FastAPI:
    """The FastAPI application of ``criticalkv serve``."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="criticalkv-model")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.shutdown(wait=True)

    app = FastAPI(
        title="criticalkv", description="Compressed contexts behind an OpenAI-compatible API", lifespan=lifespan
    )
    metrics = Metrics()
    app.state.settings, app.state.worker, app.state.metrics = settings, worker, metrics
    store, tokenizer = settings.store, settings.tokenizer

    async def on_worker(function, *args):
        return await asyncio.wrap_future(worker.submit(function, *args))

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.request(getattr(route, "path", "unknown"), response.status_code)
        return response

    @app.exception_handler(HTTPFailure)
    async def refused(request: Request, failure: HTTPFailure) -> JSONResponse:
        return JSONResponse({"error": {"message": failure.message, "code": failure.status}}, failure.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": settings.model_name, "contexts_held": store.held_count()}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        text = metrics.render(store.held_bytes(), store.held_count())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "owned_by": "criticalkv"}]}

    @app.post("/v1/contexts")
    async def create_context(body: ContextRequest) -> dict:
        ids = document_ids(tokenizer, body.document)
        if ids.shape[1] > settings.max_document_tokens:
            raise HTTPFailure(
                413,
                f"the document is {ids.shape[1]} tokens, over this server's limit of {settings.max_document_tokens} "
                "tokens (--max-document-tokens)",
            )
        context_id = await on_worker(_compress, settings, ids)
        return _context_json(store, context_id)

    @app.get("/v1/contexts/{context_id}")
    async def get_context(context_id: str) -> dict:
        return _context_json(store, context_id)

    @app.delete("/v1/contexts/{context_id}")
    async def delete_context(context_id: str) -> dict:
        try:
            store.delete(context_id)
        except UnknownContextError:
            raise HTTPFailure(404, f"no stored context {context_id}") from None
        return {"id": context_id, "object": "context", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        arrived = time.perf_counter()
        if body.model != settings.model_name:
            raise HTTPFailure(
                404, f"model {body.model!r} is not served here; this server serves {settings.model_name!r}"
            )
        if body.temperature not in (None, 0, 0.0) or body.n not in (None, 1):
            raise HTTPFailure(422, "decoding is greedy: temperature must be 0 (or unset) and n 1")
        max_tokens = body.max_completion_tokens or body.max_tokens or settings.default_max_tokens
        if max_tokens < 1:
            raise HTTPFailure(422, f"max_tokens must be >= 1, got {max_tokens}")
        session, prompt = await on_worker(_prepare, settings, body)  # the context is resolved here, once
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def answer(emit) -> tuple[str, str, int]:
            """Generate on the worker, ``emit`` each piece of new text; (text, finish reason, tokens)."""
            text = TextStream(tokenizer)
            eos = tokenizer.eos_token_id
            steps = session.stream(prompt, max_new_tokens=max_tokens, eos_token_id=eos)
            finish, count = "length", 0
            try:
                for token, _ in steps:
                    if count == 0:
                        metrics.first_token(time.perf_counter() - arrived)
                    count += 1
                    if eos is not None and int(token[0]) in _stop_ids(eos):
                        finish = "stop"
                        break
                    piece = text.push(int(token[0]))
                    if piece:
                        emit(piece)
            finally:
                steps.close()  # rewinds the cache to the context, also when generation failed
            rest = text.flush()
            if rest:
                emit(rest)
            return text.text(), finish, count

        usage_prompt = session.context_length + (0 if prompt is None else prompt.shape[1])
        if not body.stream:
            text, finish, count = await on_worker(answer, lambda piece: None)
            return {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": settings.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": _usage(usage_prompt, count),
            }
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(piece: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))

        job = worker.submit(answer, emit)
        job.add_done_callback(lambda done: loop.call_soon_threadsafe(queue.put_nowait, ("end", done)))

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            payload = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": settings.model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, item = await queue.get()
                if kind == "text":
                    yield chunk({"content": item})
                    continue
                error = item.exception()
                if error is not None:  # headers are sent: the error travels as an event, then the stream ends
                    yield f"data: {json.dumps({'error': {'message': str(error), 'code': 500}})}\n\n"
                    break
                _, finish, count = item.result()
                include_usage = bool((body.stream_options or {}).get("include_usage"))
                usage = {"usage": _usage(usage_prompt, count)} if include_usage else {}
                yield chunk({}, finish, **usage)
                break
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _stop_ids(eos: int | list[int]) -> set[int]:
    return set(eos) if isinstance(eos, list | tuple) else {eos}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _context_json(store: ContextStore, context_id: str) -> dict:
    try:
        info = store.info(context_id)
    except UnknownContextError:
        raise HTTPFailure(404, f"no stored context {context_id}") from None
    except StoredContextError as error:
        raise HTTPFailure(409, str(error)) from None
    return {"object": "context", **asdict(info)}


def _compress(settings: ServerSettings, ids: torch.Tensor) -> str:
    """On the worker: compress a document's ids (1, t) and store it; its id."""
    session = ContextSession(settings.model, settings.method, settings.budget, **settings.options)
    device = next(settings.model.parameters()).device
    try:
        session.prefill(ids.to(device))
    except CriticalKVError as error:  # a budget that rounds to zero entries on a short document
        raise HTTPFailure(422, str(error)) from None
    try:
        return settings.store.add(session)
    except OSError as error:
        if error.errno in _DISK_FULL:
            raise HTTPFailure(
                507, f"the context store is full ({error.strerror}); stored contexts are intact"
            ) from None
        raise


def _prepare(settings: ServerSettings, body: ChatRequest) -> tuple[ContextSession, torch.Tensor | None]:
    """On the worker: the session a chat request is answered from and the tokens it appends (None: none).

    With ``context_id`` the stored context is resolved now: a DELETE after this point does not stop the answer.
    Without it, the whole conversation is prefilled and compressed under the server's method (question-aware).
    """
    device = next(settings.model.parameters()).device
    if body.context_id is not None:
        users = [m for m in body.messages if m.role == "user"]
        if len(body.messages) != 1 or len(users) != 1:
            raise HTTPFailure(
                422, "a request naming a context_id carries one user message: the question asked of that context"
            )
        try:
            session = settings.store.get(body.context_id)
        except UnknownContextError:
            raise HTTPFailure(404, f"no stored context {body.context_id}") from None
        except StoredContextError as error:
            raise HTTPFailure(409, str(error)) from None
        return session, question_ids(settings.tokenizer, users[0].text()).to(device)
    if not body.messages:
        raise HTTPFailure(422, "messages is empty")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    ids = chat_ids(settings.tokenizer, messages)
    if ids.shape[1] > settings.max_document_tokens:
        raise HTTPFailure(
            413, f"the conversation is {ids.shape[1]} tokens, over the limit of {settings.max_document_tokens}"
        )
    session = ContextSession(settings.model, settings.method, settings.budget, **settings.options)
    try:
        session.prefill(ids.to(device))
    except CriticalKVError as error:
        raise HTTPFailure(422, str(error)) from None
    return session, None
