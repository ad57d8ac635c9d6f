"""What the generated benchmarks (RULER, the facts set) share: fitting a prompt to a token length, a token prefix of a
haystack, needles inserted at depths, and the string-match score.

A task builds a ``Draft`` for a haystack ``size`` (tokens, lines or words); ``fit_length`` finds the size whose
chat-templated prompt (``encode_prompt``) has ``(1 - LENGTH_TOLERANCE) * length`` to ``length`` tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerBase

from criticalkv.prompts import encode_prompt

LENGTH_TOLERANCE = 0.025  # prompts land in [length * (1 - tolerance), length] tokens
_MAX_ROUNDS = 16
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass
class Draft:
    """A sample's text for one haystack size: the context, the question after it, and the answers."""

    context: str
    question: str
    answer_prefix: str
    answers: list[str]


@dataclass
class Builder:
    """Builds a sample's draft for a haystack ``size`` (in task-specific units: tokens, lines, words)."""

    build: Callable[[int], Draft]
    min_size: int
    rate: float  # rough prompt tokens per size unit; refined by secant steps while fitting
    max_size: int | None = None


@dataclass
class Fit:
    """A draft and its size, with its prompt's length in tokens."""

    draft: Draft
    size: int
    tokens: int


@dataclass
class _Search:
    best: Fit | None = None  # largest size that fits (tokens <= hi)
    over: int | None = None  # smallest size that does not fit


class Measure:
    """Token counts in one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def counts(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def prompt(self, draft: Draft) -> int:
        """The whole chat-templated prompt's length: context, question and answer prefix."""
        prefix_ids, suffix_ids = encode_prompt(self.tokenizer, draft.context, draft.question, draft.answer_prefix)
        return len(prefix_ids) + len(suffix_ids)


class TokenPrefix:
    """About the first ``n`` tokens of a long text, cut at a word boundary; the text is tokenized once per window.

    ``source(chars)`` gives the text's first ``chars`` characters (a haystack repeated as far as asked).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, source: Callable[[int], str]) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.window = ""
        self.ends: list[int] = []  # end offset (chars) of each token of window

    def __call__(self, n_tokens: int) -> str:
        if n_tokens <= 0:
            return ""
        if len(self.ends) < n_tokens + 64:  # margin: the window's last word may tokenize differently
            chars = max(2 * len(self.window), 6 * n_tokens + 4096)
            while True:
                window = self.source(chars)
                if self.tokenizer.is_fast:
                    enc = self.tokenizer(window, add_special_tokens=False, return_offsets_mapping=True)
                    ends = [end for _, end in enc["offset_mapping"]]
                else:  # slow tokenizers give no offsets: estimate them (the fit corrects the error)
                    n = len(self.tokenizer(window, add_special_tokens=False)["input_ids"])
                    ends = [round((i + 1) * len(window) / n) for i in range(n)]
                if len(ends) >= n_tokens + 64:
                    break
                chars *= 2
            self.window, self.ends = window, ends
        cut = self.ends[n_tokens - 1]
        if cut < len(self.window) and self.window[cut] != " ":
            cut = max(self.window.rfind(" ", 0, cut), 0)
        return self.window[:cut].rstrip()


def insert_at_depths(text: str, needles: Sequence[str], depths: Sequence[int]) -> str:
    """Insert ``needles`` before the sentences at ``depths`` % of ``text``'s sentences (RULER's essay rule)."""
    starts = [0, *(m.end() for m in _SENTENCE_END.finditer(text) if m.end() < len(text))]
    n_sentences = len(starts) if text else 0
    cuts = sorted(int(n_sentences * depth / 100) for depth in depths)
    pieces, previous = [], 0
    for index, needle in zip(cuts, needles):
        cut = starts[index] if index < n_sentences else len(text)
        pieces += [text[previous:cut].strip(), needle]
        previous = cut
    pieces.append(text[previous:].strip())
    return " ".join(piece for piece in pieces if piece)


def string_match(answers: Sequence[str], metric: Literal["all", "part"], prediction: str) -> float:
    """RULER's string match in [0, 100], case-insensitive: ``all``, the share of ``answers`` found in ``prediction``
    x 100; ``part``, 100 if any is found, else 0."""
    text = prediction.lower()
    found = [answer.lower() in text for answer in answers]
    if metric == "part":
        return 100.0 if any(found) else 0.0
    return 100.0 * sum(found) / len(found)


def fit_length(
    measure: Measure, builder: Builder, lo: int, hi: int, start: int | None, too_short: Callable[[int], Exception]
) -> Fit:
    """The largest draft whose prompt has at most ``hi`` tokens, aiming at ``lo``..``hi``.

    ``start`` is the size to try first (the previous sample's size); None checks first that the smallest draft fits
    and aims from it. ``too_short(tokens)`` is raised when even the smallest draft has more than ``hi`` tokens.
    """
    minimum = None
    if start is None:
        minimum = measure.prompt(builder.build(builder.min_size))
        if minimum > hi:
            raise too_short(minimum)
        start = builder.min_size + round(((lo + hi) / 2 - minimum) / builder.rate)
    search = _fit(measure, builder, start, lo, hi)
    if search.best is None:
        minimum = minimum if minimum is not None else measure.prompt(builder.build(builder.min_size))
        if minimum > hi:
            raise too_short(minimum)
        search = _fit(measure, builder, builder.min_size, lo, hi)
        if search.best is None:  # pragma: no cover - the minimum fits, so the search keeps it
            raise too_short(minimum)
    return search.best


def _fit(measure: Measure, builder: Builder, start: int, lo: int, hi: int) -> _Search:
    """Find a size whose prompt has lo..hi tokens (secant steps on size, kept inside the bracket)."""
    search = _Search()
    target = (lo + hi) / 2
    rate = builder.rate
    size = max(start, builder.min_size)
    if builder.max_size is not None:
        size = min(size, builder.max_size)
    previous: tuple[int, int] | None = None
    for _ in range(_MAX_ROUNDS):
        draft = builder.build(size)
        tokens = measure.prompt(draft)
        if tokens <= hi:
            if search.best is None or size > search.best.size:
                search.best = Fit(draft, size, tokens)
            if tokens >= lo:
                return search
        elif search.over is None or size < search.over:
            search.over = size
        if previous is not None and size != previous[0] and (tokens - previous[1]) * (size - previous[0]) > 0:
            rate = (tokens - previous[1]) / (size - previous[0])
        previous = (size, tokens)
        low = search.best.size + 1 if search.best else builder.min_size
        high = search.over - 1 if search.over is not None else builder.max_size
        if high is not None and low > high:
            break  # bracketed to one unit: the best size that fits is as close as this task allows
        guess = size + round((target - tokens) / max(rate, 1e-6))
        guess = max(guess, low) if high is None else min(max(guess, low), high)
        size = guess
    return search
