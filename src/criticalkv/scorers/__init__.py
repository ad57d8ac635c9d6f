"""Scorers: how important is each cached entry? Each returns scores (b, h_kv, t) and protected positions."""

from criticalkv.scorers.base import LayerView, Scorer
from criticalkv.scorers.defensive import DefensiveScorer
from criticalkv.scorers.knorm import KeyNormScorer
from criticalkv.scorers.reconstruct import ReconstructionScorer
from criticalkv.scorers.snapkv import SnapKVScorer
from criticalkv.scorers.streaming import StreamingScorer
from criticalkv.scorers.surrogate import SurrogateScorer
from criticalkv.scorers.tova import TOVAScorer

__all__ = [
    "DefensiveScorer",
    "KeyNormScorer",
    "LayerView",
    "ReconstructionScorer",
    "Scorer",
    "SnapKVScorer",
    "StreamingScorer",
    "SurrogateScorer",
    "TOVAScorer",
]
