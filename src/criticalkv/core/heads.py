"""Which KV heads of a layer this process holds under tensor parallelism, and the one collective over them.

transformers' tensor parallelism shards ``q_proj``/``k_proj``/``v_proj`` by columns and ``o_proj`` by rows, so
rank ``r`` of a ``p``-rank group computes the contiguous block of KV heads ``r * h/p .. (r+1) * h/p`` (and their
query heads), caches only those, and owns the matching input columns of ``o_proj``. A method that reads one head
at a time needs nothing more; a method that compares heads gathers what it compares with ``HeadShard.gather``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from criticalkv.errors import UnsupportedModelError
from criticalkv.models.families import text_config

if TYPE_CHECKING:
    from criticalkv.core.view import LayerView

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # a torch build without torch.distributed: nothing can be sharded
    DTensor = Replicate = Shard = None


def is_dtensor(tensor: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (a parameter sharded or replicated over ranks)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def kv_heads(module: nn.Module) -> int:
    """The number of KV heads of an attention module's layer in the whole model (every rank together)."""
    config = text_config(module.config)
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


@dataclass(frozen=True)
class HeadShard:
    """This rank's contiguous block of a layer's KV heads under tensor parallelism.

    Parameters
    ----------
    group
        The tensor-parallel process group (the ranks that split this layer's heads).
    rank
        This process's position in ``group``: it holds block ``rank``.
    size
        Number of ranks in ``group``.
    local_heads
        KV heads per rank.
    """

    group: object  # torch.distributed.ProcessGroup
    rank: int
    size: int
    local_heads: int

    @property
    def total_heads(self) -> int:
        return self.local_heads * self.size

    @property
    def start(self) -> int:
        """Index of this rank's first KV head in the model's layer."""
        return self.rank * self.local_heads

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's (b, local_heads, ...) tensor as one (b, total_heads, ...), heads in the model's order.

        One ``all_gather`` over the group; every rank returns the same tensor.
        """
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a (b, total_heads, ...) tensor: (b, local_heads, ...)."""
        return x[:, self.start : self.start + self.local_heads]


def head_shard(view: LayerView) -> HeadShard | None:
    """The block of KV heads this process holds of the view's layer; None when it holds all of them.

    Raises
    ------
    UnsupportedModelError
        The ranks hold unequal blocks of the layer's heads (``criticalkv.distributed.check_model`` refuses such
        a model before its first forward).
    """
    module = view.module
    weight = getattr(getattr(module, "k_proj", None), "weight", None)
    if not is_dtensor(weight):  # one process, pipeline stages only, or a plan that leaves k_proj whole
        return None
    total = kv_heads(module)
    local = view.keys.shape[1]
    if local == total:  # attention replicated on every rank (e.g. Phi-3's plan)
        return None
    if weight.device_mesh.ndim != 1 or local * weight.device_mesh.size() != total:
        raise UnsupportedModelError(
            f"layer {getattr(module, 'layer_idx', '?')} holds {local} of its {total} KV heads over "
            f"{weight.device_mesh.size()} ranks: criticalkv needs each rank to hold an equal block of whole KV heads"
        )
    mesh = weight.device_mesh
    return HeadShard(mesh.get_group(), mesh.get_local_rank(), mesh.size(), local)


def every_head(view: LayerView, local: torch.Tensor) -> torch.Tensor:
    """A per-head tensor (b, h_local, ...) of the view's layer over every KV head of the layer: (b, h_kv, ...).

    ``local`` itself on one process. Under tensor parallelism, gathered from every rank (one ``all_gather``),
    unless the piece that computed ``local`` already had the whole tensor and left it with ``share_every_head``.
    """
    shard = head_shard(view)
    if shard is None:
        return local
    known = view.memo.get(("every head", id(local)))
    if known is not None and known[0] is local:
        return known[1]
    whole = shard.gather(local)
    share_every_head(view, local, whole)
    return whole


def share_every_head(view: LayerView, local: torch.Tensor, whole: torch.Tensor) -> None:
    """Record that ``whole`` (b, h_kv, ...) is ``local`` (b, h_local, ...) over every head, for ``every_head``."""
    view.memo[("every head", id(local))] = (local, whole)


def output_projection(weight: torch.Tensor, width: int) -> torch.Tensor:
    """The input columns of ``o_proj`` that a layer's query heads on this process feed: (hidden, width).

    On one process that is the whole weight. Under tensor parallelism ``o_proj`` is row-parallel, so a rank's
    own shard is exactly the columns of its own query heads (the value norm stays rank-local). A model whose
    plan replicates attention on every rank (Phi-3: its fused ``qkv_proj`` output is gathered) holds every head
    but only a slice of ``o_proj``: the whole weight is gathered then (one collective per layer).

    Parameters
    ----------
    weight
        ``o_proj.weight``, (hidden, h_q * d), a plain tensor or a ``DTensor``.
    width
        ``h_q * d`` of the query heads this process computes.
    """
    if not is_dtensor(weight):
        return weight
    placement = weight.placements[0] if len(weight.placements) == 1 else None
    local = weight.to_local()
    by_columns = isinstance(placement, Shard) and placement.dim in (1, -1)
    if (by_columns or isinstance(placement, Replicate)) and local.shape[1] == width:
        return local
    if weight.shape[1] == width:
        return weight.full_tensor()
    raise UnsupportedModelError(
        f"o_proj is sharded as {weight.placements} with {local.shape[1]} of {weight.shape[1]} input columns on this "
        f"rank, which matches neither this rank's {width} query-head columns nor the whole layer"
    )
