"""Collecting chat requests on one stored context into batches: the questions of concurrent requests on a context
are answered together, as the rows of one decode on its compressed cache (docs/serving.md, "Concurrency")."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from criticalkv.cache import CompressedCache
from criticalkv.errors import CriticalKVError
from criticalkv.runtime.session import ContextSession
from criticalkv.serve.decode import Row

log = logging.getLogger(__name__)


def check_batching(window: float, max_rows: int) -> None:
    """Refuse a negative window or a batch below one row (``CriticalKVError``, named as ``criticalkv serve``'s
    options)."""
    if window < 0 or max_rows < 1:
        raise CriticalKVError(
            f"--batch-window-ms must be >= 0 and --max-batch >= 1, got {window * 1000:g} ms and {max_rows}"
        )


@dataclass
class _Pending:
    """The rows waiting on one context, its window's timer (None: not running) and whether a batch of them is
    queued on the worker (it takes every row waiting when it starts, up to the batch's bound)."""

    rows: list[Row] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    queued: bool = False


class Batcher:
    """Answers chat rows by context: the rows of one context that wait together form one batch.

    The first row on a context waits up to ``window`` seconds for others, then its batch is queued on the worker; it
    goes at once when ``max_rows`` are waiting. A batch takes the rows waiting when the worker starts it (those that
    came while the worker was busy join it), at most ``max_rows``; the rest form the next batch, queued behind it.

    Parameters
    ----------
    worker
        The one model thread: every batch runs there, in the order queued.
    resolve
        On the worker: the session of a context id (its exception, a refusal, ends every row of the batch).
    answer
        On the worker: answer rows from a session in one decode (``decode.answer_rows``).
    window
        Seconds a context's first row waits for others (0: no wait).
    max_rows
        Rows per batch at most (1: every request decodes alone).
    """

    def __init__(
        self,
        worker: ThreadPoolExecutor,
        resolve: Callable[[str], ContextSession],
        answer: Callable[[ContextSession, list[Row]], None],
        window: float,
        max_rows: int,
    ) -> None:
        check_batching(window, max_rows)
        self.worker, self.resolve, self.answer = worker, resolve, answer
        self.window, self.max_rows = window, max_rows
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()  # guards _pending: rows come on the event loop, batches leave on the worker
        self._told_unstackable = False

    def submit(self, context_id: str, row: Row) -> None:
        """On the event loop: ``row`` waits for its batch on ``context_id``."""
        with self._lock:
            pending = self._pending.setdefault(context_id, _Pending())
            pending.rows.append(row)
            if pending.queued:  # the queued batch takes this row when it starts
                return
            if len(pending.rows) >= self.max_rows or self.window <= 0:
                self._queue(context_id, pending)
            elif pending.timer is None:
                pending.timer = asyncio.get_running_loop().call_later(self.window, self._due, context_id)

    def _due(self, context_id: str) -> None:
        """On the event loop: a context's window has passed."""
        with self._lock:
            pending = self._pending.get(context_id)
            if pending is not None and not pending.queued:
                self._queue(context_id, pending)

    def _queue(self, context_id: str, pending: _Pending) -> None:
        """Queue a batch of the context on the worker; ``_lock`` is held."""
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        pending.queued = True
        self.worker.submit(self._run, context_id)

    def _run(self, context_id: str) -> None:
        """On the worker: take the context's waiting rows (up to ``max_rows``) and answer them."""
        with self._lock:
            pending = self._pending[context_id]
            rows, pending.rows = pending.rows[: self.max_rows], pending.rows[self.max_rows :]
            pending.queued = False
            if pending.rows:  # they have waited their window already: the next batch is queued at once
                self._queue(context_id, pending)
            else:
                del self._pending[context_id]
        try:
            session = self.resolve(context_id)  # once per batch: a DELETE after this does not stop its rows
        except Exception as error:
            for row in rows:
                row.fail(error)
            return
        for batch in self._batches(session, rows):
            self.answer(session, batch)

    def _batches(self, session: ContextSession, rows: list[Row]) -> list[list[Row]]:
        """The rows as one batch, or one by one where the session's cache cannot be stacked (sliding-window
        layers: see ``CompressedCache.stackable``), which is logged once."""
        if len(rows) == 1 or (isinstance(session.cache, CompressedCache) and session.cache.stackable()):
            return [rows]
        if not self._told_unstackable:
            self._told_unstackable = True
            log.warning("this model's compressed caches cannot be stacked: questions on one context decode one by one")
        return [[row] for row in rows]
