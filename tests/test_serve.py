"""The compress / ask commands and the OpenAI-compatible server, on a tiny random model: the server runs on
127.0.0.1 inside the test run and is spoken to with the real ``openai`` client."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import save_random_llama
from typer.testing import CliRunner

from criticalkv.budget import Budget
from criticalkv.cache import CompressedLayer
from criticalkv.cli import app as cli_app
from criticalkv.errors import BoundedMemoryError
from criticalkv.models import load_model
from criticalkv.runtime.persist import load_session
from criticalkv.runtime.session import ContextSession
from criticalkv.serve.app import ChatRequest, ServerSettings, _prepare, create_app
from criticalkv.serve.prompts import chat_ids, document_ids, question_ids
from criticalkv.serve.store import ContextStore

DOCUMENT = "The quick brown fox jumps over the lazy dog. " * 12 + "What is the special magic number? " * 3
QUESTION = "What is the special magic number?"
NAME = "tiny"
METHOD, BUDGET = "snapkv:window=8", 0.3


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_random_llama(
        tmp_path_factory.mktemp("tiny-llama"),
        tiny_tokenizer,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path):
    model, tokenizer = load_model(str(tiny_folder), device="cpu")
    model.generation_config.eos_token_id = None
    tokenizer.eos_token = None  # a random model would stop at random: answers run to max_tokens
    return model, tokenizer


def _reference_answer(model, tokenizer, n: int) -> str:
    """The answer to QUESTION from a session compressed in this process, never saved: what the server must say."""
    session = ContextSession(model, METHOD, BUDGET)
    session.prefill(document_ids(tokenizer, DOCUMENT))
    tokens = session.ask(question_ids(tokenizer, QUESTION), max_new_tokens=n).tokens
    return tokenizer.decode(tokens[0], skip_special_tokens=True)


class Server:
    """uvicorn in a thread on 127.0.0.1, a free port."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def served(tiny, tmp_path: Path):
    model, tokenizer = tiny
    store = ContextStore(model, tmp_path / "store", max_bytes=1 << 30)
    settings = ServerSettings(model, tokenizer, NAME, store, METHOD, Budget(BUDGET), max_document_tokens=400)
    server = Server(create_app(settings))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield server, client, settings
    server.stop()


def _new_context(server: Server, document: str = DOCUMENT) -> httpx.Response:
    return httpx.post(server.url + "/v1/contexts", json={"document": document}, timeout=60)


def test_openai_client_answers_from_a_stored_context(served, tiny) -> None:
    server, client, _ = served
    created = _new_context(server)
    assert created.status_code == 200, created.text
    context = created.json()
    assert context["id"].startswith("ctx-") and context["tokens"] > 0 and context["in_memory"]
    assert [m.id for m in client.models.list().data] == [NAME]
    expected = _reference_answer(*tiny, n=6)
    for _ in range(2):  # the cache is rewound after each answer: the same question, the same answer
        reply = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=6,
            extra_body={"context_id": context["id"]},
        )
        assert reply.choices[0].message.content == expected
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"context_id": context["id"]},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 6
    metrics = httpx.get(server.url + "/metrics").text
    assert 'criticalkv_requests_total{route="/v1/chat/completions"} 3' in metrics
    assert "criticalkv_time_to_first_token_seconds_count 3" in metrics
    assert f"criticalkv_context_bytes_held {context['kv_bytes']}" in metrics
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_chat_without_context_is_answered(served) -> None:
    _, client, _ = served
    reply = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": DOCUMENT + QUESTION}], max_tokens=4
    )
    assert reply.usage.completion_tokens == 4 and isinstance(reply.choices[0].message.content, str)


def test_a_context_dropped_from_memory_is_reloaded_from_its_file(tiny, tmp_path: Path) -> None:
    """A memory bound below one context keeps only the latest in memory; the first is read back from disk and
    answers as before."""
    model, tokenizer = tiny
    store = ContextStore(model, tmp_path, max_bytes=1)
    server = Server(create_app(ServerSettings(model, tokenizer, NAME, store, METHOD, Budget(BUDGET))))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        first, second = _new_context(server).json()["id"], _new_context(server, DOCUMENT + " More.").json()["id"]
        assert store.held_count() == 1
        assert not httpx.get(f"{server.url}/v1/contexts/{first}").json()["in_memory"]
        reply = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=5, extra_body={"context_id": first}
        )
        assert reply.choices[0].message.content == _reference_answer(model, tokenizer, n=5)
        assert httpx.get(f"{server.url}/v1/contexts/{first}").json()["in_memory"]
        assert not httpx.get(f"{server.url}/v1/contexts/{second}").json()["in_memory"]
    finally:
        server.stop()


