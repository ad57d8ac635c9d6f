"""A method = scorer + allocator + selector (design.md). Presets are named combinations."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from criticalkv.allocators import Allocator, UniformAllocator
from criticalkv.budget import Budget
from criticalkv.core.heads import head_shard
from criticalkv.core.view import LayerView, padding_or_protected
from criticalkv.errors import CriticalKVError, MethodOptionError, NegativeScoreError
from criticalkv.models.families import compressed_layer_position
from criticalkv.scorers import Scorer
from criticalkv.scorers.base import declares_non_negative
from criticalkv.selectors import Selector, TopKSelector

_ROLES = ("scorer", "allocator", "selector")


@dataclass
class Decision:
    """What a method decided for one layer."""

    keep: torch.Tensor | None  # (b, h_kv, t) bool, or None when every row is kept whole
    budgets: torch.Tensor  # (b, h_kv) long: entries kept per head
    kept_whole: torch.Tensor  # (b,) bool: rows too short to compress (shorter than the budget or the window)
    # Earlier layers of the same prefill to shrink (a streaming allocator): layer index -> (N,) bool mask over that
    # layer's kept entries in storage order (``CompressedLayer.shrink``).
    shrink: dict[int, torch.Tensor] = field(default_factory=dict)
    # Entries every head keeps, when the host knows it without reading the device (every head keeps its row's
    # budget and the rows' budgets are equal): the cache then gathers them without a read. None otherwise.
    width: int | None = None


@dataclass
class _LayerPlan:
    """The facts a decision starts from: they depend on the padding mask, the budget and the scorer, not on the
    layer, so one plan serves every layer of a forward (read-only)."""

    row_budgets: torch.Tensor  # (b,) long
    protected: torch.Tensor  # (b, t) bool
    kept_whole: torch.Tensor  # (b,) bool
    whole_rows: int  # rows kept whole, read once (a host read)
    width: int | None  # the rows' common budget when they are all equal (read with whole_rows), else None

    @property
    def all_whole(self) -> bool:
        """Every row kept whole: nothing to decide."""
        return self.whole_rows == len(self.kept_whole)

    @property
    def any_whole(self) -> bool:
        """Some row kept whole: its mask and budgets are replaced after selection."""
        return self.whole_rows > 0


@dataclass
class Method:
    """An eviction method as three independent choices.

    Most methods decide each layer right after its prefill (``decide``). A *deferred* method decides every
    layer at once after the whole prefill (``decide_layers``): one whose allocator compares layers
    (``allocator.cross_layer``) or whose scorer needs passes over the finished cache
    (``scorer.after_prefill``). The runtime keeps a deferred method's layers dense until then.

    Examples
    --------
    >>> Method(SnapKVScorer(window=64), UniformAllocator(), CriticalSelector(window=64, alpha=0.25))  # doctest: +SKIP
    """

    scorer: Scorer
    allocator: Allocator = field(default_factory=UniformAllocator)
    selector: Selector = field(default_factory=TopKSelector)
    name: str = "custom"
    defer: bool = False  # force the deferred path (it must then decide exactly what ``decide`` does)

    @property
    def deferred(self) -> bool:
        """True when decisions wait for the end of the prefill (see the class notes)."""
        return self.defer or self.allocator.cross_layer or self.scorer.after_prefill

    @property
    def per_layer(self) -> bool:
        """True when ``decide`` takes one layer's view alone: not deferred, no state carried from layer to layer."""
        return not (self.deferred or self.allocator.streaming)

    @property
    def pieces(self) -> tuple[Scorer, Allocator, Selector]:
        """The scorer, the allocator and the selector."""
        return self.scorer, self.allocator, self.selector

    def __post_init__(self) -> None:
        for role, piece, contract in zip(_ROLES, self.pieces, (Scorer, Allocator, Selector), strict=True):
            if not isinstance(piece, contract):  # a class of the user's own that does not derive from the contract
                raise MethodOptionError(
                    f"{type(piece).__name__} is given as the {role} but lacks members of criticalkv's "
                    f"{contract.__name__}: derive it from {contract.__module__.rsplit('.', 1)[0]}.{contract.__name__}, "
                    "which gives every optional member its default (docs/extending.md)"
                )
        windows = {role: int(piece.window) for role, piece in zip(_ROLES, self.pieces) if piece.window is not None}
        if len(set(windows.values())) > 1:
            stated = ", ".join(f"the {role}'s {w}" for role, w in windows.items())
            raise MethodOptionError(
                f"one method observes one window, but its pieces state {stated}: give them the same window "
                "(build_method(name, window=w) sets it on every piece that has one)"
            )

    @property
    def window(self) -> int | None:
        """The observation window: the last queries of a prefill that the scorer and selector read, one number
        for the method (its pieces that read a window must state the same, see ``__post_init__``); None when no
        piece reads one."""
        return next((int(p.window) for p in self.pieces if p.window is not None), None)

    @property
    def query_rows(self) -> int:
        """Last query rows of a prefill that scoring and selection read (a deferred layer keeps only these)."""
        return self.window or 1

    def decide(self, view: LayerView, budget: Budget, state: dict | None = None) -> Decision:
        """Decide one layer from its prefill view.

        ``state`` is a scratch dict the runtime keeps per prefill (and per cache) for an allocator that carries
        state from layer to layer (``allocator.streaming``); such an allocator may also order earlier layers of
        the prefill to shrink (``Decision.shrink``).
        """
        return self.decide_layers([view], budget, state=state)[0]

    def scores_of(self, view: LayerView) -> torch.Tensor:
        """The scorer's scores of a layer, computed once per view: (b, h_kv, t) float32."""
        return view.remember(("scores", repr(self.scorer)), lambda: self.scorer.score(view))

    def decide_layers(
        self,
        views: list[LayerView],
        budget: Budget,
        scores: list[torch.Tensor] | None = None,
        state: dict | None = None,
    ) -> list[Decision]:
        """Decide several layers of one prefill together.

        ``scores`` (one (b, h_kv, t) tensor per view) replaces the scorer's, for scorers that compute them from
        passes after the prefill (their sign is then checked where the selector needs it, whatever the scorer
        declares: one host read for the layers given). A cross-layer allocator splits the budget over every layer
        given; other allocators split each layer's budget over its heads, exactly as ``decide`` does layer by
        layer. The selector's ``rank`` re-scores each layer first (DefensiveKV; the default keeps the scores):
        allocation and selection follow its ranking. A streaming allocator given every layer of a prefill (a deferred
        method) decides them in order, its shrink orders applied to the earlier layers' decisions.
        """
        streaming = self.allocator.streaming
        if streaming and state is None and len(views) == compressed_layer_position(views[0].module)[1]:
            return self._stream(views, budget, scores)  # every layer of a prefill at once: a deferred method
        if streaming and (state is None or len(views) != 1):
            raise CriticalKVError(
                f"{type(self.allocator).__name__} decides one layer at a time with the runtime's per-prefill state "
                "(or every layer of a prefill at once); use it through criticalkv.compress, a ContextSession or a "
                "SharedPrefill"
            )
        plans = [self._plan(view, budget) for view in views]
        if plans[0].all_whole:  # lengths, budget and protected positions are shared by every layer
            return [self._whole(view, plan) for view, plan in zip(views, plans, strict=True)]
        given = scores is not None
        if scores is None:
            scores = [self.scores_of(view) for view in views]
        scores = [s.clone() for s in scores]  # shared with other methods deciding on these views
        for s, view in zip(scores, views, strict=True):
            if s.shape != view.keys.shape[:3]:  # a scorer of the user's own: say so before torch fails deep inside
                raise CriticalKVError(
                    f"{type(self.scorer).__name__} gave scores of shape {tuple(s.shape)}; a layer's scores are "
                    f"(b, h_kv, t) = {tuple(view.keys.shape[:3])}"
                )
            if not s.is_floating_point():  # torch.finfo, the selectors' "never pick" value, has no integer type
                raise CriticalKVError(
                    f"{type(self.scorer).__name__} gave {s.dtype} scores; scores must be floating point (.float())"
                )
        self._check_values(scores, plans, views, given)
        scores = [
            self.selector.rank(s, p.row_budgets, p.protected, v) for s, p, v in zip(scores, plans, views, strict=True)
        ]
        if streaming:
            plan, view, layer_scores = plans[0], views[0], scores[0]
            budgets = self.allocator.allocate(layer_scores, plan.row_budgets, view, plan.protected, state)
            decision = self._select(view, plan, layer_scores, budgets)
            decision.shrink = self.allocator.settle(layer_scores, decision.keep, view, plan.protected, state)
            return [decision]
        if self.allocator.cross_layer:
            budgets = self.allocator.allocate_layers(
                scores, [p.row_budgets for p in plans], views, [p.protected for p in plans]
            )
        else:
            budgets = [
                self.allocator.allocate(s, p.row_budgets, v, p.protected)
                for s, p, v in zip(scores, plans, views, strict=True)
            ]
        return [self._select(view, plan, s, b) for view, plan, s, b in zip(views, plans, scores, budgets, strict=True)]

    def _check_values(
        self, scores: list[torch.Tensor], plans: list[_LayerPlan], views: list[LayerView], given: bool
    ) -> None:
        """Check the scores where the selector may pick, in one host read for the layers given (on a GPU a wait):

        - their sign, for a selector that multiplies scores by value norms (``needs_non_negative_scores``), unless they
          are the scorer's own (not ``given`` to ``decide_layers``) and it is non-negative by construction
          (``declares_non_negative``);
        - that they are finite, for a scorer of the user's own (its ``score`` defined outside criticalkv): top-k ranks
          NaN above every number and -inf below, so either decided silently.

        criticalkv's own scorers, declared non-negative, spare every layer the read."""
        signs = self.selector.needs_non_negative_scores and (given or not declares_non_negative(self.scorer))
        finite = not _own_method(self.scorer, "score")
        if not (signs or finite):
            return
        flags = []
        for s, p, v in zip(scores, plans, views, strict=True):
            picked = s.masked_fill(padding_or_protected(v, p.protected), 0.0)  # (b, h_kv, t)
            negative = ~(picked >= 0).all() if signs else torch.zeros((), dtype=torch.bool, device=s.device)  # NaN too
            bad = ~torch.isfinite(picked.masked_fill(p.kept_whole[:, None, None], 0.0)).all()  # rows kept whole: any
            pair = torch.stack([negative, bad if finite else torch.zeros_like(bad)])  # (2,)
            shard = head_shard(v)
            if shard is not None:  # tensor parallelism: every rank raises, not one alone while the others wait
                pair = shard.gather(pair.view(1, 1, 2)).any(1)[0]
            flags.append(pair)
        negative, bad = torch.stack(flags).any(0).tolist()
        if negative:
            raise NegativeScoreError(
                f"{type(self.selector).__name__} multiplies scores by value norms, so scores must be >= 0; "
                f"{type(self.scorer).__name__} produced negative or NaN scores (e.g. a negated key norm): make them "
                "finite and >= 0, or use the top-k selector"
            )
        if bad:
            raise CriticalKVError(
                f"{type(self.scorer).__name__} gave NaN or infinite scores at real context positions: every position "
                "the selector may pick needs a finite score (rank a position first with a large finite value)"
            )

    def _stream(self, views: list[LayerView], budget: Budget, scores: list[torch.Tensor] | None) -> list[Decision]:
        """A streaming allocator's decisions for layers given together (a deferred method): layer by layer with one
        state, each shrink order applied to the earlier layer's keep mask (b, h_kv, t) and budgets."""
        state: dict = {}
        decisions: list[Decision] = []
        position = {view.module.layer_idx: index for index, view in enumerate(views)}
        for index, view in enumerate(views):
            layer_scores = None if scores is None else [scores[index]]
            decision = self.decide_layers([view], budget, layer_scores, state)[0]
            for layer, order in decision.shrink.items():
                earlier = decisions[position[layer]]
                keep = torch.zeros_like(earlier.keep)
                keep[earlier.keep] = order  # the order runs over the kept entries in storage (row-major) order
                earlier.keep, earlier.budgets = keep, keep.sum(-1)
            decision.shrink = {}
            decisions.append(decision)
        return decisions

    def _plan(self, view: LayerView, budget: Budget) -> _LayerPlan:
        def plan() -> _LayerPlan:
            lengths = view.lengths  # (b,)
            protected = self.scorer.protected(view)  # (b, t)
            # a row no longer than its protected positions is kept whole, even where the fraction rounds to zero
            row_budgets = budget.entries_for(lengths, whole=protected.sum(-1) >= lengths)  # (b,)
            kept_whole = row_budgets >= lengths  # (b,): their budget is their length
            if not len(lengths):  # an empty batch
                return _LayerPlan(row_budgets, protected, kept_whole, 0, None)
            # one host read for the forward: rows kept whole, and whether every row keeps as many entries
            whole_rows, low, high = torch.stack([kept_whole.sum(), row_budgets.min(), row_budgets.max()]).tolist()
            # every layer of the forward is handed these two: what the allocator and selector derive from them alone
            # is computed once per forward (LayerView.remember_for_tensors)
            view.share_with_forward(row_budgets)
            view.share_with_forward(protected)
            return _LayerPlan(row_budgets, protected, kept_whole, whole_rows, low if low == high else None)

        return view.remember_for_prefill(("plan", repr(self.scorer), repr(budget)), plan)

    @staticmethod
    def _whole(view: LayerView, plan: _LayerPlan) -> Decision:
        h_kv = view.keys.shape[1]
        return Decision(None, view.lengths[:, None].expand(-1, h_kv).clone(), plan.kept_whole)

    def _select(self, view: LayerView, plan: _LayerPlan, scores: torch.Tensor, budgets: torch.Tensor) -> Decision:
        h_kv = view.keys.shape[1]
        keep = self.selector.select(scores, budgets, plan.protected, view)  # (b, h_kv, t)
        whole = plan.kept_whole  # (b,)
        if plan.any_whole:  # torch.where, not keep[whole] = ...: indexing by a mask is a host read (a GPU sync)
            keep = torch.where(whole[:, None, None], view.valid[:, None, :].expand(-1, h_kv, -1), keep)
            budgets = torch.where(whole[:, None], view.lengths[:, None], budgets)  # (b, h_kv)
        width = plan.width if self.allocator.row_budget_per_head else None
        return Decision(keep, budgets, whole, width=width)


def _own_method(obj: object, name: str) -> bool:
    """Whether ``obj``'s method ``name`` is criticalkv's own (not a subclass's override from elsewhere)."""
    return getattr(type(obj), name).__module__.startswith("criticalkv.")
