"""Answering chat rows on one session, on the model worker: several questions on one stored context decode together
as the rows of one batch (``ContextSession.stacked``), each row's tokens turned into text for its own client."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from criticalkv.runtime.session import ContextSession
from criticalkv.serve.metrics import Metrics
from criticalkv.serve.prompts import TextStream, question_ids


@dataclass
class Answer:
    """A finished row: its text, why it ended (``"stop"``: an end-of-sequence token; ``"length"``: its
    ``max_tokens``) and the tokens generated."""

    text: str
    finish: str
    tokens: int


@dataclass
class Row:
    """One chat request waiting for its answer.

    Parameters
    ----------
    question
        The text appended to the context (``question_ids``); None: answer the session's prefilled prompt.
    max_tokens
        Tokens generated at most.
    emit
        Called on the worker with each new piece of the answer's text (streaming; a no-op otherwise).
    arrived
        ``time.perf_counter()`` at the request's arrival: time to first token counts from it.
    started
        Set to the prompt's tokens (context and question) once the row's context is resolved, or to its refusal.
    finished
        Set to the row's ``Answer``, or to the error that ended the row.
    gone
        Set (on the event loop) when the row's client went away: the row ends at its next token, and the decode
        with it when no other row is live.
    """

    question: str | None
    max_tokens: int
    emit: Callable[[str], None]
    arrived: float
    started: Future[int] = field(default_factory=Future)
    finished: Future[Answer] = field(default_factory=Future)
    gone: bool = False

    def fail(self, error: BaseException) -> None:
        """End the row with ``error`` (a row already answered keeps its answer)."""
        for future in (self.started, self.finished):
            if not future.done():
                future.set_exception(error)


class _Decoding:
    """One row's progress through a batched decode: its text so far, its tokens, whether it still takes tokens."""

    def __init__(self, row: Row, tokenizer: PreTrainedTokenizerBase, stops: set[int], metrics: Metrics) -> None:
        self.row, self.stops, self.metrics = row, stops, metrics
        self.text = TextStream(tokenizer)
        self.count, self.live = 0, True

    def take(self, token: int) -> None:
        """The row's next token: sent as text to the row's client; the row ends at a stop token or its length, or
        when its client went away."""
        if self.row.gone:
            raise ConnectionAbortedError("the client went away")
        if self.count == 0:
            self.metrics.first_token(time.perf_counter() - self.row.arrived)
        self.count += 1
        if token in self.stops:
            self.end("stop")
            return
        piece = self.text.push(token)
        if piece:
            self.row.emit(piece)
        if self.count == self.row.max_tokens:
            self.end("length")

    def end(self, finish: str) -> None:
        self.live = False
        rest = self.text.flush()
        if rest:
            self.row.emit(rest)
        self.row.finished.set_result(Answer(self.text.text(), finish, self.count))

    def fail(self, error: BaseException) -> None:
        self.live = False
        self.row.fail(error)


def answer_rows(session: ContextSession, rows: list[Row], tokenizer: PreTrainedTokenizerBase, metrics: Metrics) -> None:
    """On the worker: answer ``rows`` from ``session`` greedily, in one decode.

    More than one row decodes on a stacked copy of the session's cache (the cache must be stackable), each row's
    question left-padded to the longest; the session's own cache is left as it was. One row decodes on the session
    itself, rewound afterwards. A row ends at its own ``max_tokens`` or stop token, and gets its answer then;
    the decode runs while any row is live. An error in one row's own work (its question's tokens, its text, its
    client) ends that row alone; an error of the decode itself ends every row not yet answered.
    """
    try:
        _decode(session, rows, tokenizer, metrics)
    except Exception as error:  # the decode itself (a forward, stacking): every row not answered yet ends with it
        for row in rows:
            row.fail(error)


def _decode(session: ContextSession, rows: list[Row], tokenizer: PreTrainedTokenizerBase, metrics: Metrics) -> None:
    rows, questions = _tokenized(rows, tokenizer)
    if not rows:
        return
    ids, mask = _left_padded(questions, next(session.model.parameters()).device)  # (b, q) each, or None
    for row, question in zip(rows, questions, strict=True):
        row.started.set_result(session.context_length + (0 if question is None else len(question)))
    decoder = session if len(rows) == 1 else ContextSession.stacked([session] * len(rows))
    metrics.batch(len(rows))
    eos = tokenizer.eos_token_id
    stops = set(eos) if isinstance(eos, list | tuple) else set() if eos is None else {eos}
    states = [_Decoding(row, tokenizer, stops, metrics) for row in rows]
    steps = decoder.stream(ids, max(row.max_tokens for row in rows), eos, question_mask=mask)
    try:
        for tokens, _ in steps:  # tokens (b,)
            for state, token in zip(states, tokens.tolist(), strict=True):
                if not state.live:
                    continue
                try:
                    state.take(token)
                except Exception as error:  # this row's text or client: the other rows go on
                    state.fail(error)
            if not any(state.live for state in states):
                break
    finally:
        steps.close()  # rewinds the cache (the session's own, when it decoded alone), also after an error


def _tokenized(rows: list[Row], tokenizer: PreTrainedTokenizerBase) -> tuple[list[Row], list[torch.Tensor | None]]:
    """The rows whose question tokenizes, with its ids (q,) (None: no question); a row whose question does not ends
    alone, with that error."""
    kept, questions = [], []
    for row in rows:
        try:
            questions.append(None if row.question is None else question_ids(tokenizer, row.question)[0])
        except Exception as error:
            row.fail(error)
            continue
        kept.append(row)
    return kept, questions


def _left_padded(
    questions: list[torch.Tensor | None], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Question ids (q_i,) each as one left-padded batch: ids (b, q) and mask (b, q); (None, None) for one row
    without a question."""
    if questions[0] is None:  # a request without a context: it decodes alone
        return None, None
    width = max(len(question) for question in questions)
    ids = torch.zeros(len(questions), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, question in enumerate(questions):
        ids[row, width - len(question) :] = question
        mask[row, width - len(question) :] = 1
    return ids.to(device), mask.to(device)
