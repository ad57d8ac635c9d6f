"""Output perturbation of KV-cache eviction, head by head (CriticalKV's analysis; docs/perturbation.md).

For one layer, query head ``h`` with output-projection slice ``W = W_O^h`` (d, hidden), and one query ``q`` that
follows the context::

    A   = softmax(q K^T * scaling)          over every context key and the causal following keys
    o   = sum_i A_i V_i                     (full cache)
    ô   = sum_{i in S} Â_i V_i              (S = kept context entries + the following keys; Â renormalised on S)
    L   = || (o - ô) W ||_1                 (the output perturbation)

and two upper bounds of ``L``, with ``u_i = V_i W``, ``a_i = A_i ||u_i||_1`` and the kept mass
``sigma = sum_{i in S} A_i``::

    paper  = sum_{i not in S} a_i + (1/sigma - 1) sum_{i in S} a_i  =  C - (2 - 1/sigma) sum_{i in S} a_i,
             C = sum_i a_i
    tight  = || sum_{i not in S} A_i u_i ||_1 + (1/sigma - 1) || sum_{i in S} A_i u_i ||_1

``L <= tight <= paper`` always (triangle inequality, docs/perturbation.md); ``sigma >= 1/2`` is the condition under
which the paper bound decreases as kept entries with large ``a_i`` are added (its coefficient ``2 - 1/sigma`` is
>= 0), which is what CriticalKV's two-stage selection exploits.

Everything is float32, vectorised over batch, heads and queries (one einsum per quantity, no loop over heads).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from criticalkv.analysis.capture import Capture, LayerCapture
from criticalkv.budget import Budget
from criticalkv.cache import CompressedLayer
from criticalkv.core.positions import forward_on_cache
from criticalkv.core.view import LayerView
from criticalkv.errors import UnsupportedModelError
from criticalkv.runtime.method import Method
from criticalkv.runtime.shared_prefill import SharedPrefill

__all__ = [
    "SUBSETS",
    "CompressedRun",
    "HeadPerturbation",
    "LayerAttention",
    "PromptResult",
    "budget_label",
    "compare",
    "compressed_hidden_states",
    "head_output_weights",
    "head_perturbation",
    "head_value_norms",
    "kept_mask",
    "measure_prompt",
    "summarise",
    "violation_slack",
]

# Which queries a figure averages over: "all" following tokens (question + generated), each kind alone, and, as a
# diagnostic, the last prompt tokens themselves ("window": the observation window SnapKV scores with, reading the
# context causally): the queries the selection was made for, not queries that come later.
SUBSETS = ("all", "question", "generated", "window")
_NORM_CHUNK = 4 * 1024 * 1024  # elements of the largest (b, h_kv, G, chunk, hidden) product built at once


def head_output_weights(o_proj_weight: torch.Tensor, h_q: int) -> torch.Tensor:
    """Each query head's slice of the output projection, float32: (hidden, h_q * d) -> (h_q, d, hidden).

    Head ``h``'s slice is ``o_proj.weight[:, h*d:(h+1)*d].T``: the d inputs of o_proj that carry head h's output.
    """
    hidden, inputs = o_proj_weight.shape
    if inputs % h_q:
        raise ValueError(f"o_proj takes {inputs} inputs, not a multiple of {h_q} query heads")
    return o_proj_weight.detach().float().t().reshape(h_q, inputs // h_q, hidden)


def head_value_norms(values: torch.Tensor, w_heads: torch.Tensor) -> torch.Tensor:
    """||V_i W_O^h||_1 for every query head h (not averaged over the GQA group), float32: (b, h_q, n).

    values (b, h_kv, n, d); w_heads (h_q, d, hidden) from ``head_output_weights``. Chunked along the tokens.
    """
    b, h_kv, n, d = values.shape
    h_q, _, hidden = w_heads.shape
    g = h_q // h_kv
    w = w_heads.view(h_kv, g, d, hidden)
    out = values.new_empty((b, h_kv, g, n), dtype=torch.float32)
    chunk = max(1, _NORM_CHUNK // max(1, b * h_q * hidden))
    for start in range(0, n, chunk):
        v = values[:, :, start : start + chunk].float()  # (b, h_kv, c, d)
        out[..., start : start + chunk] = torch.einsum("bkcd,kgdh->bkgch", v, w).abs().sum(-1)
    return out.reshape(b, h_q, n)


@dataclass
class HeadPerturbation:
    """Per (batch row, query head, following query) figures of one layer, float32: each (b, h_q, f)."""

    perturbation: torch.Tensor  # L = ||(o - ô) W_O^h||_1
    bound_paper: torch.Tensor  # sum_D a_i + (1/sigma - 1) sum_S a_i
    bound_tight: torch.Tensor  # ||sum_D A_i u_i||_1 + (1/sigma - 1) ||sum_S A_i u_i||_1
    kept_mass: torch.Tensor  # sigma = sum_{i in S} A_i
    total: torch.Tensor  # C = sum_i a_i over every entry (the paper's constant; the bound with nothing useful kept)
    # (b, f): the layer's attention output change ||sum_h (o_h - ô_h) W_O^h||_1 (after o_proj, heads summed: their
    # changes can cancel, so it is at most the sum of the heads' L)
    layer_perturbation: torch.Tensor | None = None
    compressed_output: torch.Tensor | None = None  # ô (b, h_q, f, d), when asked for


class LayerAttention:
    """Full-cache attention of the following queries of one layer; ``perturbation(keep)`` for any kept set.

    Parameters
    ----------
    query
        (b, h_q, f, d) queries of the tokens that follow the context.
    keys, values
        (b, h_kv, t, d) the context's keys and values (every entry, before eviction).
    w_heads
        (h_q, d, hidden) float32, ``head_output_weights(o_proj.weight, h_q)``.
    scaling
        The layer's softmax scale.
    follow_keys, follow_values
        (b, h_kv, f, d) the following tokens' own keys and values (never evicted; query j reads those <= j), or
        None when the queries read only the context.
    valid
        (b, t) bool, False on padding; None: all valid.
    query_positions
        (f,) long: the queries are context tokens at these positions and read the context causally (keys at
        positions <= their own); use it without following keys. None: every query reads the whole context.
    """

    def __init__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        w_heads: torch.Tensor,
        scaling: float,
        follow_keys: torch.Tensor | None = None,
        follow_values: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        query_positions: torch.Tensor | None = None,
    ) -> None:
        b, h_q, f, d = query.shape
        h_kv, t = keys.shape[1], keys.shape[2]
        g = h_q // h_kv
        self.shape = (b, h_q, h_kv, g, f, t, d)
        q = query.float().reshape(b, h_kv, g, f, d)
        keys_all, values_all = keys.float(), values.float()
        if follow_keys is not None and follow_keys.shape[2] > 0:
            if follow_keys.shape[2] != f:
                raise ValueError("follow_keys must hold one key per following query")
            keys_all = torch.cat([keys_all, follow_keys.float()], dim=2)
            values_all = torch.cat([values_all, follow_values.float()], dim=2)
            self.n_follow = f
        else:
            self.n_follow = 0
        valid = torch.ones(b, t, dtype=torch.bool, device=keys.device) if valid is None else valid.bool()
        self.valid = valid
        # allowed (b, 1, 1, f, n): every valid context key, and the following keys causally
        ctx = valid[:, None, None, None, :].expand(b, 1, 1, f, t)
        if query_positions is not None:
            causal_ctx = torch.arange(t, device=keys.device)[None, :] <= query_positions.to(keys.device)[:, None]
            ctx = ctx & causal_ctx[None, None, None]  # (b, 1, 1, f, t)
        if self.n_follow:
            causal = torch.ones(f, f, dtype=torch.bool, device=keys.device).tril()
            self.follow_allowed = causal[None, None, None].expand(b, 1, 1, f, f)
            self.allowed = torch.cat([ctx, self.follow_allowed], dim=-1)
        else:
            self.follow_allowed = None
            self.allowed = ctx
        self.logits = torch.einsum("bkgfd,bknd->bkgfn", q, keys_all) * scaling  # (b, h_kv, G, f, n)
        self.attention = torch.softmax(self.logits.masked_fill(~self.allowed, float("-inf")), dim=-1)
        self.values_all = values_all  # (b, h_kv, n, d)
        self.w = w_heads.reshape(h_kv, g, d, -1)  # (h_kv, G, d, hidden)
        self.output = torch.einsum("bkgfn,bknd->bkgfd", self.attention, values_all)  # o
        self.norms = head_value_norms(values_all, w_heads).view(b, h_kv, g, 1, -1)  # ||V_i W_O^h||_1
        self.weighted = self.attention * self.norms  # a_i = A_i ||u_i||_1: (b, h_kv, G, f, n)

    def _project_l1(self, x: torch.Tensor) -> torch.Tensor:
        """||x W_O^h||_1 for x (b, h_kv, G, f, d): (b, h_kv, G, f)."""
        return torch.einsum("bkgfd,kgdh->bkgfh", x, self.w).abs().sum(-1)

    def perturbation(self, keep: torch.Tensor, return_output: bool = False) -> HeadPerturbation:
        """Figures for a keep mask (b, h_kv, t) bool of the context (the following keys are always kept)."""
        b, h_q, h_kv, _, f, t, d = self.shape
        if keep.shape != (b, h_kv, t):
            raise ValueError(f"keep mask must be {(b, h_kv, t)}, got {tuple(keep.shape)}")
        kept_ctx = (keep.bool() & self.valid[:, None, :])[:, :, None, None, :].expand(b, h_kv, 1, f, t)
        kept = torch.cat([kept_ctx, self.follow_allowed.expand(b, h_kv, 1, f, f)], -1) if self.n_follow else kept_ctx
        kept = kept & self.allowed
        # ô: the runtime's attention over the kept entries (softmax renormalised on S); a row that keeps nothing
        # (possible only without following keys) has no output: 0.
        renorm = torch.softmax(self.logits.masked_fill(~kept, float("-inf")), dim=-1).nan_to_num(0.0)
        compressed = torch.einsum("bkgfn,bknd->bkgfd", renorm, self.values_all)
        loss = self._project_l1(self.output - compressed)
        layer = torch.einsum("bkgfd,kgdh->bfh", self.output - compressed, self.w).abs().sum(-1)  # (b, f)
        kept_attention = self.attention * kept
        sigma = kept_attention.sum(-1)  # (b, h_kv, G, f)
        # 1/sigma - 1 >= 0; sigma can round to just above 1 when everything is kept
        excess = (1.0 / sigma.clamp_min(torch.finfo(torch.float32).tiny) - 1.0).clamp_min(0.0)
        kept_part = torch.einsum("bkgfn,bknd->bkgfd", kept_attention, self.values_all)  # sum_S A_i V_i
        tight = self._project_l1(self.output - kept_part) + excess * self._project_l1(kept_part)
        kept_weighted = (self.weighted * kept).sum(-1)
        total = self.weighted.sum(-1)  # C = sum_i a_i
        paper = (total - kept_weighted).clamp_min(0.0) + excess * kept_weighted
        return HeadPerturbation(
            loss.reshape(b, h_q, f),
            paper.reshape(b, h_q, f),
            tight.reshape(b, h_q, f),
            sigma.reshape(b, h_q, f),
            total.reshape(b, h_q, f),
            layer,
            compressed.reshape(b, h_q, f, d) if return_output else None,
        )


def head_perturbation(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    o_proj_weight: torch.Tensor,
    scaling: float,
    follow_keys: torch.Tensor | None = None,
    follow_values: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> HeadPerturbation:
    """Per-head output perturbation and its bounds for one kept set; see ``LayerAttention`` for the shapes.

    ``o_proj_weight`` is the layer's (hidden, h_q * d) output projection.
    """
    w_heads = head_output_weights(o_proj_weight, query.shape[1])
    attention = LayerAttention(query, keys, values, w_heads, scaling, follow_keys, follow_values, valid)
    return attention.perturbation(keep)


def violation_slack(hp: HeadPerturbation) -> torch.Tensor:
    """Float32 rounding allowed when checking ``L <= bound``: the two are sums taken in different orders."""
    return 1e-4 * hp.perturbation + 1e-6 * hp.total


def kept_mask(method: Method | None, view: LayerView, budget: Budget) -> torch.Tensor:
    """The entries the runtime keeps for one layer: ``method.decide(view, budget)``, as (b, h_kv, t) bool.

    A layer kept whole (or ``method`` None, the full cache) keeps every valid entry.
    """
    h_kv = view.keys.shape[1]
    whole = view.valid[:, None, :].expand(-1, h_kv, -1).clone()
    if method is None or budget.keeps_everything:
        return whole
    decision = method.decide(view, budget)
    return whole if decision.keep is None else decision.keep.bool()


# --- the last layer's hidden state under the real runtime ---------------------------------------------------------


@dataclass
class CompressedRun:
    """The following tokens decoded over one compressed cache."""

    hidden: torch.Tensor  # (b, f, hidden) last entry of hidden_states
    same_kept_set: list[bool]  # per analysed layer: the runtime kept exactly the entries of ``kept_mask``
    kept_entries: int  # context entries held over the analysed layers
    full_entries: int


def _runtime_kept_set_equals(layer, keys: torch.Tensor, keep: torch.Tensor) -> bool:
    """Does a cache layer hold exactly the context entries ``keep`` (b, h_kv, t) selects (keys compared bitwise)?"""
    if not isinstance(layer, CompressedLayer):
        return bool(keep.all())
    if not layer.is_compressed:
        return bool(keep.all())
    if not torch.equal(layer.lengths.cpu(), keep.sum(-1).cpu()):
        return False
    b, h, t, d = keys.shape
    segment, position = keep.reshape(b * h, t).nonzero(as_tuple=True)
    return torch.equal(layer.context_keys, keys.reshape(b * h, t, d)[segment, position])


@torch.no_grad()
def compressed_hidden_states(
    model: PreTrainedModel,
    capture: Capture,
    targets: Sequence[tuple[str, Method | None, Budget]],
    keeps: dict[str, list[torch.Tensor]] | None = None,
    one_forward: bool = True,
) -> dict[str, CompressedRun]:
    """Prefill the captured context once, compressed into one cache per target (``SharedPrefill``), then feed the
    captured following tokens over each cache (teacher forcing) and return the last hidden states. The label
    ``"full"`` (added here) is the full cache run through the same code path: the reference.

    ``one_forward``: all following tokens in one forward (fast); False: in the capture's chunks (the question,
    then one forward per generated token, as a real decode). ``keeps`` (label -> per analysed layer keep mask) is
    compared with what the runtime really kept.
    """
    spec = [("full", "full", Budget(1.0))] + [(label, m if m is not None else "full", b) for label, m, b in targets]
    shared = SharedPrefill(model, spec)
    sessions = shared.prefill(capture.context_ids)
    analysed = capture.analysed
    sizes = [capture.follow_ids.shape[1]] if one_forward and capture.follow_ids.shape[1] else capture.chunks
    runs: dict[str, CompressedRun] = {}
    for label, session in sessions.items():
        cache, mask = session.cache, session.mask
        layers = [cache.layers[c.layer] for c in analysed]
        kept = sum(layer.entries() for layer in layers)  # before anything is appended: the context only
        full = sum(int(c.valid.sum()) * c.keys.shape[1] for c in analysed)
        same = []
        if keeps is not None and label in keeps:
            same = [
                _runtime_kept_set_equals(layer, c.keys, keep)
                for layer, c, keep in zip(layers, analysed, keeps[label], strict=True)
            ]
        hidden = []
        offset = 0
        with shared:
            for size in sizes:
                ids = capture.follow_ids[:, offset : offset + size]
                offset += size
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
                out = forward_on_cache(model, ids, mask, cache, output_hidden_states=True)
                hidden.append(out.hidden_states[-1])
        empty = capture.hidden.new_empty(capture.hidden.shape[0], 0, capture.hidden.shape[-1])
        runs[label] = CompressedRun(torch.cat(hidden, dim=1) if hidden else empty, same, kept, full)
        session.cache = None  # release this target's cache
    return runs


# --- one prompt, every (method, budget) ---------------------------------------------------------------------------


@dataclass
class PromptResult:
    """Every figure of one prompt. Arrays are numpy float64; ``heads[key][quantity][subset]`` is (layers, h_q)."""

    index: int
    info: dict
    layers: list[int]
    heads: dict[tuple[str, str], dict[str, dict[str, np.ndarray]]] = field(default_factory=dict)
    # ``layer_output[key][subset]`` (layers,): the attention block's output change, heads summed after o_proj
    layer_output: dict[tuple[str, str], dict[str, np.ndarray]] = field(default_factory=dict)
    scalars: dict[tuple[str, str], dict[str, object]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def _mean_over(x: torch.Tensor, select: torch.Tensor) -> np.ndarray:
    """Mean over the selected following queries of x (b=1, h_q, f): (h_q,), NaN when none is selected."""
    if not bool(select.any()):
        return np.full(x.shape[1], np.nan)
    return x[0][:, select.to(x.device)].mean(-1).double().cpu().numpy()


@torch.no_grad()
def measure_prompt(
    model: PreTrainedModel,
    capture: Capture,
    methods: dict[str, Method | None],
    budgets: Sequence[Budget],
    index: int = 0,
    info: dict | None = None,
    hidden: bool = True,
    advance: Callable[[str], None] | None = None,
    one_forward: bool = True,
    window: int = 32,
) -> PromptResult:
    """Output perturbation of every (method, budget) on one captured prompt (batch of one).

    ``advance(description)`` is called once per (method, budget) done (for a progress bar). ``hidden``: also decode
    the following tokens over each compressed cache (``compressed_hidden_states``, with ``one_forward``) and compare
    the last hidden state with the full cache's. ``window``: the last prompt tokens measured as the "window" subset
    (0: none).

    The per-layer figures run on one thread: they are small and memory-bound, and a second thread only adds
    synchronisation (ten times slower on a busy 2-core machine); the model forwards keep torch's setting.
    """
    if capture.context_ids.shape[0] != 1:
        raise ValueError("measure_prompt takes a capture of one prompt (batch size 1)")
    analysed = capture.analysed
    if not analysed:
        raise UnsupportedModelError("the model has no full-attention layer to analyse (every layer is sliding-window)")
    result = PromptResult(index, dict(info or {}), [c.layer for c in analysed])
    follow_subsets = {s: capture.label_mask(s) for s in SUBSETS if s != "window"}
    start = time.perf_counter()
    views = [c.view() for c in analysed]  # one view per layer: methods sharing a scorer share its scores
    with _threads(1):
        sources = [[(_layer_attention(c), follow_subsets)] for c in analysed]
        if window > 0:
            for per_layer, c in zip(sources, analysed, strict=True):
                attention = _window_attention(c, window)
                per_layer.append((attention, {"window": torch.ones(attention.shape[4], dtype=torch.bool)}))
    result.seconds["attention"] = time.perf_counter() - start
    keeps: dict[str, list[torch.Tensor]] = {}
    labels: dict[str, tuple[str, str]] = {}
    targets = []
    start = time.perf_counter()
    for name, method in methods.items():
        for budget in budgets:
            key = (name, budget_label(budget))
            layer_keeps = [kept_mask(method, view, budget) for view in views]
            figures = {q: {s: [] for s in SUBSETS} for q in ("perturbation", "bound_paper", "bound_tight", "kept_mass")}
            layer_output: dict[str, list[float]] = {s: [] for s in SUBSETS}
            violations = {"paper": 0, "tight": 0}
            below_half = 0
            checked = 0
            with _threads(1):
                for per_layer, keep in zip(sources, layer_keeps, strict=True):
                    for attention, subsets in per_layer:
                        hp = attention.perturbation(keep)
                        for q in figures:
                            values = getattr(hp, q)
                            for s, select in subsets.items():
                                figures[q][s].append(_mean_over(values, select))
                        for s, select in subsets.items():
                            layer_output[s].append(float(_mean_over(hp.layer_perturbation[:, None], select)[0]))
                        if "window" in subsets:  # the diagnostic window: its own figures only, not the counts
                            continue
                        slack = violation_slack(hp)
                        violations["paper"] += int((hp.perturbation > hp.bound_paper + slack).sum())
                        violations["tight"] += int((hp.perturbation > hp.bound_tight + slack).sum())
                        below_half += int((hp.kept_mass < 0.5).sum())
                        checked += hp.kept_mass.numel()
            h_q = analysed[0].query.shape[1]
            result.heads[key] = {
                q: {s: np.stack(v) if v else np.full((len(analysed), h_q), np.nan) for s, v in per.items()}
                for q, per in figures.items()
            }
            result.layer_output[key] = {
                s: np.array(v) if v else np.full(len(analysed), np.nan) for s, v in layer_output.items()
            }
            kept = sum(int(k.sum()) for k in layer_keeps)
            total = sum(int(c.valid.sum()) * c.keys.shape[1] for c in analysed)
            result.scalars[key] = {
                "bound_violations_paper": violations["paper"],
                "bound_violations_tight": violations["tight"],
                "kept_mass_below_half": below_half / max(checked, 1),
                "kept_fraction": kept / max(total, 1),
            }
            label = f"{name}@{budget_label(budget)}"
            keeps[label] = layer_keeps
            targets.append((label, method, budget))
            labels[label] = key
            if advance is not None and not hidden:
                advance(f"prompt {index}: {label}")
    result.seconds["perturbation"] = time.perf_counter() - start
    if hidden:
        start = time.perf_counter()
        runs = compressed_hidden_states(model, capture, targets, keeps, one_forward)
        reference = runs["full"].hidden.float()
        # the reference path against the captured decode: 0 when fed in the same chunks; otherwise the rounding noise
        # of feeding the tokens in one forward instead of one by one (the floor under every hidden-state figure)
        result.info["full_path_vs_capture_l1"] = float((reference - capture.hidden.float()).abs().sum(-1).mean())
        norm = reference.abs().sum(-1)  # (1, f)
        for label, _, _ in targets:
            run = runs[label]
            l1 = (run.hidden.float() - reference).abs().sum(-1)  # (1, f)
            scalars = result.scalars[labels[label]]
            for s, select in follow_subsets.items():
                any_ = bool(select.any())
                scalars[f"hidden_l1_{s}"] = float(l1[0, select].mean()) if any_ else math.nan
                scalars[f"hidden_l1_relative_{s}"] = float((l1 / norm)[0, select].mean()) if any_ else math.nan
            scalars["runtime_kept_same_set"] = sum(run.same_kept_set) / max(len(run.same_kept_set), 1)
            scalars["runtime_kept_fraction"] = run.kept_entries / max(run.full_entries, 1)
            if advance is not None:
                advance(f"prompt {index}: {label}")
        result.seconds["hidden"] = time.perf_counter() - start
    return result


def _layer_attention(c: LayerCapture) -> LayerAttention:
    w_heads = head_output_weights(c.module.o_proj.weight, c.query.shape[1])
    return LayerAttention(c.follow_query, c.keys, c.values, w_heads, c.scaling, c.follow_keys, c.follow_values, c.valid)


def _window_attention(c: LayerCapture, window: int) -> LayerAttention:
    """The last ``window`` prompt tokens as queries, reading the context causally."""
    t = c.keys.shape[2]
    w = min(window, t)
    w_heads = head_output_weights(c.module.o_proj.weight, c.query.shape[1])
    positions = torch.arange(t - w, t, device=c.keys.device)
    return LayerAttention(
        c.query[:, :, t - w :], c.keys, c.values, w_heads, c.scaling, valid=c.valid, query_positions=positions
    )


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(min(n, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def budget_label(budget: Budget) -> str:
    """``"0.2"`` for fractions, ``"512"`` for entry counts (JSON keys and file names)."""
    return f"{budget.value:g}" if budget.is_fraction else str(budget.value)


# --- summaries ---------------------------------------------------------------------------------------------------


def stack(results: Sequence[PromptResult], key: tuple[str, str], quantity: str, subset: str) -> np.ndarray:
    """(prompts, layers, h_q) array of one figure over every prompt."""
    return np.stack([r.heads[key][quantity][subset] for r in results])


def group_mean(x: np.ndarray, h_kv: int) -> np.ndarray:
    """Per-KV-head figure: the mean over the G query heads of each group, (..., h_q) -> (..., h_kv)."""
    return x.reshape(*x.shape[:-1], h_kv, x.shape[-1] // h_kv).mean(-1)


def nanmean(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Mean ignoring NaN (a subset with no query), NaN where everything is NaN, without warnings."""
    with np.errstate(invalid="ignore", divide="ignore"):
        count = np.sum(~np.isnan(x), axis=axis)
        total = np.nansum(x, axis=axis)
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, float | int]:
    """Head-by-head comparison of B with A (same shapes): how often B is lower, log10(B / A), and the ratio of the
    means (mean B / mean A: large perturbations weigh more than in the median of the log ratio).

    Entries where either is NaN are left out; the log ratio is taken where both are > 0.
    """
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    ok = ~(np.isnan(a) | np.isnan(b))
    a, b = a[ok], b[ok]
    pos = (a > 0) & (b > 0)
    ratio = np.log10(b[pos] / a[pos])
    n = int(ok.sum())
    return {
        "n": n,
        "fraction_b_lower": float(np.mean(b < a)) if n else math.nan,
        "fraction_equal": float(np.mean(b == a)) if n else math.nan,
        "n_ratio": int(pos.sum()),
        "median_log10_ratio": float(np.median(ratio)) if ratio.size else math.nan,
        "mean_log10_ratio": float(np.mean(ratio)) if ratio.size else math.nan,
        "ratio_of_means": float(b.mean() / a.mean()) if n and a.mean() > 0 else math.nan,
    }


