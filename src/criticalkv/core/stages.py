"""What a pipeline stage needs from the others: the layers it does not run, for pieces that compare layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.models.families import compressed_layer_position

if TYPE_CHECKING:
    from criticalkv.core.view import LayerView


def split_over_ranks(module: nn.Module) -> bool:
    """True when the attention module's model runs split over processes (tensor or pipeline parallelism)."""
    config = getattr(getattr(module, "config", None), "distributed_config", None)
    return int(getattr(config, "tp_size", 1) or 1) > 1 or int(getattr(config, "pp_size", 1) or 1) > 1


def refuse_split(module: nn.Module, what: str, instead: str) -> None:
    """Raise ``UnsupportedModelError`` if the module's model is split over processes."""
    if split_over_ranks(module):
        raise UnsupportedModelError(f"{what} does not run under tensor or pipeline parallelism; use {instead}")


def every_layer(per_layer: list[torch.Tensor], views: list[LayerView]) -> dict[int, torch.Tensor]:
    """Each compressed layer's tensor, by layer index in the model's order, over every pipeline stage.

    ``per_layer[i]`` belongs to ``views[i]``. On one process, or when this process runs every compressed layer,
    that is what it was given. On a pipeline stage the other stages' layers are gathered (one
    ``all_gather_object`` over every rank: it runs once per prefill, when a deferred method decides); ranks of one
    stage under tensor parallelism contribute the same tensors, already taken over every head.
    """
    mine = {int(view.module.layer_idx): tensor for tensor, view in zip(per_layer, views, strict=True)}
    _, total = compressed_layer_position(views[0].module)
    if len(mine) == total:
        return mine
    if not (dist.is_available() and dist.is_initialized()):
        raise CriticalKVError(f"{len(mine)} of the model's {total} compressed layers given, and no other process")
    device = per_layer[0].device
    parts: list[dict[int, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {layer: tensor.cpu() for layer, tensor in mine.items()})
    merged: dict[int, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    if len(merged) != total:
        raise CriticalKVError(f"the pipeline stages hold {len(merged)} of the model's {total} compressed layers")
    return {layer: merged[layer].to(device) for layer in sorted(merged)}
