"""Progress reporting: a bar per decoder layer for long prefills, and step progress for long runs that also
reads well in a log file (one line per step with the elapsed time and an ETA when the output is not a terminal)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich import get_console
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from torch import nn

# Columns of a table written to a file or a pipe: rich would otherwise cut it to 80 and wrap or elide its cells.
FILE_WIDTH = 200


def output_console(stderr: bool = False) -> Console:
    """A console for the CLI's tables: the terminal's width in a terminal, ``FILE_WIDTH`` columns otherwise (a
    log file, a pipe), where rich's default of 80 cut method names and headers."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=FILE_WIDTH)


def print_error(console: Console, error: BaseException | str) -> None:
    """``error: <message>`` in red, its lines never broken at the console's width (a command in it pastes whole) and
    its text printed as written (no rich markup read into it)."""
    console.print(f"[red]error:[/red] {escape(str(error))}", soft_wrap=True)


class Advance(Protocol):
    def __call__(self, note: str = "", *, skipped: bool = False) -> None: ...


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@contextmanager
def step_progress(
    description: str, total: int | None, enabled: bool = True, console: Console | None = None
) -> Iterator[Advance]:
    """Report ``total`` steps; yields ``advance(note="", skipped=False)``, called once per finished step.

    In a terminal: a rich bar with elapsed time and ETA, described by the last step's note. Otherwise (a log file,
    a batch job): one plain line per step, ``description: done/total note (elapsed H:MM:SS, ETA H:MM:SS)``; steps
    marked ``skipped`` (results already on disk) count towards ``done`` but not towards the rate the ETA is
    computed from.
    """
    console = console or get_console()
    if not enabled:
        yield lambda note="", *, skipped=False: None
        return
    if console.is_terminal:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(description, total=total)
            yield lambda note="", *, skipped=False: progress.update(
                task, advance=1, description=f"{description}: {note}" if note else description
            )
        return
    start = time.perf_counter()
    counts = {"done": 0, "worked": 0}

    def advance(note: str = "", *, skipped: bool = False) -> None:
        counts["done"] += 1
        if skipped:
            return
        counts["worked"] += 1
        elapsed = time.perf_counter() - start
        line = f"{description}: {counts['done']}/{total if total is not None else '?'}"
        line += f" {note}" if note else ""
        timing = f"elapsed {_clock(elapsed)}"
        if total is not None:
            timing += f", ETA {_clock(elapsed / counts['worked'] * max(total - counts['done'], 0))}"
        console.print(f"{line} ({timing})", highlight=False, markup=False, soft_wrap=True)

    yield advance


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (``model.model.layers`` in every supported family)."""
    return model.get_decoder().layers


@contextmanager
def layer_progress(model: nn.Module, description: str, enabled: bool = True) -> Iterator[None]:
    """Show a bar that advances as each decoder layer finishes during the forwards inside the block."""
    if not enabled:
        yield
        return
    layers = decoder_layers(model)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("layer {task.completed}/{task.total}"))
    with Progress(*columns, TimeElapsedColumn(), transient=True) as progress:
        task = progress.add_task(description, total=len(layers))
        handles = [
            layer.register_forward_hook(lambda *_: progress.advance(task))  # one step per finished layer
            for layer in layers
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
