"""Selectors: which entries fill each head's budget? Each returns a keep mask (b, h_kv, t)."""

from criticalkv.selectors.base import Selector
from criticalkv.selectors.critical import CriticalSelector
from criticalkv.selectors.defensive import DefensiveSelector
from criticalkv.selectors.measured import PerturbationSelector
from criticalkv.selectors.topk import TopKSelector
from criticalkv.selectors.value_norm import projected_value_norm

__all__ = [
    "CriticalSelector",
    "DefensiveSelector",
    "PerturbationSelector",
    "Selector",
    "TopKSelector",
    "projected_value_norm",
]
