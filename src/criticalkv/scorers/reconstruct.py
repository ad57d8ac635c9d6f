"""Context reconstruction (KVzip, Kim et al., 2025): after the prefill, ask the model to repeat the context and
score each cached entry by the largest attention it receives from the repeating queries. The score does not
depend on any question, so a context compressed this way serves whatever is asked later.

The runtime keeps every layer dense through the prefill (``after_prefill``), then ``score_after_prefill`` feeds
the repeat prompt and the context back in chunks over the same cache, with the attention function in collection
mode (``Compressor.attention_probe``): each layer computes its own output as usual, and the probe takes the
float32 softmax of the reconstruction queries over the whole cache and keeps, per entry, the maximum. On CPU under
SDPA the fused kernel's log-sum-exp gives the softmax's denominators with the output, and the probe computes only
the prefill's logits. After each chunk the cache is trimmed back to the prefill, so no reconstruction token stays.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.cache_utils import DummyLayer

from criticalkv.cache.compressed_layer import CompressedLayer, as_bool_mask
from criticalkv.core.positions import forward_on_cache
from criticalkv.core.view import LayerView
from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.logits import logit_changes
from criticalkv.models.hub import hub_reachable
from criticalkv.scorers.base import PrefillContext, Scorer

FIRST_REQUEST = "\n\nRepeat the previous context exactly."  # KVzip's prompt before the first chunk
NEXT_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"  # before each later chunk
QUOTED_TOKENS = 8  # last tokens of the previous chunk quoted after NEXT_REQUEST
_MARKER = "<criticalkv-context>"  # rendered as the user message to split a chat template around it
_PROBE_ELEMENTS = 1 << 20  # float32 logits per probe block (4 MiB: cache-sized blocks are ~20% faster on CPUs)


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids that frame a reconstruction, from the model's tokenizer and chat template.

    A chunk's reconstruction input is ``request + turn_end + chunk``; ``template_start`` is what the chat
    template writes before a user message (system prompt, user header): a prefill that starts with it is a
    templated prompt whose context begins right after.
    """

    template_start: tuple[int, ...]  # empty without a chat template
    first_request: tuple[int, ...]
    next_request: tuple[int, ...]
    turn_end: tuple[int, ...]  # end of the user turn and start of the assistant's ("\n" without a template)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> RepeatPrompt:
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _MARKER}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            if not isinstance(rendered, str) or rendered.count(_MARKER) != 1:
                raise CriticalKVError("the chat template altered its user message; cannot build the repeat prompt")
            start, end = rendered.split(_MARKER)
        else:
            start, end = "", "\n"
        return cls(ids(start), ids(FIRST_REQUEST), ids(NEXT_REQUEST), ids(end))


@dataclass
class ReconstructionInputs:
    """The chunks of one batch's reconstruction and what the prefill keeps regardless."""

    chunks: list[tuple[torch.Tensor, torch.Tensor]]  # per chunk: ids (b, q), mask (b, q); right padding
    protected: torch.Tensor  # (b, t) bool: the template start (at least the first ``sinks`` tokens) of each row
    slices: list[torch.Tensor]  # per chunk: (b, t) bool, the prefill positions of the context it repeats


