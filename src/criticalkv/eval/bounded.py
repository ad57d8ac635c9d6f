"""The bounded-memory options of the commands (``run``, ``compress``, ``ask``, ``serve`` and the ``eval`` sweeps):
chunked prefill with a cap, and compression while decoding (``criticalkv.compress(..., chunk_size=, cap=,
compress_every=)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from criticalkv.budget import Budget
from criticalkv.errors import BoundedMemoryError

ChunkSizeOption = Annotated[
    int | None,
    typer.Option(
        help="Prefill the prompt this many tokens at a time, compressing every layer back to the cap after each "
        "chunk (bounded memory; docs/guide.md)."
    ),
]
CapOption = Annotated[
    int | None,
    typer.Option(
        help="Entries per KV head kept by every compression of a chunked prefill or of decoding; replaces the "
        "budget (without it, an entry-count budget is the cap)."
    ),
]
CompressEveryOption = Annotated[
    int | None,
    typer.Option(help="While answering, compress back to the cap every this many generated tokens."),
]
GuideChunksOption = Annotated[
    bool,
    typer.Option(
        help="Question-aware chunked prefill: every chunk but the last is scored by the question's queries, run "
        "after it and never kept, instead of the chunk's own last queries (docs/guide.md)."
    ),
]


FullFromOption = Annotated[
    Path | None,
    typer.Option(
        help="A sweep folder of the same samples answered one-shot: a chunked sweep copies its full-cache rows "
        "instead of prefilling the full cache in chunks again (it evicts nothing: chunks change only its rounding)."
    ),
]


class Bounded(NamedTuple):
    """The options as given (None, False: not given)."""

    chunk_size: int | None = None
    cap: int | None = None
    compress_every: int | None = None
    guide_chunks: bool = False

    @property
    def schedule(self) -> tuple[int | None, int | None, int | None]:
        """Chunk size, cap and decoding interval: ``rolling_budget``'s and ``bounded_compressor``'s arguments."""
        return self.chunk_size, self.cap, self.compress_every

    @property
    def options(self) -> dict[str, int]:
        """The given schedule, as keyword arguments of ``ContextSession``."""
        names = ("chunk_size", "cap", "compress_every")
        return {name: value for name, value in zip(names, self.schedule, strict=True) if value is not None}

    def check_guide(self, regime: str) -> None:
        """Refuse ``--guide-chunks`` where there is no question to guide with or no chunk to guide."""
        if not self.guide_chunks:
            return
        if self.chunk_size is None:
            raise BoundedMemoryError("--guide-chunks scores the chunks of a chunked prefill: give --chunk-size")
        if regime != "aware":
            raise BoundedMemoryError(
                "--guide-chunks scores each chunk with the question, which the question-agnostic regime does not "
                "know while it prefills: use --mode aware"
            )

    def check_full_from(self, full_from: Path | None) -> None:
        """Refuse ``--full-from`` on a sweep that prefills whole: its pairs share the full cache's prefill already."""
        if full_from is not None and not self.options:
            raise BoundedMemoryError(
                "--full-from copies the full cache's rows into a chunked sweep (--chunk-size or --compress-every); "
                "a one-shot sweep prefills the full cache once for every pair anyway"
            )

    def budgets(self, budgets: list[Budget]) -> list[Budget]:
        """A sweep's budgets: ``[Budget(cap)]`` when a cap is given (a sweep names its pairs by budget, so the cap
        is the one budget; any other budget given with it is refused), else ``budgets``, which must then be counts when
        a chunk size or a decoding interval is given."""
        if self.cap is None:
            if (self.chunk_size or self.compress_every) and any(
                b.is_fraction and not b.keeps_everything for b in budgets
            ):
                raise BoundedMemoryError(
                    "--chunk-size and --compress-every compress to an entry count per KV head: give --cap, or the "
                    "budget as a count (1024), not a fraction of a prompt no chunk holds whole"
                )
            return budgets
        if any(b != Budget(self.cap) for b in budgets if b != Budget(0.2)):
            raise BoundedMemoryError("--cap is the one budget: give it alone, or give the budget as a count")
        return [Budget(self.cap)]

    @property
    def setting(self) -> dict[str, dict[str, int]]:
        """``{"bounded": options}`` for a JSON report or a sweep's settings, or nothing when none is given."""
        guided = {"guide_chunks": True} if self.guide_chunks else {}  # absent: the settings made before it
        return {"bounded": {**self.options, **guided}} if self.options else {}