def log10_ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """log10(B / A) where both are > 0 and finite, NaN elsewhere."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.log10(b / a)
    out[~((a > 0) & (b > 0))] = np.nan
    return out


def _compare_hidden(results, a_key, b_key, subset) -> dict | None:
    """Per-prompt comparison of the last hidden-state perturbation (None when it was not measured)."""
    name = f"hidden_l1_{subset}"
    if name not in results[0].scalars[a_key]:
        return None
    a = np.array([r.scalars[a_key][name] for r in results], dtype=np.float64)
    b = np.array([r.scalars[b_key][name] for r in results], dtype=np.float64)
    return {"mean_a": float(nanmean(a)), "mean_b": float(nanmean(b)), **compare(a, b)}


def _layer_output_means(results, key, subset) -> np.ndarray | None:
    """The attention output change per layer, its mean over the prompts: (layers,); None for results without it."""
    if not all(key in r.layer_output for r in results):
        return None
    return nanmean(np.stack([r.layer_output[key][subset] for r in results]), 0)


def _compare_layer_output(results, a_key, b_key, subset) -> dict | None:
    """Layer-by-layer comparison of the attention output change (prompt means); None for results without it."""
    a, b = _layer_output_means(results, a_key, subset), _layer_output_means(results, b_key, subset)
    return None if a is None or b is None else compare(a, b)


def summarise(
    results: Sequence[PromptResult],
    methods: Sequence[str],
    budgets: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    h_kv: int,
) -> dict:
    """Every summary figure of docs/perturbation.md from the per-prompt results (budgets as labels)."""
    present = [
        s for s in SUBSETS if any(not np.isnan(h["perturbation"][s]).all() for r in results for h in r.heads.values())
    ]
    subsets = present
    summary: dict = {"pairs": [], "per_layer": {}, "hidden": {}, "bounds": {}, "subsets": subsets}
    for a_name, b_name in pairs:
        for budget in budgets:
            for subset in subsets:
                a = stack(results, (a_name, budget), "perturbation", subset)
                b = stack(results, (b_name, budget), "perturbation", subset)
                summary["pairs"].append(
                    {
                        "a": a_name,
                        "b": b_name,
                        "budget": budget,
                        "subset": subset,
                        "heads": compare(nanmean(a, 0), nanmean(b, 0)),  # (layer, head), prompt means
                        "heads_per_prompt": compare(a, b),  # (prompt, layer, head)
                        "kv_heads": compare(nanmean(group_mean(a, h_kv), 0), nanmean(group_mean(b, h_kv), 0)),
                        "layers": compare(nanmean(nanmean(a, 0), 1), nanmean(nanmean(b, 0), 1)),  # layer means
                        "layer_output": _compare_layer_output(results, (a_name, budget), (b_name, budget), subset),
                        "hidden_state": _compare_hidden(results, (a_name, budget), (b_name, budget), subset),
                    }
                )
    for name in methods:
        summary["per_layer"][name], summary["hidden"][name], summary["bounds"][name] = {}, {}, {}
        for budget in budgets:
            key = (name, budget)
            summary["per_layer"][name][budget] = {
                s: nanmean(nanmean(stack(results, key, "perturbation", s), 0), 1).tolist() for s in subsets
            }
            if all(key in r.layer_output for r in results):
                summary.setdefault("per_layer_output", {}).setdefault(name, {})[budget] = {
                    s: _layer_output_means(results, key, s).tolist() for s in subsets
                }
            scalars = [r.scalars[key] for r in results]
            summary["hidden"][name][budget] = {
                k: float(nanmean(np.array([s[k] for s in scalars], dtype=np.float64)))
                for k in scalars[0]
                if k.startswith("hidden_l1")
            }
            loss = stack(results, key, "perturbation", "all")
            paper = stack(results, key, "bound_paper", "all")
            tight = stack(results, key, "bound_tight", "all")
            ok = loss > 0
            summary["bounds"][name][budget] = {
                "mean_perturbation": float(nanmean(loss)),
                "mean_bound_paper": float(nanmean(paper)),
                "mean_bound_tight": float(nanmean(tight)),
                "median_bound_paper_over_perturbation": float(np.median(paper[ok] / loss[ok])) if ok.any() else None,
                "median_bound_tight_over_perturbation": float(np.median(tight[ok] / loss[ok])) if ok.any() else None,
                "mean_kept_mass": float(nanmean(stack(results, key, "kept_mass", "all"))),
                "bound_violations_paper": int(sum(s["bound_violations_paper"] for s in scalars)),
                "bound_violations_tight": int(sum(s["bound_violations_tight"] for s in scalars)),
                "kept_mass_below_half": float(np.mean([s["kept_mass_below_half"] for s in scalars])),
                "kept_fraction": float(np.mean([s["kept_fraction"] for s in scalars])),
                "runtime_kept_same_set": (
                    float(min(s["runtime_kept_same_set"] for s in scalars))
                    if "runtime_kept_same_set" in scalars[0]
                    else None
                ),
            }
    return summary
