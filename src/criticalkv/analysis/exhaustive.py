"""The optimal kept set by brute force, for tiny sizes: how far are the selectors from the best possible choice?

For one head with ``n <= 16`` entries, a budget ``b`` and given queries, every one of the C(n, b) subsets is
evaluated (vectorised, in chunks) on the true perturbation ``mean_q ||(o - ô_S) W_O||_1``; the minimum is the
optimum. ``selector_ratios`` compares the selectors criticalkv ships (top-k by attention, CriticalKV's two-stage
selection) with it, both fed the attention of the very queries the perturbation is measured on.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from torch import nn

from criticalkv.core.view import LayerView
from criticalkv.selectors import CriticalSelector, TopKSelector
from criticalkv.selectors.measured import WindowPerturbation

__all__ = [
    "exhaustive_check",
    "optimal_subset",
    "random_head",
    "selector_masks",
    "selector_ratios",
    "subset_perturbations",
]

MAX_ENTRIES = 16


def subset_perturbations(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, w: torch.Tensor, scaling: float, masks: torch.Tensor
) -> torch.Tensor:
    """Mean over the queries of ||(o - ô_S) W||_1 for each kept set S, float32.

    query (m, d); keys, values (n, d); w (d, hidden), the head's slice of o_proj; masks (c, n) bool, one kept set
    per row (each non-empty). Returns (c,).
    """
    logits = (query.float() @ keys.float().T) * scaling  # (m, n)
    projected = values.float() @ w.float()  # (n, hidden): u_i = V_i W
    full = torch.softmax(logits, dim=-1)  # (m, n)
    kept = torch.softmax(logits[None].masked_fill(~masks[:, None, :], float("-inf")), dim=-1)  # (c, m, n)
    diff = (full[None] - kept) @ projected  # (c, m, hidden): o W - ô W
    return diff.abs().sum(-1).mean(-1)


def optimal_subset(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w: torch.Tensor,
    budget: int,
    scaling: float,
    chunk: int = 8192,
) -> tuple[torch.Tensor, float]:
    """The kept set of ``budget`` entries with the least perturbation, by brute force over all C(n, budget).

    Returns the mask (n,) bool and its perturbation. Refuses n > 16 (C(16, 8) = 12870 subsets is the largest).
    """
    n = keys.shape[0]
    if n > MAX_ENTRIES:
        raise ValueError(f"brute force is for n <= {MAX_ENTRIES} entries, got {n}")
    if not 1 <= budget <= n:
        raise ValueError(f"budget must be in [1, {n}], got {budget}")
    best_value, best_mask = math.inf, None
    combos = itertools.combinations(range(n), budget)
    while True:
        block = list(itertools.islice(combos, chunk))
        if not block:
            break
        index = torch.tensor(block, dtype=torch.long)  # (c, budget)
        masks = torch.zeros(len(block), n, dtype=torch.bool).scatter_(1, index, True)
        values_ = subset_perturbations(query, keys, values, w, scaling, masks)
        i = int(values_.argmin())
        if float(values_[i]) < best_value:
            best_value, best_mask = float(values_[i]), masks[i]
    return best_mask, best_value


class _OneHead(nn.Module):
    """The smallest attention module a selector accepts: an o_proj holding the head's W_O slice."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        d, hidden = w.shape
        self.o_proj = nn.Linear(d, hidden, bias=False)
        with torch.no_grad():
            self.o_proj.weight.copy_(w.T)
        self.layer_idx = 0


def selector_masks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w: torch.Tensor,
    budget: int,
    scaling: float,
    alpha: float = 0.5,
    eps: float = 1e-4,
) -> dict[str, torch.Tensor]:
    """Kept sets (n,) bool of criticalkv's selectors, scored by the mean attention of the given queries.

    ``"topk"``: the ``budget`` entries of highest attention. ``"critical"``: ``CriticalSelector`` (stage 1 by
    attention, stage 2 by (A + eps) * ||V W||_1), the class the runtime uses. ``"measured"``: the swap search of
    ``PerturbationSelector`` (``WindowPerturbation.improve``) on the perturbation of these queries, from the top-k
    set, every entry a candidate.
    """
    n = keys.shape[0]
    scores = torch.softmax((query.float() @ keys.float().T) * scaling, dim=-1).mean(0)[None, None]  # (1, 1, n)
    view = LayerView(
        _OneHead(w.float()),
        query[None, None],
        keys[None, None],
        values[None, None],
        torch.ones(1, n, dtype=torch.bool),
        scaling,
    )
    budgets = torch.tensor([[budget]])
    protected = torch.zeros(1, n, dtype=torch.bool)
    topk = TopKSelector().select(scores.clone(), budgets, protected, view)
    attention = torch.softmax((query.float() @ keys.float().T) * scaling, dim=-1)  # (m, n)
    objective = WindowPerturbation(attention[None, None, None], values[None, None], w[None, None])
    everything = torch.ones(1, 1, n, dtype=torch.bool)
    return {
        "topk": topk[0, 0],
        "critical": CriticalSelector(alpha=alpha, eps=eps).select(scores.clone(), budgets, protected, view)[0, 0],
        "measured": objective.improve(topk, everything, pool=n, rounds=2 * n, candidates=n, max_weight=1.0)[0, 0],
    }