def test_bad_requests_get_clear_statuses(served) -> None:
    server, client, _ = served
    with pytest.raises(openai.NotFoundError, match="no stored context ctx-"):
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body={"context_id": "ctx-" + "0" * 32},
        )
    assert httpx.get(server.url + "/v1/contexts/../../etc/passwd").status_code == 404
    assert httpx.get(server.url + "/v1/contexts/not-an-id").status_code == 404
    assert httpx.post(server.url + "/v1/contexts", json={"text": "x"}).status_code == 422
    assert httpx.post(server.url + "/v1/chat/completions", json={"model": NAME}).status_code == 422
    with pytest.raises(openai.UnprocessableEntityError, match="greedy"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], temperature=0.7)
    for path, body in (  # "\ud800" is a JSON escape that decodes to no character (a lone surrogate)
        ("chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "fox \ud800"}]}'),
        ("contexts", rb'{"document": "fox \ud800"}'),
    ):
        refused = httpx.post(f"{server.url}/v1/{path}", content=body, headers={"content-type": "application/json"})
        assert refused.status_code == 422 and "not valid Unicode text" in refused.text
    too_long = _new_context(server, "fox " * 2000)
    assert too_long.status_code == 413 and "limit of 400 tokens" in too_long.text
    metrics = httpx.get(server.url + "/metrics").text
    assert 'criticalkv_errors_total{status="404"} 3' in metrics and 'criticalkv_errors_total{status="413"} 1' in metrics


def test_a_file_from_another_model_is_a_conflict(served, tiny_tokenizer, tmp_path: Path) -> None:
    server, client, settings = served
    other_folder = save_random_llama(
        tmp_path / "other", tiny_tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05,
    )  # fmt: skip
    other, _ = load_model(str(other_folder), device="cpu")
    session = ContextSession(other, METHOD, BUDGET)
    session.prefill(document_ids(settings.tokenizer, DOCUMENT))
    foreign = settings.store.new_id()
    session.save(settings.store.path(foreign))
    response = httpx.get(f"{server.url}/v1/contexts/{foreign}")
    assert (
        response.status_code == 409 and f"{foreign} was saved from another model: its config differs" in response.text
    )
    assert str(settings.store.folder) not in response.text  # the server's paths stay its own
    with pytest.raises(openai.ConflictError, match="another model"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": QUESTION}], extra_body={"context_id": foreign}
        )


def test_a_full_disk_is_507_and_earlier_contexts_stay(served, monkeypatch: pytest.MonkeyPatch) -> None:
    server, client, settings = served
    kept = _new_context(server).json()["id"]
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    refused = _new_context(server, DOCUMENT + " Another.")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert refused.status_code == 507 and "store is full" in refused.text
    assert [p.name for p in settings.store.folder.iterdir()] == [f"{kept}.safetensors"]
    assert settings.store.held_count() == 1
    reply = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=3, extra_body={"context_id": kept}
    )
    assert reply.usage.completion_tokens == 3


def test_a_context_deleted_while_answered_finishes_that_answer(served, tiny) -> None:
    """A request that resolved its context before the DELETE is answered in full; later requests get 404."""
    server, client, _ = served
    context_id = _new_context(server).json()["id"]
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        stream=True,
        extra_body={"context_id": context_id},
    )
    pieces = []
    for index, chunk in enumerate(stream):
        if index == 1:  # the answer has started
            assert httpx.delete(f"{server.url}/v1/contexts/{context_id}").json()["deleted"]
        pieces.append(chunk.choices[0].delta.content or "")
    assert "".join(pieces) == _reference_answer(*tiny, n=12)
    assert httpx.get(f"{server.url}/v1/contexts/{context_id}").status_code == 404
    assert httpx.delete(f"{server.url}/v1/contexts/{context_id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": QUESTION}], extra_body={"context_id": context_id}
        )


