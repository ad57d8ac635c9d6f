"""One prefill serving many (method, budget) pairs: each layer's full cache is compressed into one cache per pair
right after that layer's prefill, then each pair answers on its own cache.

Scores and value norms are computed once per layer and scorer (``LayerView.remember``), so a sweep of methods
that share SnapKV's scorer costs little more than one of them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache, CompressedLayer
from criticalkv.core.positions import forward_on_cache
from criticalkv.errors import CriticalKVError
from criticalkv.methods import build_method
from criticalkv.runtime.compressor import (
    Compressor,
    LayerRecord,
    apply_shrink,
    check_compressible,
    prefill_view,
)
from criticalkv.runtime.method import Method
from criticalkv.runtime.session import ContextSession, warn_unmasked_padding
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

    @property
    def deferred(self) -> bool:
        return self.method is not None and not self.budget.keeps_everything and self.method.deferred


class SharedPrefill(Compressor):
    """Prefill once, compress into one cache per target.

    Parameters
    ----------
    model
        A supported causal LM.
    targets
        ``(label, method, budget)`` triples; ``method`` is a preset name (``"full"`` keeps the full cache) or a
        ``Method``.
    """

    def __init__(self, model: PreTrainedModel, targets: list[tuple[str, str | Method, Budget | float | int | str]]):
        if not targets:
            raise CriticalKVError("SharedPrefill needs at least one (label, method, budget) target")
        built = []
        for label, method, budget in targets:
            m = method if isinstance(method, Method) else build_method(method)
            built.append(Target(label, m, Budget.parse(budget)))
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
        source = CompressedCache(self.model.config, self)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        with self:
            out = forward_on_cache(self.model, input_ids, mask, source)
            self._inputs = (input_ids, mask)
            for target in self.targets:  # deferred methods decide every layer now, each on its own cache
                if target.pending:
                    self.active_cache = target.cache
                    self.finish_deferred(target.cache, target.pending, target.method, target.budget, target.records)
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
        sessions = {t.label: ContextSession.from_cache(self.model, self, t.cache, mask, last) for t in self.targets}
        for target in self.targets:  # each session holds its own cache: one kept session keeps no other alive
            target.cache = None
        return sessions

    def compress_layer(
        self,
        module: nn.Module,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        layer: CompressedLayer,
    ) -> None:
        view = prefill_view(module, query, keys, values, attention_mask, scaling, self.facts)
        for target in self.targets:
            own = CompressedLayer()
            own.update(keys, values)  # shares the prompt's tensors until compress() gathers what it keeps
            target.cache.layers[module.layer_idx] = own
            if target.deferred:
                target.pending.append(self.defer_layer(view, own, target.method))
                continue
            if target.method is not None and not target.budget.keeps_everything:
                decision = target.method.decide(view, target.budget, target.state)
                apply_shrink(target.cache, decision.shrink, target.records)
                if decision.keep is not None:
                    own.compress(decision.keep, decision.width)
                target.records.append(
                    LayerRecord(module.layer_idx, view.lengths, decision.budgets, decision.kept_whole)
                )
            own.fresh = False
        layer.reset()  # the shared full prefill is released; each target now holds its own
