"""Concurrent chat requests on one stored context, answered together as the rows of one decode: each row answers
as its request does alone, the stored cache is left as it was, and a row's failure ends that row alone. The server
runs on 127.0.0.1 inside the test run; the requests come from the real ``openai`` client, one thread each."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import test_serve
import torch
from test_serve import BUDGET, DOCUMENT, METHOD, NAME, Server
from typer.testing import CliRunner

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache
from criticalkv.cli import app as cli_app
from criticalkv.errors import CriticalKVError
from criticalkv.runtime.session import ContextSession
from criticalkv.serve import decode
from criticalkv.serve.app import ServerSettings, create_app
from criticalkv.serve.prompts import document_ids, question_ids
from criticalkv.serve.store import ContextStore

tiny_folder, tiny = test_serve.tiny_folder, test_serve.tiny  # the tiny random model's fixtures

#: (question, max_tokens, streamed): questions of different lengths (padded in the batch), rows that end early
ROWS = [
    ("What is the special magic number?", 3, False),
    ("dog", 8, True),
    ("The quick brown fox jumps over what, and why?", 5, True),
    ("What number?", 8, False),
]


def _alone(tiny, question: str, max_tokens: int) -> str:
    """The answer of a session compressed in this process, asked alone: what each row must say."""
    model, tokenizer = tiny
    session = ContextSession(model, METHOD, BUDGET)
    session.prefill(document_ids(tokenizer, DOCUMENT))
    tokens = session.ask(question_ids(tokenizer, question), max_new_tokens=max_tokens).tokens
    return tokenizer.decode(tokens[0], skip_special_tokens=True)


def _serve(tiny, folder: Path, max_batch: int) -> tuple[Server, ContextStore]:
    """A server whose batches wait long (5 s) for their rows: a batch goes when ``max_batch`` rows are in."""
    model, tokenizer = tiny
    store = ContextStore(model, folder, max_bytes=1 << 30)
    settings = ServerSettings(
        model, tokenizer, NAME, store, METHOD, Budget(BUDGET), batch_window=5.0, max_batch=max_batch
    )
    return Server(create_app(settings)), store


def _ask_together(server: Server, context_id: str, rows: list[tuple[str, int, bool]]) -> list[object]:
    """Send ``rows`` at once, one thread each; each row's answer text, or the exception its request raised."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    results: list[object] = [None] * len(rows)
    start = threading.Barrier(len(rows))

    def ask(index: int) -> None:
        question, max_tokens, streamed = rows[index]
        start.wait()
        try:
            reply = client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": question}],
                max_tokens=max_tokens,
                stream=streamed,
                extra_body={"context_id": context_id},
            )
            if streamed:
                results[index] = "".join(chunk.choices[0].delta.content or "" for chunk in reply)
            else:
                assert reply.usage.completion_tokens == max_tokens
                results[index] = reply.choices[0].message.content
        except openai.APIError as error:
            results[index] = error

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(rows))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _context(server: Server) -> str:
    response = httpx.post(server.url + "/v1/contexts", json={"document": DOCUMENT}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _cache_tensors(session: ContextSession) -> list[torch.Tensor]:
    return [t.clone() for layer in session.cache.layers for t in (layer.context_keys, layer.context_values)]


def test_questions_on_one_context_decode_together_as_each_alone(tiny, tmp_path: Path) -> None:
    server, store = _serve(tiny, tmp_path, max_batch=len(ROWS))
    try:
        context_id = _context(server)
        before = _cache_tensors(store.get(context_id))
        expected = [_alone(tiny, question, max_tokens) for question, max_tokens, _ in ROWS]
        for _ in range(2):  # the stored cache is left as it was: the same questions, the same answers
            assert _ask_together(server, context_id, ROWS) == expected
        after = _cache_tensors(store.get(context_id))
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        metrics = httpx.get(server.url + "/metrics").text
        assert (
            'criticalkv_batch_rows_bucket{le="2"} 0' in metrics and 'criticalkv_batch_rows_bucket{le="4"} 2' in metrics
        )
        assert "criticalkv_batch_rows_sum 8" in metrics and "criticalkv_time_to_first_token_seconds_count 8" in metrics
    finally:
        server.stop()


def test_a_failing_row_ends_alone(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose own work fails (its question's tokens, its text: made to fail here) gets 500; the other rows of its
    batch are answered in full. A failure of the decode itself ends the rows not yet answered; those already answered
    keep their answers, and the stored context answers as before."""
    made = []

    class FailingSecond(decode.TextStream):
        def __init__(self, tokenizer) -> None:
            super().__init__(tokenizer)
            made.append(self)

        def push(self, token: int) -> str:
            if self is made[1]:
                raise RuntimeError("this row's text failed")
            return super().push(token)

    real_question_ids = decode.question_ids

    def question_ids(tokenizer, question: str):
        if question == "untokenizable":
            raise RuntimeError("this row's question failed")
        return real_question_ids(tokenizer, question)

    question = ROWS[0][0]
    server, _ = _serve(tiny, tmp_path, max_batch=4)
    try:
        context_id = _context(server)
        monkeypatch.setattr(decode, "TextStream", FailingSecond)
        monkeypatch.setattr(decode, "question_ids", question_ids)
        *results, untokenizable = _ask_together(
            server, context_id, [(question, 4, False)] * 3 + [("untokenizable", 4, False)]
        )
        monkeypatch.undo()
        assert isinstance(untokenizable, openai.InternalServerError)
        failed = [r for r in results if isinstance(r, openai.InternalServerError)]
        assert len(failed) == 1 and [r for r in results if r not in failed] == [_alone(tiny, question, 4)] * 2

        real_forward, forwards = ContextSession._forward, []

        def second_forward_fails(self, *args):
            forwards.append(self)
            if len(forwards) == 2:  # the question's forward gave the first tokens; the next step fails
                raise RuntimeError("the decode failed")
            return real_forward(self, *args)

        monkeypatch.setattr(ContextSession, "_forward", second_forward_fails)
        rows = [(question, 1, False), (question, 6, False), (question, 6, True), (question, 2, True)]
        short, *cut = _ask_together(server, context_id, rows)
        monkeypatch.undo()
        assert short == _alone(tiny, question, 1)
        assert isinstance(cut[0], openai.InternalServerError) and all(isinstance(r, openai.APIError) for r in cut)
        assert _ask_together(server, context_id, [(question, 6, False)] * 4) == [_alone(tiny, question, 6)] * 4
    finally:
        server.stop()


def test_a_streaming_client_that_goes_away_stops_its_row(tiny, tmp_path: Path, monkeypatch) -> None:
    """Its row ends at its next token, and the decode with it (it ran on to the row's ``max_tokens``)."""
    server, _ = _serve(tiny, tmp_path, max_batch=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    real_forward, forwards, closed = ContextSession._forward, [], threading.Event()

    def counted(self, *args):
        forwards.append(self)
        if len(forwards) == 2:  # the first decode step waits until the client has gone
            closed.wait(timeout=30)
        return real_forward(self, *args)

    try:
        context_id = _context(server)
        monkeypatch.setattr(ContextSession, "_forward", counted)
        ask = {
            "model": NAME,
            "messages": [{"role": "user", "content": "dog"}],
            "extra_body": {"context_id": context_id},
        }
        stream = client.chat.completions.create(**ask, max_tokens=300, stream=True)
        next(iter(stream))  # the answer has started
        stream.close()
        time.sleep(0.5)  # the server notices the disconnect
        closed.set()
        client.chat.completions.create(**ask, max_tokens=2)  # queued behind the first: answered once it ended
        assert len(forwards) <= 4  # the first: its question's forward, and one step if it got there; the second: 2
    finally:
        closed.set()
        server.stop()


def test_caches_that_cannot_be_stacked_answer_one_by_one(tiny, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(CompressedCache, "stackable", lambda self: False)
    server, _ = _serve(tiny, tmp_path, max_batch=2)
    try:
        context_id = _context(server)
        with caplog.at_level(logging.WARNING, logger="criticalkv.serve.batching"):
            for _ in range(2):
                assert _ask_together(server, context_id, ROWS[:2]) == [_alone(tiny, q, n) for q, n, _ in ROWS[:2]]
        assert [r.message for r in caplog.records if "cannot be stacked" in r.message] == [
            "this model's compressed caches cannot be stacked: questions on one context decode one by one"
        ]
        assert 'criticalkv_batch_rows_bucket{le="1"} 4' in httpx.get(server.url + "/metrics").text
    finally:
        server.stop()


def test_a_batch_below_one_row_is_refused(tiny_folder: Path, tiny, tmp_path: Path) -> None:
    """By ``criticalkv serve`` before the model loads, and by ``create_app`` (a batch of no rows would never end)."""
    refused = CliRunner().invoke(
        cli_app, ["serve", "--model", str(tiny_folder), "--method", METHOD, "--budget", "0.3", "--max-batch", "0"]
    )
    assert refused.exit_code == 2 and "--max-batch >= 1" in refused.output
    model, tokenizer = tiny
    store = ContextStore(model, tmp_path, max_bytes=1 << 30)
    with pytest.raises(CriticalKVError, match="--batch-window-ms must be >= 0"):
        create_app(ServerSettings(model, tokenizer, NAME, store, METHOD, Budget(BUDGET), batch_window=-1.0))
