"""How a model is split over processes (tensor and pipeline parallelism), and the checks made before it runs."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.distributed as dist
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, DummyLayer

from criticalkv.core.heads import is_dtensor
from criticalkv.errors import UnsupportedModelError
from criticalkv.models.families import attention_modules, text_config

# Column-parallel styles whose output transformers gathers back onto every rank: a k_proj under one of them is split
# over the ranks but gives each of them every KV head (OLMo 2's plan), so the ranks do not split the heads.
GATHERED_STYLES = ("colwise_gather_output", "colwise_rep")


def plan_style(model: PreTrainedModel, name: str) -> str | None:
    """The tensor-parallel style the model's plan (``model.tp_plan``, ``*`` for layer numbers, keys relative to the
    model or to its base model) gives the module of qualified name ``name``; None when the plan has no rule for it."""
    for pattern, style in (getattr(model, "tp_plan", None) or {}).items():
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}"):
            return style
    return None


class UnevenHeadsError(UnsupportedModelError):
    """The model's KV heads (or query heads) do not split evenly over the tensor-parallel ranks."""


def check_even_heads(config: PretrainedConfig, tp_size: int) -> None:
    """Raise ``UnevenHeadsError`` unless every tensor-parallel rank can hold an equal block of whole heads.

    Each rank must hold whole KV heads together with the query heads that read them, so both counts must be
    multiples of ``tp_size``. Checked on the config, before any weight is loaded: transformers itself loads such
    a model and only fails at the first forward, with a reshape error that does not say why.
    """
    if tp_size <= 1:
        return
    text = text_config(config)
    q_heads = int(text.num_attention_heads)
    k_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
    if k_heads % tp_size == 0 and q_heads % tp_size == 0:
        return
    fits = [n for n in range(1, k_heads + 1) if k_heads % n == 0 and q_heads % n == 0]
    raise UnevenHeadsError(
        f"this model has {k_heads} KV heads ({q_heads} query heads), which do not split evenly over "
        f"{tp_size} tensor-parallel ranks: each rank must hold whole KV heads and the query heads that read them. "
        f"Use a tensor-parallel size in {fits}, or pipeline parallelism (pp_size), which splits layers instead."
    )


def check_parallel_split(tp_size: int, pp_size: int) -> None:
    """Raise ``UnsupportedModelError`` for tensor and pipeline parallelism together (``tp_size > 1 < pp_size``).

    transformers (5.24) cannot load such a model: it resolves the tensor-parallel plan over every layer, then
    pipeline parallelism replaces the layers (and embedding, head) of the other stages with identity modules, and
    sharding the plan's first missing parameter fails with a ``KeyError``. Checked before any weight is loaded.
    """
    if tp_size <= 1 or pp_size <= 1:
        return
    n = tp_size * pp_size
    raise UnsupportedModelError(
        f"{tp_size} tensor-parallel ranks x {pp_size} pipeline stages: transformers cannot load a model split both "
        "ways (its tensor-parallel plan names the layers that pipeline parallelism removes from each stage). Use one "
        f"kind over the {n} processes: --tp-size {n} (tp_size={n}, if the heads divide) or --pp-size {n} (pp_size={n})."
    )


def _tp_size(model: PreTrainedModel) -> int:
    config = getattr(model.config, "distributed_config", None)
    return int(getattr(config, "tp_size", None) or 1)


def check_model(model: PreTrainedModel) -> None:
    """Refuse, before any forward, a model whose tensor-parallel split criticalkv cannot compress exactly.

    Raises
    ------
    UnevenHeadsError
        KV heads or query heads do not divide over the tensor-parallel ranks.
    UnsupportedModelError
        An attention layer's ``o_proj`` is sharded otherwise than row-parallel while its heads are split.
    """
    tp_size = _tp_size(model)
    if tp_size <= 1:
        return
    check_even_heads(model.config, tp_size)
    for module in model.modules():
        k_weight = getattr(getattr(module, "k_proj", None), "weight", None)
        if not (hasattr(module, "o_proj") and hasattr(module, "layer_idx") and is_dtensor(k_weight)):
            continue
        o_weight = module.o_proj.weight
        if not is_dtensor(o_weight) or o_weight.to_local().shape[1] * tp_size != o_weight.shape[1]:
            raise UnsupportedModelError(
                f"layer {module.layer_idx}: k_proj is split over {tp_size} ranks but o_proj is not row-parallel "
                f"({getattr(o_weight, 'placements', 'a plain tensor')}); criticalkv's value norm needs each rank "
                "to own the o_proj columns of its own query heads (transformers' default plans do)"
            )


