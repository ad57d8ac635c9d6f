"""Stored contexts: every context is written to the store folder when it is made, and held in memory under a byte
bound, least recently used first out; one that was dropped from memory is loaded again from its file on demand."""

from __future__ import annotations

import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from criticalkv.errors import StoredContextError
from criticalkv.runtime.persist import check_header, read_header
from criticalkv.runtime.session import ContextSession

_ID = re.compile(r"^ctx-[0-9a-f]{32}$")  # what ``new_id`` makes; anything else names no file


class UnknownContextError(KeyError):
    """No stored context has this id (never made, or deleted)."""


@dataclass
class ContextInfo:
    """What ``GET /v1/contexts/{id}`` says about a stored context."""

    id: str
    tokens: int
    file_bytes: int
    kv_bytes: int  # the compressed cache's key/value bytes in memory
    method: str
    budget: float | int
    in_memory: bool


class ContextStore:
    """Compressed contexts by id, on disk in ``folder`` and in memory up to ``max_bytes`` (their ``kv_bytes``).

    Parameters
    ----------
    model
        The model every context belongs to (files of another model are refused when loaded).
    folder
        Where the files live, ``<id>.safetensors`` each; made if missing. Files already there are served too.
    max_bytes
        The memory bound: after an insertion or a load, least recently used contexts leave memory until the held
        bytes fit (the one just used always stays, even alone over the bound).
    decoding
        ``cap`` and ``compress_every`` of the contexts loaded from their files (``ContextSession.load``): their
        answers are compressed back to the cap while decoding (empty: never).
    """

    def __init__(
        self, model: PreTrainedModel, folder: Path, max_bytes: int, decoding: dict[str, int] | None = None
    ) -> None:
        self.model, self.folder, self.max_bytes = model, Path(folder), max_bytes
        self.decoding = decoding or {}
        self.folder.mkdir(parents=True, exist_ok=True)
        self._held: OrderedDict[str, ContextSession] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # guards _held (the model worker and the event loop both read it)

    def path(self, context_id: str) -> Path:
        if not _ID.match(context_id):
            raise UnknownContextError(context_id)
        return self.folder / f"{context_id}.safetensors"

    @staticmethod
    def new_id() -> str:
        return f"ctx-{uuid.uuid4().hex}"

    def add(self, session: ContextSession) -> str:
        """Write the session to a new file, then hold it; its id. A failed write (a full disk) raises and leaves
        nothing behind: the store is as it was."""
        context_id = self.new_id()
        session.save(self.path(context_id))
        with self._lock:
            self._held[context_id] = session
            self._evict(keep=context_id)
        return context_id

    def get(self, context_id: str) -> ContextSession:
        """The context's session, loaded from its file when not in memory (``StoredContextError`` for a file of
        another model, dtype or layout version)."""
        path = self.path(context_id)
        with self._lock:
            session = self._held.get(context_id)
            if session is not None:
                self._held.move_to_end(context_id)
                return session
        if not path.is_file():
            raise UnknownContextError(context_id)
        self._checked_header(context_id, path)  # refused with the context's id, not the server's paths
        session = ContextSession.load(path, self.model, **self.decoding)
        with self._lock:
            self._held[context_id] = session
            self._evict(keep=context_id)
        return session

    def info(self, context_id: str) -> ContextInfo:
        path = self.path(context_id)
        if not path.is_file():
            raise UnknownContextError(context_id)
        header = self._checked_header(context_id, path)
        with self._lock:
            session = self._held.get(context_id)
        return ContextInfo(
            id=context_id,
            tokens=header["context"]["tokens"],
            file_bytes=path.stat().st_size,
            kv_bytes=session.kv_bytes() if session is not None else 0,
            method=header["method"]["spec"],
            budget=header["budget"],
            in_memory=session is not None,
        )

    def _checked_header(self, context_id: str, path: Path) -> dict[str, object]:
        """The file's header, refused (``StoredContextError``) when this model cannot answer from it."""
        try:
            header = read_header(path)
        except StoredContextError:
            raise StoredContextError(f"stored context {context_id} is not a readable criticalkv file") from None
        check_header(header, self.model, context_id)
        return header

    def delete(self, context_id: str) -> None:
        """Forget the context: its file and its memory. A request already answering from it finishes."""
        path = self.path(context_id)
        with self._lock:
            held = self._held.pop(context_id, None)
        if not path.is_file():
            if held is None:
                raise UnknownContextError(context_id)
            return
        path.unlink()

    def held_bytes(self) -> int:
        with self._lock:
            return sum(session.kv_bytes() for session in self._held.values())

    def held_count(self) -> int:
        with self._lock:
            return len(self._held)

    def _evict(self, keep: str) -> None:
        """Drop least recently used sessions (their files stay) until the held bytes fit; ``_lock`` is held."""
        total = sum(session.kv_bytes() for session in self._held.values())
        for context_id in list(self._held):
            if total <= self.max_bytes:
                break
            if context_id != keep:
                total -= self._held.pop(context_id).kv_bytes()