def reconstruction_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt: RepeatPrompt,
    chunk_size: int,
    sinks: int,
) -> ReconstructionInputs:
    """Split each row's context into chunks and frame each chunk as a request to repeat it.

    input_ids, attention_mask (b, t), left padding. A row's context is its real tokens after the template
    start when the row begins with the whole start, else all its real tokens. Chunk ``i`` of a row is its
    context tokens ``[i C, (i+1) C)``; rows with fewer chunks get an all-padding input at the chunk indices they
    lack. Inputs are right-padded, so the reconstruction tokens of every row start right after its prefill and
    keep the positions a batch of one would give them.
    """
    b, t = input_ids.shape
    rows: list[list[list[int]]] = []  # rows[r][i]: the reconstruction input of chunk i of row r
    protected = torch.zeros(b, t, dtype=torch.bool, device=input_ids.device)
    context_starts = []  # per row: the prefill position of its context's first token
    for r in range(b):
        real = input_ids[r][attention_mask[r].bool()].tolist()
        head = prompt.template_start
        start = len(head) if tuple(real[: len(head)]) == head else 0  # a partial match is no template start
        protected[r, t - len(real) : t - len(real) + max(start, min(sinks, len(real)))] = True
        context_starts.append(t - len(real) + start)
        context = real[start:]
        pieces = [context[i : i + chunk_size] for i in range(0, len(context), chunk_size)]
        rows.append([_request(prompt, pieces, i) + list(prompt.turn_end) + piece for i, piece in enumerate(pieces)])
    chunks, slices = [], []
    for i in range(max((len(r) for r in rows), default=0)):
        seqs = [r[i] if i < len(r) else [] for r in rows]
        q = max(len(s) for s in seqs)
        ids = torch.zeros(b, q, dtype=input_ids.dtype, device=input_ids.device)
        mask = torch.zeros(b, q, dtype=attention_mask.dtype, device=input_ids.device)
        for r, seq in enumerate(seqs):
            ids[r, : len(seq)] = torch.tensor(seq, dtype=input_ids.dtype)
            mask[r, : len(seq)] = 1
        chunks.append((ids, mask))
        repeated = torch.zeros(b, t, dtype=torch.bool, device=input_ids.device)
        for r, first in enumerate(context_starts):
            repeated[r, min(first + i * chunk_size, t) : min(first + (i + 1) * chunk_size, t)] = True
        slices.append(repeated)
    return ReconstructionInputs(chunks, protected, slices)


def _request(prompt: RepeatPrompt, pieces: list[list[int]], i: int) -> list[int]:
    """The request before chunk ``i``: the first asks for the context, later ones quote the previous chunk's end."""
    if i == 0:
        return list(prompt.first_request)
    return list(prompt.next_request) + pieces[i - 1][-QUOTED_TOKENS:]


