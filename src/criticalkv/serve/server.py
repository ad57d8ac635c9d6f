"""``criticalkv serve``: load the model, open the store, run the application under uvicorn."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from criticalkv.budget import Budget
from criticalkv.core.paths import cache_root
from criticalkv.errors import CriticalKVError
from criticalkv.methods import build_method
from criticalkv.models.loading import load_model
from criticalkv.serve.app import ServerSettings, create_app
from criticalkv.serve.batching import check_batching
from criticalkv.serve.store import ContextStore

MIB = 1 << 20


def default_store() -> Path:
    """``<cache>/contexts``: stored contexts outlive the server, and a restarted server serves them again."""
    return cache_root() / "contexts"


def decoding_of(bounded: dict[str, int]) -> dict[str, int]:
    """The part of a bounded-memory schedule that a loaded context follows: ``cap`` and ``compress_every``, with
    ``compress_every`` only (a context's prefill is over)."""
    if "compress_every" not in bounded:
        return {}
    return {key: bounded[key] for key in ("cap", "compress_every") if key in bounded}


def serve(
    model_name: str,
    method: str,
    budget: str | Budget,
    store: Path | None,
    max_memory_mib: float,
    host: str,
    port: int,
    max_document_tokens: int | None,
    max_tokens: int,
    dtype: str = "auto",
    device: str = "auto",
    options: dict[str, object] | None = None,
    batch_window: float = 0.01,
    max_batch: int = 8,
    bounded: dict[str, int] | None = None,
    guide_chunks: bool = False,
) -> None:
    """Serve until stopped; ``batch_window`` in seconds, ``bounded`` the ``chunk_size``, ``cap`` and
    ``compress_every`` of ``ContextSession`` (``ServerSettings``; loaded contexts follow the last two), and
    ``guide_chunks`` that of ``ServerSettings``."""
    options = options or {}
    parsed = Budget.parse(budget)
    if build_method(method, **options) is None or parsed.keeps_everything:
        raise CriticalKVError("serve compresses its contexts: give a compressing --method and a --budget below 1.0")
    if max_memory_mib <= 0:
        raise CriticalKVError(f"--max-memory must be > 0 MiB, got {max_memory_mib}")
    check_batching(batch_window, max_batch)  # before the model loads
    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    limit = max_document_tokens or int(getattr(model.config, "max_position_embeddings", 8192))
    settings = ServerSettings(
        model=model,
        tokenizer=tokenizer,
        model_name=model_name,
        store=ContextStore(model, store or default_store(), int(max_memory_mib * MIB), decoding_of(bounded or {})),
        method=method,
        budget=parsed,
        options=options,
        bounded=bounded or {},
        max_document_tokens=limit,
        default_max_tokens=max_tokens,
        batch_window=batch_window,
        max_batch=max_batch,
        guide_chunks=guide_chunks,
    )
    uvicorn.run(create_app(settings), host=host, port=port)