def stage_layers(model: PreTrainedModel) -> set[int] | None:
    """The decoder layers this pipeline stage runs; None when the model is not split into stages.

    transformers' pipeline parallelism gives each stage a contiguous range of layers and replaces the others with
    identity modules; a cache of the stage holds nothing for them.
    """
    stage = getattr(model, "_pp_stage", None)  # set by transformers' apply_pipeline_parallelism
    if stage is None:
        return None
    layers = int(text_config(model.config).num_hidden_layers)
    start, end = stage.layer_range_for_rank(stage.pp_rank, layers)
    return set(range(start, end))


def on_this_stage(layers: list[CacheLayerMixin], owned: set[int] | None) -> list[CacheLayerMixin]:
    """A cache's ``layers`` (one per decoder layer) with those another pipeline stage runs replaced by transformers'
    ``DummyLayer``: they hold nothing, and transformers sizes masks (and ``StageLength`` reads the cache length) from
    the first layer that is not one, which must be a layer this stage fills. ``owned``: ``stage_layers``' set (None:
    all)."""
    return layers if owned is None else [layer if i in owned else DummyLayer() for i, layer in enumerate(layers)]


class StageLength:
    """Mixin for a transformers ``Cache`` whose other pipeline stages' layers are ``DummyLayer`` (``on_this_stage``):
    its length is read from a layer this stage holds.

    transformers reads a cache's length with ``get_seq_length()``, from layer 0 by default (the model's positions, our
    prefill and rewind checks). Up to transformers 5.24 ``Cache.get_seq_length`` passed over a layer 0 that tracks no
    length (a ``DummyLayer``) to the first attention layer; since 5.25 it asks layer 0 itself, and ``DummyLayer`` has
    no ``get_seq_length``, so on every stage but the first that read fails. Every layer a stage holds has seen the
    same tokens, so the first of them answers for the stage, whichever layer is asked.
    """

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self.held_layer_index(layer_idx))

    def held_layer_index(self, layer_idx: int) -> int:
        """``layer_idx``, or past a ``DummyLayer`` the first layer this stage holds (none held: ``len(layers)``,
        past the last layer, where transformers answers a length of 0)."""
        layers = self.layers
        if layer_idx < len(layers) and isinstance(layers[layer_idx], DummyLayer):
            held = (i for i, layer in enumerate(layers) if not isinstance(layer, DummyLayer))
            return next(held, len(layers))
        return layer_idx


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in a model's tensor x pipeline split.

    ``tp_rank``/``tp_size``: position in the tensor-parallel group; ``pp_rank``/``pp_size``: pipeline stage.
    ``heads_sharded``: the tensor-parallel ranks hold disjoint blocks of KV heads (False when the model's plan
    replicates attention on every rank, as Phi-3's and OLMo 2's do, or without tensor parallelism).
    """

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    heads_sharded: bool

    @classmethod
    def of(cls, model: PreTrainedModel) -> ParallelLayout:
        """The layout of a model loaded with (or without) a ``DistributedConfig``."""
        attention = attention_modules(model)
        initialized = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
        tp_rank, tp_size, sharded = 0, 1, False
        for module in attention:  # tensor parallelism shards attention parameters over the tensor-parallel mesh
            sharded_params = [p for p in module.parameters() if is_dtensor(p)]
            if sharded_params:
                mesh = sharded_params[0].device_mesh
                tp_rank, tp_size = mesh.get_local_rank(), mesh.size()
                k_weight = getattr(getattr(module, "k_proj", None), "weight", None)
                split = is_dtensor(k_weight) and k_weight.to_local().shape[0] < k_weight.shape[0]
                name = next(name for name, candidate in model.named_modules() if candidate is module)
                sharded = split and plan_style(model, f"{name}.k_proj") not in GATHERED_STYLES
                break
        stage = getattr(model, "_pp_stage", None)
        pp_rank, pp_size = (stage.pp_rank, stage.pp_size) if stage is not None else (0, 1)
        return cls(rank, world, tp_rank, tp_size, pp_rank, pp_size, sharded)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes."""
        return self.rank == 0

    def gather(self, value: object) -> list[object]:
        """Every rank's ``value`` (any picklable object), in rank order; ``[value]`` on one process."""
        if not self.distributed:
            return [value]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def from_main(self, value: object) -> object:
        """Rank 0's ``value`` (any picklable object) on every rank; ``value`` itself on one process."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def total(self, per_rank: int | float, by_heads: bool = True) -> int | float:
        """The model-wide total of a count every rank makes of its own cache (entries, bytes, layers kept whole).

        Pipeline stages hold different layers, so their counts add up. Tensor-parallel ranks add up too for a
        count over KV heads (``by_heads``) when they hold disjoint blocks of heads; a count over layers, or any
        count when the plan replicates attention, is the same on every tensor-parallel rank and is taken once.
        """
        counted = self.tp_rank == 0 or (by_heads and self.heads_sharded)
        values = self.gather(per_rank if counted else 0)
        return sum(values)
