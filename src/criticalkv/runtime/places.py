"""Where a compressed layer's kept entries stand in the prompt, for the scorers that read it (``LayerView.places``;
the surrogate's ``place="prompt"``).

A compressed layer stores its kept entries without their positions. The compressor of a scorer that reads places
remembers, per layer, each kept entry's index among its row's real tokens when the layer is first compressed
(``Places.placed``); a later compression of the layer (a chunked prefill's next chunk, decoding: ``runtime.rolling``)
reads them beside the held entries (``Places.of``) and remembers where the ones it keeps stand (``Places.remember``).
A saved session stores them (``Places.tensors``) and a loaded one reads them back (``Places.load``). A record holds
while its layer holds the storage it describes (the same length seen and per-head counts); where none does (a file
saved without places) they are unknown, and the scorer places by rank. Sessions stacked for one batched answer join
their rows' places (``join``), which the stacked session follows while it answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from criticalkv.cache.compressed_layer import CompressedLayer
from criticalkv.cache.rolling import held_places

_TENSOR = "places.{}"  # a saved session's tensor of layer i's places


@dataclass
class Places:
    """Each compressed layer's record: (its context_seen and lengths (b, h_kv) when placed, each context entry's
    place (N,) int32 in storage order, the real tokens seen (b,))."""

    known: dict[int, tuple] = field(default_factory=dict, repr=False)

    def placed(self, layer_idx: int, layer: CompressedLayer, valid: torch.Tensor, keep: torch.Tensor | None) -> None:
        """A prompt's first compression of a layer: ``keep`` (b, h_kv, t) of a view whose real tokens ``valid``
        (b, t) flags (None: the layer stays dense, its entries the prompt's own, placed by ``of``)."""
        self.known.pop(layer_idx, None)
        if keep is None or not layer.is_compressed:
            return
        index = valid.long().cumsum(-1) - 1  # (b, t): each position's index among its row's real tokens
        self.remember(layer_idx, layer, index[:, None, :].expand_as(keep)[keep], valid.sum(-1))

    def remember(self, layer_idx: int, layer: CompressedLayer, context: torch.Tensor, seen: torch.Tensor) -> None:
        """The places ``context`` (N,) of the entries the layer holds now, in storage order, after ``seen`` (b,) real
        tokens; a count that is not the layer's (a storage laid out otherwise) leaves them unknown."""
        self.known.pop(layer_idx, None)
        if context.shape[0] == layer.context_keys.shape[0]:  # 4 bytes an entry (its keys and values: 4 d or more)
            self.known[layer_idx] = (layer.context_seen, layer.lengths.clone(), context.to(torch.int32), seen)

    def of(
        self, layer_idx: int, layer: CompressedLayer, real: torch.Tensor, guide: int = 0
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where a layer's held entries stand among their rows' real tokens, (b, h_kv, T) long laid out as
        ``held_entries`` lays them, and the real tokens seen (b,): ``real`` (b, tail) flags the tail's real tokens,
        of which the last ``guide`` are a guide's (placed, not counted as seen). (None, None) where unknown."""
        if layer.is_compressed:
            known = self.known.get(layer_idx)
            if known is None or not _same_storage(known, layer):
                return None, None
            _, _, context, before = known
            context = context.long()
        else:  # dense: the tail is the whole sequence
            context, before = None, real.new_zeros(real.shape[0], dtype=torch.long)
        tail = before[:, None] + real.long().cumsum(-1) - 1  # (b, tail)
        seen = before + real[:, : real.shape[1] - guide].sum(-1)
        if context is None:
            return tail[:, None, :].expand(-1, layer.keys.shape[1], -1), seen
        return held_places(layer, context, tail), seen

    def saved(self) -> dict[int, tuple]:
        """What ``restore`` puts back (a session's context, around an answer compressed while decoding)."""
        return dict(self.known)

    def restore(self, saved: dict[int, tuple]) -> None:
        """Back to what ``saved`` returned."""
        self.known = dict(saved)

    def tensors(self, layers: list[CompressedLayer]) -> dict[str, torch.Tensor]:
        """The places of the layers whose record describes what they hold, to save beside them."""
        return {
            _TENSOR.format(index): known[2]
            for index, layer in enumerate(layers)
            if (known := self.known.get(index)) is not None and _same_storage(known, layer)
        }

    def load(self, tensors: dict[str, torch.Tensor], layers: list[CompressedLayer], seen: torch.Tensor) -> None:
        """Records from a saved session's ``tensors`` (its context: ``seen`` (b,) real tokens); layers saved
        without places stay unknown."""
        for index, layer in enumerate(layers):
            context = tensors.get(_TENSOR.format(index))
            if context is not None and layer.is_compressed:
                self.remember(index, layer, context, seen)


def join(parts: list[tuple[Places | None, list]], layers: list) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The places of ``layers``, the rows of the parts' layers stacked in order (``CompressedLayer.stack``: rows in
    order, each row's segments as they are): layer -> (places (N,), real tokens seen (b,)), for the layers whose every
    part knows its own (a part's dense layer holds its unpadded prompt's own entries)."""
    joined = {}
    for index, layer in enumerate(layers):
        if not isinstance(layer, CompressedLayer):  # another pipeline stage's
            continue
        context, seen = [], []
        for places, own in parts:
            part = own[index]
            if not part.is_compressed:
                b, h = part.keys.shape[:2]
                context.append(torch.arange(part.tail, dtype=torch.int32, device=part.keys.device).repeat(b * h))
                seen.append(torch.full((b,), part.tail, dtype=torch.long, device=part.keys.device))
                continue
            known = None if places is None else places.known.get(index)
            if known is None or not _same_storage(known, part):
                break
            context.append(known[2])
            seen.append(known[3])
        else:
            joined[index] = (torch.cat(context), torch.cat(seen))
    return joined


def _same_storage(known: tuple, layer: CompressedLayer) -> bool:
    """Whether a compressed layer still holds the context its remembered places describe (the same length seen and
    per-head counts: one compression later, or a context of other rows, differs)."""
    context_seen, lengths = known[:2]
    return (
        context_seen == layer.context_seen
        and lengths.shape == layer.lengths.shape
        and torch.equal(lengths, layer.lengths)
    )