@dataclass
class MaxAttentionProbe:
    """Collection mode of the attention function: the maximum attention each prefill entry receives from the
    (subsampled) reconstruction queries, per layer and query head.

    ``maxima[layer_idx]`` is (b, h_kv, G, t) float32: for KV head h, query head g of its group and prefill entry
    i, the largest softmax weight any scored reconstruction query of that head gave to i, the softmax taken over
    the whole cache (prefill and reconstruction tokens, under the layer's mask) with the layer's own scaling, or,
    with ``readable``, over the readable prefill entries and the reconstruction tokens (KVzip's).
    """

    context_length: int  # t: the prefill's entries, the first t keys of every dense layer
    query_stride: int
    query_valid: torch.Tensor | None = None  # (b, q) bool: real reconstruction tokens of the current chunk
    readable: torch.Tensor | None = None  # (b, t) bool: the prefill entries the softmax reads (None: all)
    maxima: dict[int, torch.Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        base: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
        sdpa: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's attention output, what ``base`` (the model's attention function) returns, with this probe's
        maxima collected on the way; shapes as in ``__call__``, values (b, h_kv, n, d).

        On CPU under SDPA (``sdpa``) one call of torch's fused CPU kernel gives the output and every query's
        log-sum-exp over the whole cache, so the probe needs the logits of the prefill's t columns only and takes
        no softmax of its own (a weight is exp(logit - log-sum-exp), and exp is monotonic: one exp per entry).
        Elsewhere, and over ``readable`` entries only, ``base`` runs and the probe recomputes the softmax
        (``__call__``).
        """
        fused = sdpa and query.device.type == "cpu" and query.dtype in _FUSED_CPU_DTYPES and _FUSED_CPU_KERNEL
        if not fused or self.readable is not None:  # the kernel's log-sum-exp is over every entry
            out = base()
            self(module, query, keys, mask, scaling)
            return out
        b, h_q, q, _ = query.shape
        g, n = h_q // keys.shape[1], keys.shape[2]
        allowed = _allowed(mask, b, q, n, query.device)  # (b, q, n)
        additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, -math.inf)
        out, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query,
            keys.repeat_interleave(g, dim=1),  # (b, h_q, n, d), as transformers' repeat_kv
            values.repeat_interleave(g, dim=1),
            0.0,
            False,
            attn_mask=additive[:, None],  # (b, 1, q, n)
            scale=scaling,
        )  # (b, h_q, q, d), (b, h_q, q) float32
        self._collect(module, query, keys, allowed, log_sum_exp, scaling)
        return out.transpose(1, 2).contiguous(), None  # (b, q, h_q, d), as transformers' attention functions

    @torch.no_grad()
    def __call__(
        self, module: nn.Module, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> None:
        """query (b, h_q, q, d) post-RoPE; keys (b, h_kv, n, d), the layer's prefill then the chunk (n = t + q);
        mask (b, 1, q, n) as the model's attention receives it (bool, additive float, or None for causal)."""
        b, q = query.shape[0], query.shape[2]
        allowed = _allowed(mask, b, q, keys.shape[2], query.device)  # (b, q, n)
        if self.readable is not None:  # KVzip's softmax: the prefill's readable entries and the chunk's own tokens
            t = self.context_length
            allowed = torch.cat([allowed[..., :t] & self.readable[:, None], allowed[..., t:]], dim=-1)
        self._collect(module, query, keys, allowed, None, scaling)

    def _collect(
        self,
        module: nn.Module,
        query: torch.Tensor,
        keys: torch.Tensor,
        allowed: torch.Tensor,
        log_sum_exp: torch.Tensor | None,
        scaling: float,
    ) -> None:
        """Fold the scored queries' weights into ``maxima``: allowed (b, q, n) bool; log_sum_exp (b, h_q, q)
        float32, each query's over the whole cache, or None to compute the softmax here over all n columns."""
        b, h_q, q, d = query.shape
        h_kv = keys.shape[1]
        g, t = h_q // h_kv, self.context_length
        rows = torch.arange(0, q, self.query_stride, device=query.device)  # scored reconstruction queries
        hidden = ~allowed[:, rows]  # (b, q_s, n)
        first = 0 if bool(hidden[..., :t].any()) else t  # without prefill padding only the chunk's columns hide
        unscored = ~self.query_valid[:, rows]  # (b, q_s): padding queries cast no vote
        columns = t if log_sum_exp is not None else keys.shape[2]  # the prefill's, or all for the denominator
        keys_t = keys[:, :, :columns].float().transpose(-1, -2)  # (b, h_kv, d, columns)
        best = self.maxima.get(module.layer_idx)
        if best is None:
            best = query.new_zeros((b, h_kv, g, t), dtype=torch.float32)
        step = max(1, _PROBE_ELEMENTS // (b * h_q * columns))
        for s in range(0, len(rows), step):
            m = len(rows[s : s + step])
            block = slice(s * self.query_stride, (s + m) * self.query_stride, self.query_stride)
            q_block = (query[:, :, block].float() * scaling).reshape(b, h_kv, g * m, d)  # query head = kv * G + g
            logits = torch.matmul(q_block, keys_t).view(b, h_kv, g, m, columns)
            logits[..., first:].masked_fill_(hidden[:, None, None, s : s + m, first:columns], float("-inf"))
            if log_sum_exp is not None:  # log-weights of the prefill's columns; one exp per entry after the max
                logits.sub_(log_sum_exp[:, :, block].reshape(b, h_kv, g, m, 1))
                logits.masked_fill_(unscored[:, None, None, s : s + m, None], float("-inf"))
                weights = logits.amax(dim=3).exp_().clamp_(max=1.0)  # (b, h_kv, G, t): rounding may pass 1
            else:
                weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # unnormalised softmax, in place
                inverse = weights.sum(dim=-1, keepdim=True).reciprocal_()  # (b, h_kv, G, m, 1)
                inverse.masked_fill_(unscored[:, None, None, s : s + m, None], 0.0)  # padding queries cast no vote
                weights = weights[..., :t].mul_(inverse).amax(dim=3)  # (b, h_kv, G, t)
            best = torch.maximum(best, weights)
        self.maxima[module.layer_idx] = best


SOFTMAX_SPANS = ("cache", "chunk")  # ReconstructionScorer.softmax
# a KV head's score from its query heads' maxima, (b, h_kv, G, t) -> (b, h_kv, t): by ReconstructionScorer.group
GROUP_REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": lambda best: best.mean(dim=2),
    "max": lambda best: best.amax(dim=2),
}

