"""Progress bars for long prefills: one step per decoder layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn


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
