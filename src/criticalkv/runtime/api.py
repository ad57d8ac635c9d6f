"""The one-line API: ``with criticalkv.compress(model, "critical-snapkv", budget=0.2): model.generate(...)``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers import PreTrainedModel

from criticalkv.budget import Budget
from criticalkv.errors import MethodOptionError
from criticalkv.methods import build_method
from criticalkv.runtime.checks import check_compressible, refuse_nesting
from criticalkv.runtime.chunked import generate_in_chunks, rolling_budget
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.method import Method
from criticalkv.runtime.rolling import check_rolling_method


def make_compressor(
    model: PreTrainedModel, method: str | Method, budget: Budget | float | int | str, **options: object
) -> Compressor | None:
    """A compressor for a preset name or a ``Method``; None for ``"full"`` (nothing to install). A model inside a
    ``compress`` block is refused, ``"full"`` included: the block's hooks would compress its run."""
    budget = Budget.parse(budget)
    if isinstance(method, Method):
        if options:
            raise MethodOptionError("options apply to preset names; set them on the pieces of a custom Method")
        built = method
    else:
        built = build_method(method, **options)
    if built is None or budget.keeps_everything:
        refuse_nesting(model)  # a Compressor refuses it itself
        if built is not None:  # a sweep's budget 1.0 refuses what its next budget would
            check_compressible(model, built)
        return None
    return Compressor(model, built, budget)


def bounded_compressor(
    model: PreTrainedModel,
    method: str | Method,
    budget: Budget | float | int | str,
    chunk_size: int | None,
    cap: int | None,
    compress_every: int | None,
    options: dict,
) -> Compressor | None:
    """``make_compressor`` with a bounded-memory schedule (``chunked.rolling_budget``): a method that cannot follow
    it is refused before anything else is checked of the model (``BoundedMemoryError``)."""
    budget, rolling = rolling_budget(method, budget, chunk_size, cap, compress_every)
    if rolling is None:
        return make_compressor(model, method, budget, **options)
    if not isinstance(method, Method):
        built = build_method(method, **options)
        method, options = (built if built is not None else method), {}
    if isinstance(method, Method):
        check_rolling_method(method)
    compressor = make_compressor(model, method, budget, **options)
    if compressor is not None:
        compressor.rolling = rolling
        compressor.generate_with = generate_in_chunks
    return compressor


@contextmanager
def compress(
    model: PreTrainedModel,
    method: str | Method = "critical-snapkv",
    budget: Budget | float | int | str = 0.2,
    *,
    chunk_size: int | None = None,
    cap: int | None = None,
    compress_every: int | None = None,
    **options: object,
) -> Iterator[Compressor | None]:
    """Compress every prefill run inside the block; each layer's cache shrinks right after its prefill.

    Parameters
    ----------
    model
        A transformers causal LM of a supported family, with ``sdpa`` or ``eager`` attention.
    method
        A preset name (``criticalkv.method_names()``) or a custom ``Method``.
    budget
        A fraction of each prompt (``0.2``) or an entry count per KV head (``512``). ``1.0`` installs nothing:
        the model runs exactly as without criticalkv (a model the method cannot compress is refused all the same).
    chunk_size
        Bounded memory (docs/guide.md): ``model.generate`` prefills the prompt ``chunk_size`` tokens at a time and
        compresses every layer back to ``cap`` entries per KV head after each chunk.
    cap
        Entries per KV head kept by every compression of a chunked prefill or of decoding; it replaces ``budget``
        (without it, an entry-count ``budget`` is the cap; a fraction is refused). A cap above the prompt's
        length compresses nothing.
    compress_every
        While decoding, compress back to ``cap`` every ``compress_every`` generated tokens (the most recent
        tokens are the window a window scorer protects).
    options
        Preset options, e.g. ``window=64`` or ``alpha=0.25``.

    Yields
    ------
    The installed ``Compressor`` (its ``records`` say what each layer kept), or None when nothing is compressed.
    """
    compressor = bounded_compressor(model, method, budget, chunk_size, cap, compress_every, options)
    if compressor is None:
        yield None
        return
    with compressor:
        yield compressor