_FUSED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# torch's CPU kernel behind scaled_dot_product_attention, which also returns the log-sum-exp (a private operator:
# where a torch lacks it, the probe computes the softmax itself, with the same result)
_FUSED_CPU_KERNEL = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _allowed(mask: torch.Tensor | None, b: int, q: int, n: int, device: torch.device) -> torch.Tensor:
    """Which keys each query of the chunk may read: (b, q, n) bool, from the (b, 1, q, n) mask the model's
    attention receives (bool or additive float), or causal over the chunk with everything before visible (None)."""
    if mask is None:
        causal = torch.arange(n, device=device)[None, :] <= (n - q + torch.arange(q, device=device))[:, None]
        return causal[None].expand(b, q, n)
    return as_bool_mask(mask)[:, 0, :, :n]


@functools.lru_cache(maxsize=4)
def _tokenizer_at(source: str) -> PreTrainedTokenizerBase:
    offline = not Path(source).is_dir() and not hub_reachable()  # a hub id on an offline machine: the cache only
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=offline, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise CriticalKVError(
            f"the reconstruction scorer builds its repeat prompt with the model's tokenizer, and none loads from "
            f"{source!r} ({error}); pass tokenizer=<folder or tokenizer object>"
        ) from None


@dataclass(repr=False)
class ReconstructionScorer(Scorer):
    """Question-agnostic scores from context reconstruction (KVzip).

    After the prefill, each chunk of ``chunk_size`` context tokens is fed back as the answer to "Repeat the
    previous context exactly." (later chunks: "Repeat the part of the previous context exactly, starting with"
    and the last 8 tokens of the previous chunk), framed by the model's chat template. An entry's score is the
    largest attention it receives from any reconstruction query of a query head (softmax over the whole cache,
    float32; ``softmax="chunk"``: KVzip's span), averaged over the GQA group as the other scorers do
    (``group="max"``: KVzip's maximum). The template's start (system prompt, user header) and at least the first
    ``sinks`` tokens are protected (kept, counted in the budget).

    Parameters
    ----------
    chunk_size
        Context tokens per reconstruction pass (KVzip and kvpress: 2048). Bounds the extra memory: one pass
        appends about this many tokens to the cache and is trimmed off before the next.
    query_stride
        Score from every ``query_stride``-th reconstruction query only (1: all). The passes still run every
        token (the model needs them); the stride saves the probe's attention recomputation. It costs quality: the
        query that copies a context token is that token's strongest witness, and a stride skips it for most
        tokens (docs/results.md, reconstruction scorer on Qwen2.5-0.5B).
    sinks
        First tokens of each row always kept (kvpress's ``n_sink``), also when no chat template is found.
    tokenizer
        The model's tokenizer, or a folder or hub id to load it from; None loads it from the model's
        ``name_or_path`` (what ``criticalkv.models.load_model`` gives). Needed to write the repeat prompt.
    group
        How a KV head's score gathers its G query heads' maxima: ``"mean"`` (the other scorers' GQA aggregation)
        or ``"max"`` (KVzip's and kvpress's: an entry one query head of the group reads is kept for the group).
    softmax
        Which entries a reconstruction query's softmax spans: ``"cache"``, every entry (the weights the model
        computes), so every chunk's queries score every context entry; or ``"chunk"`` (KVzip's and kvpress's), the
        protected entries, the context slice the chunk repeats and the chunk's own tokens, so each entry is scored
        by the chunk that repeats it only.
    """

    non_negative: ClassVar[bool] = True  # maxima of attention probabilities (Scorer)
    supports_sliding_windows: ClassVar[bool] = False  # transformers' sliding layers cannot be rewound (Compressor)

    chunk_size: int = 2048
    query_stride: int = 1
    sinks: int = 4
    tokenizer: str | PreTrainedTokenizerBase | None = None
    group: str = "mean"
    softmax: str = "cache"
    after_prefill: ClassVar[bool] = True  # scores come from forward passes over the finished prefill

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.query_stride < 1:
            raise ValueError(f"query_stride must be >= 1, got {self.query_stride}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.group not in GROUP_REDUCTIONS:
            raise ValueError(f"group must be one of {', '.join(GROUP_REDUCTIONS)}, got {self.group!r}")
        if self.softmax not in SOFTMAX_SPANS:
            raise ValueError(f"softmax must be one of {', '.join(SOFTMAX_SPANS)}, got {self.softmax!r}")

    def __repr__(self) -> str:  # every option that changes scores (a sweep's record of its methods)
        return f"ReconstructionScorer({self._pass_options()}, group={self.group!r})"

    def _passes_key(self) -> str:
        """The memo key of the reconstruction passes: every option but ``group``, which reduces their maxima after."""
        return f"ReconstructionScorer({self._pass_options()})"

    def _pass_options(self) -> str:
        """The options that shape the passes, as ``name=value`` pairs (a tokenizer object by its type and id)."""
        tokenizer = self.tokenizer
        if tokenizer is not None and not isinstance(tokenizer, str):
            tokenizer = f"<{type(tokenizer).__name__} at {id(tokenizer):#x}>"
        return (
            f"chunk_size={self.chunk_size}, query_stride={self.query_stride}, sinks={self.sinks}, "
            f"tokenizer={tokenizer!r}, softmax={self.softmax!r}"
        )

    # --- the scorer contract -------------------------------------------------------------------------------
    def score(self, view: LayerView) -> torch.Tensor:
        raise CriticalKVError(
            "reconstruction scores come from passes over the finished prefill (score_after_prefill); "
            "use this scorer through a Method, which defers its decisions to the end of the prefill"
        )

    def protected(self, view: LayerView) -> torch.Tensor:
        protected = view.memo.get(("protected", repr(self)))
        if protected is None:
            raise CriticalKVError("the protected positions of a reconstruction are known after its passes only")
        return protected

    def score_after_prefill(self, context: PrefillContext) -> list[torch.Tensor]:
        """(b, h_kv, t) float32 scores per pending layer, in layer order. Several methods whose scorers differ in
        ``group`` at most, on one prefill (a ``SharedPrefill`` sweep), share one set of passes through the layers'
        memo."""
        if not context.pending:
            return []
        first = context.pending[0].view
        maxima, protected = first.remember(("reconstruction", self._passes_key()), lambda: self._reconstruct(context))
        reduce = GROUP_REDUCTIONS[self.group]
        scores = []
        for item, best in zip(context.pending, maxima, strict=True):
            item.view.memo[("protected", repr(self))] = protected
            scores.append(_with_protected_at_top(reduce(best), protected, item.view.valid))
        return scores

    def check_config(self, config: PretrainedConfig) -> None:
        """Refuse, from the config alone, a model whose attention the probe does not recompute (soft-capped logits,
        sinks)."""
        if logit_changes(config):
            raise UnsupportedModelError(
                "the reconstruction scorer does not apply soft-capped logits (Gemma 2) or attention sinks (gpt-oss) yet"
            )

    def check_model(self, model: nn.Module) -> None:
        """Refuse, before any forward, a tokenizer that cannot be loaded or is another model's (the repeat prompt
        is written with it only after the whole prefill)."""
        _check_vocabulary(RepeatPrompt.from_tokenizer(self._resolve_tokenizer(model)), model)

    # --- the passes ------------------------------------------------------------------------------------------
    def _resolve_tokenizer(self, model: nn.Module) -> PreTrainedTokenizerBase:
        if isinstance(self.tokenizer, PreTrainedTokenizerBase):
            return self.tokenizer
        source = self.tokenizer or getattr(model, "name_or_path", "")
        if not source:
            raise CriticalKVError(
                "the reconstruction scorer needs the model's tokenizer to write its repeat prompt, and this model "
                "has no name_or_path to load it from; pass tokenizer=<folder or tokenizer object>"
            )
        return _tokenizer_at(str(source))

    @torch.no_grad()
    def _reconstruct(self, context: PrefillContext) -> tuple[list[torch.Tensor], torch.Tensor]:
        cache, ids = context.cache, context.input_ids
        if ids is None:
            raise CriticalKVError("reconstruction scoring needs the prefill's token ids (input_ids, not embeddings)")
        if not all(isinstance(layer, CompressedLayer | DummyLayer) for layer in cache.layers):  # Dummy: another stage's
            raise UnsupportedModelError(
                "reconstruction scoring does not support models with sliding-window layers yet: their caches "
                "cannot be rewound after the reconstruction passes"
            )
        t = ids.shape[1]
        mask = torch.ones_like(ids) if context.attention_mask is None else context.attention_mask
        prompt = RepeatPrompt.from_tokenizer(self._resolve_tokenizer(context.model))
        _check_vocabulary(prompt, context.model)
        inputs = reconstruction_inputs(ids, mask, prompt, self.chunk_size, self.sinks)
        probe = MaxAttentionProbe(t, self.query_stride)
        context.compressor.attention_probe = probe
        try:
            for (chunk_ids, chunk_mask), repeated in zip(inputs.chunks, inputs.slices, strict=True):
                probe.query_valid = chunk_mask.bool()
                probe.readable = None if self.softmax == "cache" else inputs.protected | repeated
                full_mask = torch.cat([mask, chunk_mask], dim=1)  # (b, t + q)
                try:
                    forward_on_cache(context.model, chunk_ids, full_mask, cache)  # positions t.. of the mask
                finally:  # the chunk's tokens leave every layer, also when the pass failed midway
                    for layer in cache.layers:
                        if isinstance(layer, CompressedLayer) and layer.seen > t:
                            layer.crop(t - layer.seen)
        finally:
            context.compressor.attention_probe = None
        maxima = []  # (b, h_kv, G, t) per pending layer: each query head's maxima (zeros where none were taken)
        for item in context.pending:
            best = probe.maxima.get(item.view.module.layer_idx)
            b, h_kv = item.view.keys.shape[:2]
            maxima.append(best if best is not None else item.view.keys.new_zeros((b, h_kv, 1, t), dtype=torch.float32))
        return maxima, inputs.protected


def _check_vocabulary(prompt: RepeatPrompt, model: nn.Module) -> None:
    """Refuse a tokenizer whose repeat prompt holds ids the model has no embedding for (another model's)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)  # None on a pipeline stage without the embedding
    largest = max((*prompt.template_start, *prompt.first_request, *prompt.next_request, *prompt.turn_end), default=-1)
    if rows is not None and largest >= rows:
        raise CriticalKVError(
            f"the reconstruction scorer's tokenizer writes token id {largest}, beyond the model's {rows} embeddings: "
            "it is not this model's tokenizer; pass tokenizer=<the model's folder or tokenizer object>"
        )


def _with_protected_at_top(scores: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Protected positions get their head's highest other score, so scores stay readable (as SnapKV's window)."""
    others = scores.masked_fill(~(valid & ~protected)[:, None, :], 0.0)  # (b, h_kv, t)
    top = others.amax(dim=-1, keepdim=True).expand_as(scores)
    return torch.where(protected[:, None, :], top, scores)