def selector_ratios(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w: torch.Tensor,
    budget: int,
    scaling: float,
    alpha: float = 0.5,
) -> dict[str, float]:
    """Each selector's perturbation divided by the optimum (>= 1; 1 = optimal). Also ``"optimum"``: its value."""
    _, best = optimal_subset(query, keys, values, w, budget, scaling)
    masks = selector_masks(query, keys, values, w, budget, scaling, alpha)
    values_ = subset_perturbations(query, keys, values, w, scaling, torch.stack(list(masks.values())))
    ratios = {name: float(v) / best if best > 0 else 1.0 for name, v in zip(masks, values_.tolist(), strict=True)}
    ratios["optimum"] = best
    return ratios


def random_head(
    generator: torch.Generator,
    entries: int = 12,
    queries: int = 4,
    head_dim: int = 16,
    hidden: int = 32,
    sharpness: float = 2.0,
    value_spread: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Random (query, keys, values, w, scaling) of one head.

    Queries and keys are standard normal and the logits have standard deviation ``sharpness`` (peaked attention,
    as in trained models); each value row is standard normal times ``exp(N(0, value_spread))`` (entries whose
    value norms differ, which is what CriticalKV exploits); ``w`` is normal with variance 1/head_dim.
    """
    q = torch.randn(queries, head_dim, generator=generator)
    k = torch.randn(entries, head_dim, generator=generator)
    scale = torch.exp(torch.randn(entries, 1, generator=generator) * value_spread)
    v = torch.randn(entries, head_dim, generator=generator) * scale
    w = torch.randn(head_dim, hidden, generator=generator) / math.sqrt(head_dim)
    return q, k, v, w, sharpness / math.sqrt(head_dim)


def exhaustive_check(
    trials: int = 100,
    entries: int = 12,
    budget: int = 4,
    queries: int = 4,
    head_dim: int = 16,
    hidden: int = 32,
    sharpness: float = 2.0,
    value_spread: float = 1.0,
    alpha: float = 0.5,
    seed: int = 0,
) -> dict:
    """Ratio of each selector's perturbation to the brute-force optimum over ``trials`` random heads.

    Returns the settings, per selector the mean, median and 90th percentile of the ratio and the fraction of trials
    where it found the optimum, the fraction of trials where CriticalKV's set is better than top-k's (and equal),
    and the per-trial ratios.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(trials):
        q, k, v, w, scaling = random_head(generator, entries, queries, head_dim, hidden, sharpness, value_spread)
        rows.append(selector_ratios(q, k, v, w, budget, scaling, alpha))
    summary: dict = {
        "settings": {
            "trials": trials,
            "entries": entries,
            "budget": budget,
            "queries": queries,
            "head_dim": head_dim,
            "hidden": hidden,
            "sharpness": sharpness,
            "value_spread": value_spread,
            "alpha": alpha,
            "seed": seed,
        },
        "selectors": {},
    }
    for name in ("topk", "critical", "measured"):
        r = np.array([row[name] for row in rows])
        summary["selectors"][name] = {
            "mean_ratio": float(r.mean()),
            "median_ratio": float(np.median(r)),
            "p90_ratio": float(np.quantile(r, 0.9)),
            "fraction_optimal": float(np.mean(r <= 1 + 1e-6)),
        }
    topk, critical = np.array([row["topk"] for row in rows]), np.array([row["critical"] for row in rows])
    summary["fraction_critical_better"] = float(np.mean(critical < topk * (1 - 1e-6)))
    summary["fraction_equal"] = float(np.mean(np.abs(critical - topk) <= 1e-6 * topk))
    summary["ratios"] = [{k: round(v, 6) for k, v in row.items()} for row in rows]
    return summary