def test_compress_then_ask_on_the_command_line(tiny_folder: Path, tiny, tiny_tokenizer, tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text(DOCUMENT)
    out = tmp_path / "ctx.safetensors"
    runner = CliRunner()
    made = runner.invoke(
        cli_app,
        ["compress", "--model", str(tiny_folder), "--method", METHOD, "--budget", str(BUDGET),
         "--context-file", str(tmp_path / "doc.txt"), "--out", str(out), "--device", "cpu"],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    assert out.is_file()
    asked = runner.invoke(cli_app, ["ask", str(out), "--question", QUESTION, "--max-new-tokens", "5", "--stream"])
    assert asked.exit_code == 0, asked.output
    model, tokenizer = tiny
    session = ContextSession(model, METHOD, BUDGET)
    session.prefill(document_ids(tokenizer, DOCUMENT))
    eos = tiny_tokenizer.eos_token_id  # the command's tokenizer stops at it (the fixture's model does not)
    tokens = session.ask(question_ids(tokenizer, QUESTION), max_new_tokens=5, eos_token_id=eos).tokens[0].tolist()
    tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
    assert tokenizer.decode(tokens, skip_special_tokens=True).strip() + "\n" in asked.output
    refused = runner.invoke(cli_app, ["ask", str(tmp_path / "missing.safetensors"), "--question", "q"])
    assert refused.exit_code == 2 and "is not a file" in refused.output


CHUNKED = {"chunk_size": 32, "cap": 24}  # the document's ~150 tokens in 5 chunks, 24 entries per KV head kept


def _chunked_session(model, tokenizer) -> ContextSession:
    """The document prefilled in chunks in this process, never saved: what compress and serve must hold."""
    session = ContextSession(model, METHOD, Budget(24), **CHUNKED)
    session.prefill(document_ids(tokenizer, DOCUMENT))
    return session


def _keys(session: ContextSession) -> list[torch.Tensor]:
    return [layer.context_keys for layer in session.cache.layers if isinstance(layer, CompressedLayer)]


def test_compress_prefills_a_long_document_in_chunks(tiny_folder: Path, tiny, tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text(DOCUMENT)
    out = tmp_path / "ctx.safetensors"
    runner = CliRunner()
    args = ["compress", "--model", str(tiny_folder), "--method", METHOD, "--context-file", str(tmp_path / "doc.txt"),
            "--out", str(out), "--device", "cpu"]  # fmt: skip
    made = runner.invoke(cli_app, [*args, "--chunk-size", "32", "--cap", "24"])
    assert made.exit_code == 0, made.output
    model, tokenizer = tiny
    reference = _chunked_session(model, tokenizer)
    one_shot = ContextSession(model, METHOD, Budget(24))
    one_shot.prefill(document_ids(tokenizer, DOCUMENT))
    loaded = _keys(load_session(out, model))
    assert all(torch.equal(a, b) for a, b in zip(loaded, _keys(reference), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(loaded, _keys(one_shot), strict=True))  # not compressed once
    refused = runner.invoke(cli_app, [*args, "--chunk-size", "32"])  # the default budget, a fraction
    assert refused.exit_code == 2 and "--cap" in refused.output


def test_the_server_prefills_documents_in_chunks(tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny
    store = ContextStore(model, tmp_path / "store", max_bytes=1 << 30)
    settings = ServerSettings(model, tokenizer, NAME, store, METHOD, Budget(24), bounded=CHUNKED)
    server = Server(create_app(settings))
    try:
        created = _new_context(server)
        assert created.status_code == 200, created.text
        reference = _chunked_session(model, tokenizer)
        assert created.json()["kv_bytes"] == reference.kv_bytes()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=6,
            extra_body={"context_id": created.json()["id"]},
        )
        tokens = reference.ask(question_ids(tokenizer, QUESTION), max_new_tokens=6).tokens
        assert reply.choices[0].message.content == tokenizer.decode(tokens[0], skip_special_tokens=True)
    finally:
        server.stop()


def test_the_server_guides_a_conversations_chunks_by_its_last_window(tiny, tmp_path: Path) -> None:
    """A conversation without a stored context, prefilled in chunks under ``guide_chunks``: its cache holds the
    entries of a session guided by the conversation's last 8 tokens (the method's window), which differ from the
    unguided chunks', and the server answers as that session."""
    model, tokenizer = tiny
    store = ContextStore(model, tmp_path / "store", max_bytes=1 << 30)
    settings = ServerSettings(model, tokenizer, NAME, store, METHOD, Budget(24), bounded=CHUNKED, guide_chunks=True)
    messages = [{"role": "user", "content": DOCUMENT + QUESTION}]
    ids = chat_ids(tokenizer, messages)  # (1, t), t over 4 chunks
    guided, unguided = (ContextSession(model, METHOD, Budget(24), **CHUNKED) for _ in range(2))
    guided.prefill(ids, guide_ids=ids[:, -8:])
    unguided.prefill(ids)
    assert not all(torch.equal(a, b) for a, b in zip(_keys(guided), _keys(unguided), strict=True))
    prepared = _prepare(settings, ChatRequest(model=NAME, messages=messages))
    assert all(torch.equal(a, b) for a, b in zip(_keys(prepared), _keys(guided), strict=True))
    server = Server(create_app(settings))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6)
        tokens = guided.ask(None, max_new_tokens=6).tokens
        assert reply.choices[0].message.content == tokenizer.decode(tokens[0], skip_special_tokens=True)
    finally:
        server.stop()
    with pytest.raises(BoundedMemoryError, match="give a chunk_size"):
        ServerSettings(model, tokenizer, NAME, store, METHOD, Budget(24), guide_chunks=True)


def test_answers_from_a_stored_context_compress_while_decoding(
    tiny_folder: Path, tiny, tiny_tokenizer, tmp_path: Path
) -> None:
    """A file compressed at 24 entries per KV head, asked 40 tokens compressing every 8: on the command line, and
    by the server from a context it stored and from the same file loaded by a store that did not make it."""
    model, tokenizer = tiny
    (tmp_path / "doc.txt").write_text(DOCUMENT)
    out = tmp_path / "ctx.safetensors"
    runner = CliRunner()
    made = runner.invoke(
        cli_app,
        ["compress", "--model", str(tiny_folder), "--method", METHOD, "--budget", "24",
         "--context-file", str(tmp_path / "doc.txt"), "--out", str(out), "--device", "cpu"],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    reference = ContextSession.load(out, model, compress_every=8)  # cap: the file's 24
    tokens = reference.ask(question_ids(tokenizer, QUESTION), max_new_tokens=40, eos_token_id=None).tokens
    plain = ContextSession.load(out, model).ask(question_ids(tokenizer, QUESTION), max_new_tokens=40).tokens
    assert not torch.equal(tokens, plain)  # compressing changed the answer: the options were followed
    expected = tokenizer.decode(tokens[0], skip_special_tokens=True)
    asked = runner.invoke(cli_app, ["ask", str(out), "--question", QUESTION, "--max-new-tokens", "40",
                                    "--model", str(tiny_folder), "--compress-every", "8"])  # fmt: skip
    assert asked.exit_code == 0, asked.output
    eos = tiny_tokenizer.eos_token_id  # the command's tokenizer stops at it (the fixture's model does not)
    listed = tokens[0].tolist()
    cut = listed[: listed.index(eos)] if eos in listed else listed  # the command stops at the tokenizer's eos
    assert tokenizer.decode(cut, skip_special_tokens=True).strip() + "\n" in asked.output
    refused = runner.invoke(cli_app, ["ask", str(out), "--question", QUESTION, "--cap", "24"])
    assert refused.exit_code == 2 and "compress_every" in refused.output
    store = ContextStore(model, tmp_path / "store", max_bytes=1 << 30, decoding={"compress_every": 8})
    (tmp_path / "store" / "ctx-0123456789abcdef0123456789abcdef.safetensors").write_bytes(out.read_bytes())
    bounded = {"cap": 24, "compress_every": 8}
    server = Server(create_app(ServerSettings(model, tokenizer, NAME, store, METHOD, Budget(24), bounded=bounded)))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        created = _new_context(server).json()["id"]
        for context_id in (created, "ctx-0123456789abcdef0123456789abcdef"):
            reply = client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=40,
                extra_body={"context_id": context_id},
            )
            assert reply.choices[0].message.content == expected
    finally:
        server.stop()


def test_question_ids_continue_the_document_as_one_prompt(tiny) -> None:
    """Document then question ids are the prompt the two would make together (no template here: plain text)."""
    _, tokenizer = tiny
    both = torch.cat([document_ids(tokenizer, DOCUMENT), question_ids(tokenizer, QUESTION)], dim=1)
    assert tokenizer.decode(both[0], skip_special_tokens=True) == f"{DOCUMENT}\n\n{QUESTION}"


MANUAL = (
    "The Zorbian manual. "
    + " ".join(f"Section {i}: the valve number {i} must be turned clockwise twice before startup." for i in range(40))
    + " The secret access code of the facility is 7319. "
    + " ".join(f"Note {i}: keep the floor dry." for i in range(30))
)


@pytest.mark.model
def test_smollm2_answers_from_a_stored_context_over_http(smollm2_folder: Path, tmp_path: Path) -> None:
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    store = ContextStore(model, tmp_path, max_bytes=1 << 30)
    server = Server(create_app(ServerSettings(model, tokenizer, "smollm2-135m", store, "critical-snapkv", Budget(0.3))))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        created = httpx.post(server.url + "/v1/contexts", json={"document": MANUAL}, timeout=600)
        assert created.status_code == 200, created.text
        ask = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "What is the secret access code of the facility?"}],
            "max_tokens": 16,
            "extra_body": {"context_id": created.json()["id"]},
        }
        reply = client.chat.completions.create(**ask).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True))
        assert "7319" in reply and streamed == reply
        session = ContextSession(model, "critical-snapkv", 0.3)
        session.prefill(document_ids(tokenizer, MANUAL))
        question = question_ids(tokenizer, ask["messages"][0]["content"])
        tokens = session.ask(question, max_new_tokens=16, eos_token_id=tokenizer.eos_token_id).tokens[0].tolist()
        assert tokenizer.decode(tokens, skip_special_tokens=True) == reply
    finally:
        server.stop()
