"""Output-perturbation analysis (CriticalKV's section on why value norms matter): how far each method's kept set
moves every head's attention output, its upper bounds, and the brute-force optimum on tiny heads.

See docs/perturbation.md. ``criticalkv.analysis.command.perturbation`` is the command-line entry.
"""

from criticalkv.analysis.capture import Capture, LayerCapture, capture
from criticalkv.analysis.exhaustive import exhaustive_check, optimal_subset, selector_ratios
from criticalkv.analysis.perturbation import (
    HeadPerturbation,
    LayerAttention,
    PromptResult,
    head_perturbation,
    kept_mask,
    measure_prompt,
    summarise,
)

__all__ = [
    "Capture",
    "HeadPerturbation",
    "LayerAttention",
    "LayerCapture",
    "PromptResult",
    "capture",
    "exhaustive_check",
    "head_perturbation",
    "kept_mask",
    "measure_prompt",
    "optimal_subset",
    "selector_ratios",
    "summarise",
]
