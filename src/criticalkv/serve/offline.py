"""``criticalkv compress`` and ``criticalkv ask``: a document compressed once into a file, questions asked of it
later, in another process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from criticalkv.budget import Budget
from criticalkv.distributed import launch
from criticalkv.errors import CriticalKVError
from criticalkv.methods import build_method
from criticalkv.models.families import check_length
from criticalkv.runtime.persist import read_header, save_session
from criticalkv.runtime.session import ContextSession
from criticalkv.serve.prompts import TextStream, document_ids, question_ids


def compress_document(
    model_name: str,
    method: str,
    budget: str | Budget,
    context_file: Path,
    out: Path,
    dtype: str = "auto",
    device: str = "auto",
    options: dict[str, object] | None = None,
    bounded: dict[str, int] | None = None,
) -> dict[str, object]:
    """Compress ``context_file``'s text (question-agnostic) and save the session to ``out``; what was written.
    ``bounded``: ``chunk_size`` and ``cap`` of a chunked prefill (``ContextSession``'s), memory bounded by them."""
    options = options or {}
    parsed = Budget.parse(budget)
    if build_method(method, **options) is None or parsed.keeps_everything:
        raise CriticalKVError("compress needs a compressing method and a budget below 1.0: 'full' stores nothing")
    if not context_file.is_file():
        raise CriticalKVError(f"--context-file {context_file} is not a file")
    document = context_file.read_text()
    encoded = []

    def prepare(config, tokenizer) -> None:
        encoded.append(document_ids(tokenizer, document))
        check_length(config, encoded[0].shape[1], "document length")

    model, _ = launch.load_model(model_name, dtype=dtype, device=device, with_tokenizer=prepare)
    session = ContextSession(model, method, parsed, **(bounded or {}), **options)
    session.prefill(encoded[0].to(next(model.parameters()).device))
    size = save_session(session, out, model_source=model_name)
    return {"tokens": session.context_length, "file_bytes": size, "kv_bytes": session.kv_bytes()}


def ask_file(
    path: Path,
    questions: list[str],
    max_new_tokens: int,
    emit: Callable[[str], None] | None = None,
    model_name: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    decoding: dict[str, int] | None = None,
) -> list[str]:
    """Answer each question from the context saved at ``path``; the answers. ``emit``: called with each piece of
    text as it is generated (streaming). ``model_name``: default, the model the file was compressed with.
    ``decoding``: ``cap`` and ``compress_every`` (``ContextSession.load``), answers compressed while decoding."""
    if not questions:
        raise CriticalKVError("ask needs at least one --question")
    if not path.is_file():
        raise CriticalKVError(f"{path} is not a file")
    source = model_name or read_header(path).get("model_source")
    if source is None:
        raise CriticalKVError(f"{path} does not name its model: pass --model")
    model, tokenizer = launch.load_model(source, dtype=dtype, device=device)
    session = ContextSession.load(path, model, **(decoding or {}))
    device_ = next(model.parameters()).device
    answers = []
    for question in questions:
        text = TextStream(tokenizer)
        for token, _ in session.stream(
            question_ids(tokenizer, question).to(device_), max_new_tokens, tokenizer.eos_token_id
        ):
            piece = text.push(int(token[0]))
            if emit is not None and piece:
                emit(piece)
        answers.append(text.text().strip())
        if emit is not None:
            emit(text.flush() + "\n")
    return answers
