"""What every piece of a method (scorer, allocator, selector) may declare, with the defaults a piece inherits."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn
from transformers import PretrainedConfig


@runtime_checkable
class Piece(Protocol):
    """The members a scorer, an allocator and a selector share; each has a default, so a piece that derives from its
    contract (``Scorer``, ``Allocator``, ``Selector``) states only what it changes.

    Attributes
    ----------
    window
        The observation window the piece reads: the last query rows of a prefill (SnapKV's, CriticalKV's). None
        (the default): the piece reads no window. A ``Method``'s pieces that read one state the same number, the
        method's ``window``.
    """

    window: int | None = None

    def check_config(self, config: PretrainedConfig) -> None:
        """Refuse, from a checkpoint's config alone (before its weights load), a model the piece cannot serve:
        raise a ``CriticalKVError``. The default accepts every model."""

    def check_model(self, model: nn.Module) -> None:
        """Refuse, before any forward, a loaded model the piece cannot serve (its tokenizer, its fitted weights):
        raise a ``CriticalKVError``. The default accepts every model."""
