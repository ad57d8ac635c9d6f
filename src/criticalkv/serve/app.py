"""The OpenAI-compatible server: chat completions (streamed by server-sent events or not), models, and stored
compressed contexts that chat requests name with the ``context_id`` extension field (docs/serving.md).

Every model computation (compressing a document, answering) runs on one worker thread, one job after another.
Concurrent chat requests on one stored context are one job: their questions are answered together, as the rows of
one decode on a stacked copy of the context's cache (``Batcher``), so the stored cache itself never changes.
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
from criticalkv.errors import BoundedMemoryError, CriticalKVError, StoredContextError
from criticalkv.runtime.chunked import check_guidable
from criticalkv.runtime.session import ContextSession
from criticalkv.serve.batching import Batcher
from criticalkv.serve.decode import Answer, Row, answer_rows
from criticalkv.serve.metrics import Metrics
from criticalkv.serve.prompts import chat_ids, document_ids
from criticalkv.serve.store import ContextStore, UnknownContextError

#: disk-full errors of a store write: answered 507 Insufficient Storage
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class HTTPFailure(Exception):
    """A request refused with ``status`` and a message that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _checked_text(text: str, what: str) -> str:
    """``text``, refused (422) when it is not Unicode text (a lone surrogate from a JSON escape): no tokenizer takes
    it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise HTTPFailure(422, f"{what} is not valid Unicode text: {error.reason} at {error.start}") from None
    return text


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's optional fields (name, ...) are accepted and not used

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return _checked_text(self.content, "a message")
        if any(part.get("type") != "text" for part in self.content):
            raise HTTPFailure(422, "only text message parts are supported")
        return _checked_text("".join(str(part.get("text", "")) for part in self.content), "a message")


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
    bounded
        ``chunk_size``, ``cap`` and ``compress_every`` (``ContextSession``'s): documents and conversations are
        prefilled in chunks and compressed back to the cap after each, and answers are compressed back to it every
        ``compress_every`` tokens, so long ones hold bounded memory (empty: neither; the store's ``decoding`` is
        what contexts loaded from their files follow).
    guide_chunks
        With ``bounded``'s ``chunk_size``: a conversation without a stored context is prefilled with its last
        window of tokens (the method's ``query_rows``, where its question is, the queries one-shot compression
        scores with) as every chunk's guide (``ContextSession.prefill``'s ``guide_ids``). Documents have no
        question: they are prefilled unguided.
    max_document_tokens
        Longer documents are refused with 413.
    default_max_tokens
        Tokens generated when a request does not say.
    batch_window
        Seconds the first chat request on a context waits for others to answer together (0: no wait).
    max_batch
        Chat requests answered together at most (1: each alone).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    store: ContextStore
    method: str = "critical-snapkv"
    budget: Budget = field(default_factory=lambda: Budget(0.2))
    options: dict[str, object] = field(default_factory=dict)
    bounded: dict[str, int] = field(default_factory=dict)
    max_document_tokens: int = 8192
    default_max_tokens: int = 128
    batch_window: float = 0.01
    max_batch: int = 8
    guide_chunks: bool = False

    def __post_init__(self) -> None:
        if self.guide_chunks:
            if "chunk_size" not in self.bounded:
                raise BoundedMemoryError("guide_chunks scores the chunks of a chunked prefill: give a chunk_size")
            check_guidable(_new_session(self).compressor.new_cache())


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
    batcher = Batcher(
        worker,
        lambda context_id: _resolve(store, context_id),
        lambda session, rows: answer_rows(session, rows, tokenizer, metrics),
        settings.batch_window,
        settings.max_batch,
    )

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
        ids = document_ids(tokenizer, _checked_text(body.document, "the document"))
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
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()  # a streamed answer's pieces, then its end

        def emit(piece: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))

        question = None if body.context_id is None else _question(body)
        row = Row(question, max_tokens, emit if body.stream else _ignore, arrived)
        if body.context_id is not None:
            batcher.submit(body.context_id, row)
        else:
            session = await on_worker(_prepare, settings, body)
            worker.submit(answer_rows, session, [row], tokenizer, metrics)
        prompt_tokens = await asyncio.wrap_future(row.started)  # a refusal (404, 409) is the response's status
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.stream:
            answer: Answer = await asyncio.wrap_future(row.finished)
            message = {"role": "assistant", "content": answer.text}
            return {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": settings.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": answer.finish}],
                "usage": _usage(prompt_tokens, answer.tokens),
            }
        row.finished.add_done_callback(lambda done: loop.call_soon_threadsafe(queue.put_nowait, ("end", done)))

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
            try:
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
                    answer = item.result()
                    include_usage = bool((body.stream_options or {}).get("include_usage"))
                    usage = {"usage": _usage(prompt_tokens, answer.tokens)} if include_usage else {}
                    yield chunk({}, answer.finish, **usage)
                    break
                yield "data: [DONE]\n\n"
            finally:  # also when the client went away mid-answer: its row stops decoding
                row.gone = True

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _ignore(piece: str) -> None:
    """A non-streamed answer's ``emit``: its text is sent whole at the end."""


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


def _new_session(settings: ServerSettings) -> ContextSession:
    """An empty session under the server's method, budget, options and bounded-memory schedule."""
    return ContextSession(settings.model, settings.method, settings.budget, **settings.bounded, **settings.options)


def _compress(settings: ServerSettings, ids: torch.Tensor) -> str:
    """On the worker: compress a document's ids (1, t) and store it; its id."""
    session = _new_session(settings)
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


def _question(body: ChatRequest) -> str:
    """The question a request naming a context asks: its one user message (422 for anything else)."""
    users = [m for m in body.messages if m.role == "user"]
    if len(body.messages) != 1 or len(users) != 1:
        raise HTTPFailure(
            422, "a request naming a context_id carries one user message: the question asked of that context"
        )
    return users[0].text()


def _resolve(store: ContextStore, context_id: str) -> ContextSession:
    """On the worker: a stored context's session, when a batch on it starts (404 unknown, 409 another model's)."""
    try:
        return store.get(context_id)
    except UnknownContextError:
        raise HTTPFailure(404, f"no stored context {context_id}") from None
    except StoredContextError as error:
        raise HTTPFailure(409, str(error)) from None


def _prepare(settings: ServerSettings, body: ChatRequest) -> ContextSession:
    """On the worker: a request without a context, its whole conversation prefilled and compressed under the
    server's method (question-aware); it is answered from the prefilled prompt."""
    if not body.messages:
        raise HTTPFailure(422, "messages is empty")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    ids = chat_ids(settings.tokenizer, messages)
    if ids.shape[1] > settings.max_document_tokens:
        raise HTTPFailure(
            413, f"the conversation is {ids.shape[1]} tokens, over the limit of {settings.max_document_tokens}"
        )
    session = _new_session(settings)
    ids = ids.to(next(settings.model.parameters()).device)
    # (1, w): the last window, whose queries score every chunk but the last
    guide = ids[:, -session.compressor.method.query_rows :] if settings.guide_chunks else None
    try:
        session.prefill(ids, guide_ids=guide)
    except CriticalKVError as error:
        raise HTTPFailure(422, str(error)) from None
    return session
