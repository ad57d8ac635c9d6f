"""Tensor- and pipeline-parallel runs: every method decides under transformers' own parallelism as on one
process. See docs/distributed.md.

Under tensor parallelism each rank holds a block of KV heads (``heads``); pieces that compare heads gather what
they compare, once per layer. Under pipeline parallelism each stage compresses the layers it runs.
"""

from criticalkv.allocators.balance import cap_rank_imbalance
from criticalkv.core.heads import HeadShard, every_head, head_shard, output_projection
from criticalkv.core.layout import (
    ParallelLayout,
    UnevenHeadsError,
    check_even_heads,
    check_model,
    check_parallel_split,
)

__all__ = [
    "HeadShard",
    "ParallelLayout",
    "UnevenHeadsError",
    "cap_rank_imbalance",
    "check_even_heads",
    "check_model",
    "check_parallel_split",
    "every_head",
    "head_shard",
    "output_projection",
]
