"""One prefill serving many (method, budget) pairs: each layer's full cache is compressed into one cache per pair
right after that layer's prefill, then each pair answers on its own cache.

Scores and value norms are computed once per layer and scorer (``LayerView.remember``), so a sweep of methods
that share SnapKV's scorer costs little more than one of them.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache, CompressedLayer
from criticalkv.core.positions import forward_on_cache
from criticalkv.core.view import LayerView
from criticalkv.errors import CriticalKVError, MethodOptionError
from criticalkv.methods import build_method
from criticalkv.runtime.checks import check_compressible
from criticalkv.runtime.compressor import Compressor, LayerRecord
from criticalkv.runtime.method import Method
from criticalkv.runtime.session import ContextSession, token_digest, warn_unmasked_padding
from criticalkv.scorers.base import PendingLayer


@dataclass
class Target:
    """One (method, budget) pair of a sweep and the cache it fills."""

    label: str
    method: Method | None  # None: the full cache
    budget: Budget
    cache: CompressedCache | None = None  # during the prefill; its session holds it afterwards
    records: list[LayerRecord] = field(default_factory=list)
    pending: list[PendingLayer] = field(default_factory=list)  # a deferred method's dense layers
    state: dict = field(default_factory=dict)  # the method's scratch dict for this prefill (streaming allocators)
    compress_cpu_seconds: float = 0.0  # CPU time deciding and compressing this target's cache in the prefill


class SharedPrefill(Compressor):
    """Prefill once, compress into one cache per target.

    Parameters
    ----------
    model
        A supported causal LM.
    targets
        ``(label, method, budget)`` triples, or ``(label, method, budget, options)``; ``method`` is a preset name
        (``"full"`` keeps the full cache) or a ``Method``, ``options`` a preset's options (``{"window": 64}``, as
        ``build_method`` takes them: they set the target's own method alone).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        targets: list[tuple[str, str | Method, Budget | float | int | str] | tuple[str, str | Method, object, dict]],
    ):
        if not targets:
            raise CriticalKVError("SharedPrefill needs at least one (label, method, budget) target")
        built = []
        for target in targets:
            if not isinstance(target, tuple | list) or len(target) not in (3, 4):
                raise CriticalKVError(
                    f"a target is (label, method, budget) or (label, method, budget, options), got {target!r}"
                )
            label, method, budget, *options = target
            built.append(Target(label, _built(method, options[0] if options else {}), Budget.parse(budget)))
        if len({t.label for t in built}) != len(built):
            raise CriticalKVError("target labels must be unique")
        first = next((t.method for t in built if t.method is not None), None)
        super().__init__(model, first, Budget(1.0))  # checks the first method
        for target in built:  # every other target, before the prefill
            if target.method is not first:
                check_compressible(model, target.method)
        self.targets = built

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, ContextSession]:
        """Run the prefill once; return one ``ContextSession`` per target label, ready to ``ask``."""
        warn_unmasked_padding(self.model, input_ids, attention_mask)
        for target in self.targets:
            target.cache = CompressedCache(self.model.config, self)
            target.records, target.pending, target.state = [], [], {}
            target.compress_cpu_seconds = 0.0
        source = CompressedCache(self.model.config, self)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        start = time.perf_counter()
        with self:
            out = forward_on_cache(self.model, input_ids, mask, source)
            self._inputs = (input_ids, mask)
            for target in self.targets:  # deferred methods decide every layer now, each on its own cache
                if target.pending:
                    self.active_cache = target.cache
                    before = self.compress_cpu_seconds
                    self.finish_deferred(target.cache, target.pending, target.method, target.budget, target.records)
                    target.compress_cpu_seconds += self.compress_cpu_seconds - before
                    target.pending = []
        # sliding-window layers are copied to every target as they are: their windows, freed of the prompt's storage
        # at the end of the forward (Compressor._finish_prefill), not that storage
        for index, layer in enumerate(source.layers):
            if not isinstance(layer, CompressedLayer):
                for target in self.targets:
                    target.cache.layers[index] = copy.deepcopy(layer)
        for target in self.targets:
            target.cache.activate_past_recording()  # sliding layers can then be rewound after each answer
        last = out.logits[:, -1, :].float()
        seconds = time.perf_counter() - start
        sessions = {
            t.label: ContextSession.from_cache(self.model, self, t.cache, mask, last, seconds, t.compress_cpu_seconds)
            for t in self.targets
        }
        digest = token_digest(input_ids, mask)
        for session in sessions.values():
            session.context_digest = digest
        for target in self.targets:  # each session holds its own cache: one kept session keeps no other alive
            target.cache = None
        return sessions

    def compress_view(self, view: LayerView, layer: CompressedLayer) -> None:
        """Compress a layer's prefill ``view`` into one cache per target, then release the shared full prefill."""
        for target in self.targets:
            start = time.process_time()
            own = CompressedLayer()
            own.update(view.keys, view.values)  # shares the prompt's tensors until compress() gathers what it keeps
            target.cache.layers[view.module.layer_idx] = own
            if target.method is None or target.budget.keeps_everything:
                own.fresh = False  # the full cache
            else:
                pending = self.compress_into(
                    view, own, target.method, target.budget, target.cache, target.records, target.state
                )
                if pending is not None:
                    target.pending.append(pending)
            target.compress_cpu_seconds += time.process_time() - start
        layer.reset()  # the shared full prefill is released; each target now holds its own


def _built(method: str | Method, options: dict) -> Method | None:
    """A target's method: a preset built with its options, or a ``Method`` as given (which takes none)."""
    if not isinstance(options, dict):
        raise MethodOptionError(f"a target's options are a dict such as {{'window': 64}}, got {options!r}")
    if isinstance(method, Method):
        if options:
            raise MethodOptionError("options apply to preset names; set them on the pieces of a custom Method")
        return method
    return build_method(method, **options)
