"""Hooks a transformers model so that each layer's cache is compressed right after that layer's prefill.

Nothing of transformers is patched: criticalkv registers an attention function under its own name, switches
the model to it with ``set_attn_implementation`` and back, and a forward pre-hook on the model hands a
``CompressedCache`` to a forward that would otherwise create a fresh ``DynamicCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache, CompressedLayer, attention
from criticalkv.errors import CacheStateError, UnsupportedModelError
from criticalkv.models.families import check_supported
from criticalkv.runtime.method import Method
from criticalkv.scorers import LayerView


def prefill_view(
    module: nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> LayerView:
    """The LayerView of a layer's prefill, as its attention function receives it."""
    b, _, t, _ = keys.shape
    if attention_mask is None:
        valid = torch.ones(b, t, dtype=torch.bool, device=keys.device)
    else:  # the last query sees every real key; padding columns are masked in its row
        valid = attention.as_bool_mask(attention_mask)[:, 0, -1, :t]
    return LayerView(module, query, keys, values, valid, scaling)


@dataclass
class LayerRecord:
    """What compression did to one layer (all rows of the batch)."""

    layer: int
    before: torch.Tensor  # (b,) real entries per head before compression
    kept: torch.Tensor  # (b, h_kv) entries kept per head
    kept_whole: torch.Tensor  # (b,) bool
    keep: torch.Tensor | None = None  # (b, h_kv, t) bool keep mask, when the compressor records them


@dataclass
class Compressor:
    """Installs a method and a budget on a model; see ``criticalkv.compress`` for the one-line form."""

    model: PreTrainedModel
    method: Method
    budget: Budget
    records: list[LayerRecord] = field(default_factory=list)
    record_keep: bool = False  # also store each layer's keep mask (for analysis and reference comparisons)
    active_cache: CompressedCache | None = None

    def __post_init__(self) -> None:
        check_supported(self.model.config)
        self.base_implementation = self.model.config._attn_implementation
        if self.base_implementation.startswith("criticalkv_"):
            raise CacheStateError("this model is already inside criticalkv.compress(...); blocks do not nest")
        if self.base_implementation not in attention.BASE_IMPLEMENTATIONS:
            raise UnsupportedModelError(
                f"attention implementation {self.base_implementation!r} is not supported; "
                f"load the model with attn_implementation in {attention.BASE_IMPLEMENTATIONS}"
            )
        self.modules = [m for m in self.model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]
        self._hook = None

    # --- install / uninstall ---------------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._hook is not None

    def install(self) -> Compressor:
        if self.model.config._attn_implementation.startswith("criticalkv_"):
            raise CacheStateError("this model is already inside criticalkv.compress(...); blocks do not nest")
        attention.register()
        for module in self.modules:
            module._criticalkv = self
        self.model.set_attn_implementation(attention.implementation_name(self.base_implementation))
        self._hook = self.model.register_forward_pre_hook(self._provide_cache, with_kwargs=True)
        return self

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.model.set_attn_implementation(self.base_implementation)
        self.active_cache = None
        for module in self.modules:
            module.__dict__.pop("_criticalkv", None)

    def __enter__(self) -> Compressor:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def new_cache(self) -> CompressedCache:
        cache = CompressedCache(self.model.config, self)
        if not any(isinstance(layer, CompressedLayer) for layer in cache.layers):
            raise UnsupportedModelError(
                "every attention layer of this model is a sliding-window layer: nothing to compress"
            )
        return cache

    def _provide_cache(self, module: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("use_cache") is False:
            self.active_cache = None  # this forward uses no cache: no layer of an earlier one applies
            return None
        name = "past_key_values" if "past_key_values" in kwargs else "cache"
        cache = kwargs.get(name)
        if isinstance(cache, CompressedCache):
            cache.compressor = self
            return None
        if cache is None or (isinstance(cache, Cache) and cache.get_seq_length() == 0):
            kwargs[name] = self.new_cache()
            return args, kwargs
        raise CacheStateError(
            "this forward continues a cache criticalkv did not create; prefill inside criticalkv.compress(...)"
        )

    # --- called by the attention function ---------------------------------------------------------------------
    def layer_for(self, layer_idx: int) -> CompressedLayer | None:
        cache = self.active_cache
        if cache is None or layer_idx >= len(cache.layers):
            return None
        layer = cache.layers[layer_idx]
        return layer if isinstance(layer, CompressedLayer) else None

    @torch.no_grad()
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
        view = prefill_view(module, query, keys, values, attention_mask, scaling)
        decision = self.method.decide(view, self.budget)
        if decision.keep is None:
            layer.fresh = False
        else:
            layer.compress(decision.keep)
        keep = None
        if self.record_keep:
            whole = view.valid[:, None, :].expand(-1, keys.shape[1], -1)  # a layer kept whole keeps every real entry
            keep = whole.clone() if decision.keep is None else decision.keep
        self.records.append(LayerRecord(module.layer_idx, view.lengths, decision.budgets, decision.kept_whole, keep))
