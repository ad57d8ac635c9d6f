"""Hooks a transformers model so that each layer's cache is compressed right after that layer's prefill.

A deferred method (``Method.deferred``: a cross-layer allocator, or a scorer that reads the finished cache)
leaves every layer dense during the prefill, keeps what it needs of each layer (its scores, the last query rows),
and decides all layers together when the model's forward returns; a forward hook runs that step.

Nothing of transformers is patched: criticalkv registers an attention function under its own name, switches
the model to it with ``set_attn_implementation`` and back, and a forward pre-hook on the model hands a
``CompressedCache`` to a forward that would otherwise create a fresh ``DynamicCache``. For the block's duration the
model's own ``generate`` is wrapped (an attribute of that model object, removed on exit) to refuse a chunked prefill,
which no forward can tell from a whole prompt, and assisted decoding.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache, CompressedLayer, attention
from criticalkv.cache.compressed_cache import release_views
from criticalkv.core.layout import check_model
from criticalkv.core.view import LayerView
from criticalkv.errors import CacheStateError, UnsupportedModelError
from criticalkv.models.families import attention_modules
from criticalkv.runtime.checks import check_compressible, refuse_nesting
from criticalkv.runtime.method import Method
from criticalkv.runtime.places import Places
from criticalkv.runtime.prefill_view import PrefillFacts, prefill_view
from criticalkv.scorers.base import PendingLayer, PrefillContext, follows_places
from criticalkv.scorers.reconstruct import MaxAttentionProbe


@dataclass
class LayerRecord:
    """What compression did to one layer (all rows of the batch). Read-only: the layers of a forward may share a
    tensor (a uniform allocator's budgets)."""

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
    records: list[LayerRecord] = field(default_factory=list)  # the latest prefill's (start_prefill, an empty cache)
    record_keep: bool = False  # also store each layer's keep mask (for analysis and reference comparisons)
    # process CPU time spent scoring, selecting and compressing since the last ``start_prefill`` (host time only:
    # on a GPU, kernels still running when a step returns are not in it)
    compress_cpu_seconds: float = 0.0

    def __post_init__(self) -> None:
        check_compressible(self.model, self.method)
        check_model(self.model)  # a tensor-parallel split criticalkv can compress exactly, before any forward
        refuse_nesting(self.model)
        self.base_implementation = self.model.config._attn_implementation
        if self.base_implementation not in attention.BASE_IMPLEMENTATIONS:
            raise UnsupportedModelError(
                f"attention implementation {self.base_implementation!r} is not supported; "
                f"load the model with attn_implementation in {attention.BASE_IMPLEMENTATIONS}"
            )
        self.modules = attention_modules(self.model)
        self._hook = None
        self._finish_hook = None
        self._end_hook = None
        self._generate_guard: Callable | None = None  # the model's generate wrapped while installed
        self.pending: list[PendingLayer] = []  # layers of a deferred method during a prefill
        self._inputs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # the prefill's ids and mask
        self._finishing = False  # forwards run by a scorer while finishing a deferred prefill
        self._prefilling = False  # the running forward is a prefill (a new cache): its end frees the prompt's views
        # Collection mode: while set, the attention function of each dense compressible layer runs through its
        # ``attend``, which returns the layer's own output and collects what it probes (reconstruction scoring).
        self.attention_probe: MaxAttentionProbe | None = None
        self._state_cache: weakref.ref | None = None  # the cache whose prefill ``_state`` belongs to (not kept alive)
        self._active: weakref.ref | None = None  # the cache the running forward fills (``active_cache``)
        self._state: dict = {}
        self.facts = PrefillFacts()  # of the forward running now: a new one with every forward
        self.rolling = None  # a ``runtime.rolling.Rolling``: compress again after each chunk / every N tokens
        # where the kept entries stand in the prompt, followed only for a scorer that reads it (``runtime.places``)
        self.places = Places() if self.method is not None and follows_places(self.method.scorer) else None
        # how generate runs under a bounded-memory schedule (set with ``rolling`` by ``runtime.api``; the module that
        # knows it sits above this one)
        self.generate_with = None

    @property
    def active_cache(self) -> CompressedCache | None:
        """The cache the running forward fills (set by ``CompressedCache.update``, cleared when the model's forward
        ends), held weakly: a cache its caller drops is freed then, even inside a ``compress(...)`` block."""
        return None if self._active is None else self._active()

    @active_cache.setter
    def active_cache(self, cache: CompressedCache | None) -> None:
        self._active = None if cache is None else weakref.ref(cache)

    # --- install / uninstall ---------------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._hook is not None

    def install(self) -> Compressor:
        refuse_nesting(self.model)
        attention.register()
        for module in self.modules:
            module._criticalkv = self
        self.model.set_attn_implementation(attention.implementation_name(self.base_implementation))
        self._hook = self.model.register_forward_pre_hook(self._provide_cache, with_kwargs=True)
        self._finish_hook = self.model.register_forward_hook(self._finish_prefill, with_kwargs=True)
        self._end_hook = self.model.register_forward_hook(self._end_forward, always_call=True)  # also when it raised
        self._guard_generate()
        return self

    def _guard_generate(self) -> None:
        """Wrap the model's ``generate`` to refuse ``prefill_chunk_size`` (its chunks reach the model as separate
        forwards, and the first, into an empty cache, would be compressed as the whole context) and assisted decoding
        (its drafts would be compressed with the prompt), each with a message that says so."""
        generate = self.model.generate

        def guarded(*args, **kwargs):
            config = kwargs.get("generation_config", args[1] if len(args) > 1 else None) or self.model.generation_config

            def given(name: str) -> bool:
                return kwargs.get(name, getattr(config, name, None)) is not None

            if given("prefill_chunk_size"):
                raise CacheStateError(
                    "generate(prefill_chunk_size=...) prefills the prompt chunk by chunk, and criticalkv would "
                    "compress the first chunk as the whole context: prefill in one forward inside criticalkv.compress, "
                    "or give criticalkv.compress(..., chunk_size=, cap=)"
                )
            if given("assistant_model") or given("prompt_lookup_num_tokens"):
                raise CacheStateError(
                    "assisted decoding (assistant_model, prompt_lookup_num_tokens) is not available inside "
                    "criticalkv.compress(...): its first forward holds the prompt and the drafts, which would be "
                    "compressed as context, and a compressed cache cannot be cropped back"
                )
            given_cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5's name, and the old
            if (
                isinstance(given_cache, Cache)
                and not isinstance(given_cache, CompressedCache)
                and given_cache.get_seq_length() == 0
                and _replaceable(given_cache)
            ):
                warnings.warn(
                    f"the empty {type(given_cache).__name__} passed to generate stays empty: inside "
                    "criticalkv.compress the prefill fills a compressed cache of its own; continue from the "
                    "output's past_key_values (return_dict_in_generate=True)",
                    stacklevel=2,
                )
            if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
                warnings.warn(
                    "generate(use_cache=False) keeps no cache, so nothing is compressed inside criticalkv.compress: "
                    "every step runs over the whole uncompressed sequence",
                    stacklevel=2,
                )
            if (
                self.generate_with is not None
            ):  # compress(..., chunk_size=, compress_every=): chunked.generate_in_chunks
                return self.generate_with(self, generate, args, kwargs, config)
            return generate(*args, **kwargs)

        self.model.generate = guarded
        self._generate_guard = guarded

    def uninstall(self) -> None:
        for hook in (self._hook, self._finish_hook, self._end_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._finish_hook = self._end_hook = None
        if self._generate_guard is not None and self.model.__dict__.get("generate") is self._generate_guard:
            del self.model.generate  # the class's generate again
        self._generate_guard = None
        self.pending = []
        self.model.set_attn_implementation(self.base_implementation)
        self.active_cache = None
        self._state_cache, self._state, self.facts = None, {}, PrefillFacts()  # a kept compressor holds no cache
        self._inputs = (None, None)  # nor the last prefill's ids and mask
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
        if not self._finishing:  # a scorer's own forwards while a deferred prefill finishes keep that prefill's facts
            self.facts = PrefillFacts()
        if kwargs.get("output_attentions"):
            raise CacheStateError(
                "output_attentions is not available inside criticalkv.compress(...): a compressed layer attends over "
                "its kept entries with a fused kernel and returns no weights"
            )
        if kwargs.get("use_cache") is False:
            self.active_cache = None  # this forward uses no cache: no layer of an earlier one applies
            return None
        name = "past_key_values" if "past_key_values" in kwargs else "cache"
        cache = kwargs.get(name)
        if isinstance(cache, CompressedCache):
            cache.compressor = self
            if not self._finishing:
                if cache.get_seq_length() == 0:
                    self._begin_prefill()  # into the caller's own empty cache
                self._remember_inputs(args, kwargs)
            return None
        if cache is None or (isinstance(cache, Cache) and cache.get_seq_length() == 0):
            if cache is not None and not _replaceable(cache):
                raise CacheStateError(
                    f"an empty {type(cache).__name__} was passed (a static, quantized or offloaded cache: "
                    "cache_implementation=...); compressed layers keep a different number of entries per head, which "
                    "only criticalkv's own cache holds: pass no cache (generate's default) inside criticalkv.compress"
                )
            kwargs[name] = self.new_cache()
            self._begin_prefill()  # generate(...) called again in one block keeps nothing of earlier prefills
            self._remember_inputs(args, kwargs)
            return args, kwargs
        raise CacheStateError(
            "this forward continues a cache criticalkv did not create; prefill inside criticalkv.compress(...)"
        )

    def _begin_prefill(self) -> None:
        """A new prefill: the records and the pending layers of an earlier one (a forward that raised leaves its
        pending layers behind) are dropped."""
        self.records.clear()
        self.pending = []
        self._prefilling = True

    def _remember_inputs(self, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._inputs = (ids, kwargs.get("attention_mask"))

    def _finish_prefill(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self.rolling is not None and not self._finishing:
            self.rolling.finish(self)  # a cross-layer method's layers compressed again in this forward
        cache = self.active_cache
        if self._prefilling and cache is not None and not self._finishing:
            release_views(cache.layers)  # sliding layers' windows sliced from the prompt: the prompt's storage is freed
        self._prefilling = False  # a decode step's window views only that step's concatenation: left as it is
        if not self.pending or self._finishing:
            return
        self._finishing = True
        try:
            self.finish_deferred(self.active_cache, self.pending, self.method, self.budget, self.records)
        finally:
            self._finishing = False
            self.pending = []

    def _end_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        """The model's forward is over (or raised): its cache no longer applies. A forward that does not pass through
        the model's own call (``model.model(...)``, ``model.forward(...)``, with a cache of their own) must not read
        an earlier forward's compressed layers: with none active, the attention function runs the model's own."""
        if not self._finishing:  # a deferred scorer's own forwards end inside the forward being finished
            self.active_cache = None

    def start_prefill(self) -> None:
        """Forget the records and the compression time of the previous prefill."""
        self.records.clear()
        self.compress_cpu_seconds = 0.0

    @torch.no_grad()
    def finish_deferred(
        self,
        cache: CompressedCache,
        pending: list[PendingLayer],
        method: Method,
        budget: Budget,
        records: list[LayerRecord],
    ) -> None:
        """Decide and compress the pending layers of a deferred method, all together."""
        start = time.process_time()
        scores = None
        if method.scorer.after_prefill:
            ids, mask = self._inputs
            finishing, self._finishing = self._finishing, True  # the scorer's own forwards are not prefills
            try:
                scores = method.scorer.score_after_prefill(PrefillContext(self.model, self, cache, ids, mask, pending))
            finally:
                self._finishing = finishing
        views = [_current_view(p) for p in pending]
        decisions = method.decide_layers(views, budget, scores)
        for item, view, decision in zip(pending, views, decisions, strict=True):
            self._apply(item.layer, view, decision, records)
        self.compress_cpu_seconds += time.process_time() - start

    def _apply(self, layer: CompressedLayer, view: LayerView, decision, records: list[LayerRecord]) -> None:
        if decision.keep is None:
            layer.fresh = layer.pending = False
        else:
            layer.compress(decision.keep, decision.width)
        if self.places is not None:  # read when the layer is compressed again (chunks, decoding, a loaded session)
            self.places.placed(view.module.layer_idx, layer, view.valid, decision.keep)
        keep = None
        if self.record_keep:
            whole = view.valid[:, None, :].expand(-1, view.keys.shape[1], -1)  # kept whole: every real entry
            keep = whole.clone() if decision.keep is None else decision.keep
        records.append(LayerRecord(view.module.layer_idx, view.lengths, decision.budgets, decision.kept_whole, keep))

    def defer_layer(self, view: LayerView, layer: CompressedLayer, method: Method) -> PendingLayer:
        """Keep a layer dense until the end of the prefill; score it now unless its scorer waits for the end."""
        if not method.scorer.after_prefill:
            method.scores_of(view)  # computed while the full query is at hand, kept in the view's memo
        rows = min(method.query_rows, view.query.shape[2])
        b, h_kv, _, d = view.keys.shape
        empty = view.keys.new_empty((b, h_kv, 0, d))  # the layer's storage is read back at the end (_current_view),
        light = dataclasses.replace(  # so passes that grow it never keep the prefill-sized buffers alive twice
            view, query=view.query[:, :, -rows:].clone(), keys=empty, values=empty
        )
        layer.fresh, layer.pending = False, True
        return PendingLayer(layer, light)

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
        """Compress a layer right after its prefill attention (the attention function calls it): query
        (b, h_q, t, d), keys and values (b, h_kv, t, d) as the layer computed them, ``layer`` the cache's storage."""
        start = time.process_time()
        self.compress_view(prefill_view(module, query, keys, values, attention_mask, scaling, self.facts), layer)
        self.compress_cpu_seconds += time.process_time() - start

    def compress_view(self, view: LayerView, layer: CompressedLayer) -> None:
        """Compress a layer's prefill ``view`` into ``layer`` of the active cache under this compressor's method and
        budget (a ``SharedPrefill`` compresses it into one cache per target)."""
        cache = self.active_cache
        pending = self.compress_into(
            view, layer, self.method, self.budget, cache, self.records, self.prefill_state(cache)
        )
        if pending is not None:
            self.pending.append(pending)

    def compress_into(
        self,
        view: LayerView,
        layer: CompressedLayer,
        method: Method,
        budget: Budget,
        cache: CompressedCache,
        records: list[LayerRecord],
        state: dict,
    ) -> PendingLayer | None:
        """Compress one layer's prefill ``view`` into ``layer`` (its storage in ``cache``) under ``method`` and
        ``budget``: decide it now, shrink the earlier layers of ``cache`` as a streaming allocator orders (``state``:
        its scratch dict for this prefill) and add what was kept to ``records``. A deferred method's layer stays
        dense: it is returned pending, for ``finish_deferred`` at the end of the prefill."""
        if method.deferred:
            return self.defer_layer(view, layer, method)
        decision = method.decide(view, budget, state)
        apply_shrink(cache, decision.shrink, records)  # before this layer grows: a lower peak
        self._apply(layer, view, decision, records)
        return None

    def prefill_state(self, cache: CompressedCache) -> dict:
        """The method's scratch dict for the prefill of ``cache`` (streaming allocators); fresh for a new cache."""
        if self._state_cache is None or self._state_cache() is not cache:
            self._state_cache, self._state = weakref.ref(cache), {}
        return self._state


def _replaceable(cache: Cache) -> bool:
    """Whether an empty cache may be swapped for a ``CompressedCache``: transformers' plain ``DynamicCache`` (what
    ``generate`` creates by default), not one that offloads, nor another kind the caller chose."""
    return type(cache) is DynamicCache and not getattr(cache, "offloading", False)


def apply_shrink(cache: Cache, shrink: dict[int, torch.Tensor], records: list[LayerRecord]) -> None:
    """Shrink earlier compressed layers of a prefill as a streaming allocator ordered; their records follow."""
    for index, keep in shrink.items():
        layer = cache.layers[index]
        layer.shrink(keep)
        record = next(r for r in reversed(records) if r.layer == index)
        record.kept = layer.lengths.clone()
        if record.keep is not None:  # the (b, h_kv, t) keep mask: its kept entries, in storage order, are `keep`
            mask = torch.zeros_like(record.keep)
            mask[record.keep] = keep
            record.keep = mask


def _current_view(item: PendingLayer) -> LayerView:
    """A pending layer's view over its storage now: passes after the prefill may have moved (not changed) it."""
    t = item.view.valid.shape[1]
    return dataclasses.replace(item.view, keys=item.layer.keys[:, :, :t], values=item.layer.values[:, :, :t])
