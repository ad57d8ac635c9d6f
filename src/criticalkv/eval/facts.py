"""The facts benchmark: a second retrieval benchmark whose haystack and phrasing differ from RULER's.

Haystack: the prose paragraphs of the Python language reference as Python ships it (``pydoc_data.topics``, PSF
licence; read at run time, never copied here). Short facts about people, rooms and codes, in everyday phrasing ("The
door of the chart room on deck 4 unlocks with the combination 48213."), are inserted between its sentences; the
question paraphrases the fact instead of quoting it. The prompt is sized to a token length as RULER's
(``criticalkv.eval.synthetic``), and context and question are stored apart for both regimes.

Tasks: ``fact_single`` (one fact), ``fact_distractors`` (the fact among 4 of the same kind about other rooms),
``fact_pair`` (two facts about one person, asked together), ``fact_hop`` (who works in which room, and that room's
code, in two facts: ask for the person's room and its code), ``fact_list`` (three people who speak one language,
scattered: name them all). Scored as RULER's ``all`` (the share of the answers found, case-insensitive), except that an
answer naming a distractor's code (``decoys``) scores 0.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial

from transformers import PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError
from criticalkv.eval.synthetic import (
    LENGTH_TOLERANCE,
    Builder,
    Draft,
    Measure,
    TokenPrefix,
    fit_length,
    insert_at_depths,
    string_match,
)

__all__ = [
    "LENGTH_TOLERANCE",
    "TASKS",
    "TOKENS_TO_GENERATE",
    "FactSample",
    "generate",
    "haystack_id",
    "haystack_text",
    "score",
    "task_score",
]

TASKS: tuple[str, ...] = ("fact_single", "fact_distractors", "fact_pair", "fact_hop", "fact_list")
TOKENS_TO_GENERATE: dict[str, int] = {
    "fact_single": 32,
    "fact_distractors": 32,
    "fact_pair": 48,
    "fact_hop": 32,
    "fact_list": 64,
}

_PREAMBLE = "Read the document below. Afterwards you will answer a question about something it says."
_PROSE_MIN_CHARS = 80

_ROOMS = (
    "chart room", "boiler room", "greenhouse", "observatory", "pantry", "workshop", "reading room", "chapel",
    "wine cellar", "laboratory", "archive", "radio room", "boathouse", "infirmary", "armoury", "bakery",
    "map room", "sail loft", "engine room", "gallery", "laundry", "music room", "print shop", "signal box",
)  # fmt: skip
_SURNAMES = (
    "Okafor", "Lindqvist", "Moreau", "Tanaka", "Castellanos", "Abernathy", "Novak", "Haddad", "Ferreira",
    "Kowalski", "Nakamura", "Petrov", "Quintero", "Rasmussen", "Sandoval", "Underwood", "Valdivia", "Whitcombe",
    "Yilmaz", "Zelenko", "Achebe", "Brennan", "Chaudhry", "Delacroix", "Eriksen", "Fontaine", "Gallagher",
    "Hoffmann", "Ibarra", "Jovanovic", "Kariuki", "Mbeki", "Ortega", "Pellegrini", "Szabo", "Thorne",
)  # fmt: skip
_TITLES = ("Dr.", "Professor", "Captain", "Ms.", "Mr.")
_ITEMS = (
    "archive key", "spare lantern", "brass compass", "logbook", "first-aid kit", "signal flare", "tide table",
    "field glasses", "master ledger", "fuse box key",
)  # fmt: skip
_CONTAINERS = (
    "blue cabinet", "green locker", "oak chest", "tin box", "red satchel", "steel drawer", "wicker basket",
    "leather case", "grey filing cabinet", "cedar trunk",
)  # fmt: skip
_LANGUAGES = ("Portuguese", "Finnish", "Swahili", "Tagalog", "Icelandic", "Welsh", "Basque", "Hungarian", "Malay")

_CODE_FACTS = (
    "The {place} opens with the code {value}.",
    "Anyone who types {value} on the keypad can enter the {place}.",
    "The door of the {place} unlocks with the combination {value}.",
)
# (question, answer prefix): the prefix restates the question, as RULER's does, in other words than the fact's
_CODE_QUESTIONS = (
    ("Which number unlocks the {place}?", "The number that unlocks the {place} is"),
    ("What do you have to type on the keypad to get into the {place}?", "To get into the {place}, type"),
    ("What is the entry code of the {place}?", "The entry code of the {place} is"),
)
_KEEPS_FACTS = (
    "{person} keeps the {item} in the {container}.",
    "The {item} is in the {container}, where {person} always puts it.",
    "{person} stores the {item} inside the {container}.",
)
_EXTENSION_FACTS = (
    "{person} answers the telephone on extension {value}.",
    "You can reach {person} by dialling extension {value}.",
    "The desk phone of {person} has the extension number {value}.",
)
_PAIR_QUESTIONS = (
    ("Where does {person} keep the {item}, and which extension reaches {person} by phone?", "Answer:"),
    ("In what container is the {item} of {person}, and what extension do you dial to call {person}?", "Answer:"),
)
_WORKS_FACTS = (
    "{person} works in the {place}.",
    "The {place} is where {person} spends every working day.",
    "{person} has a desk in the {place}.",
)
_HOP_QUESTIONS = (  # both hops asked: the room, then its code
    ("In which room does {person} work, and which code opens that room?", "Answer:"),
    ("Where does {person} work, and what number opens the door there?", "Answer:"),
)

_SPEAKS_FACTS = (
    "{person} speaks {language}.",
    "{person} grew up speaking {language} at home.",
    "{person} is fluent in {language}.",
)
_LIST_QUESTIONS = (
    ("Who in the document can speak {language}? Name every such person.", "The people who speak {language} are"),
    ("List all the people mentioned in the document who know {language}.", "The people who know {language} are"),
)


@dataclass(frozen=True)
class FactSample:
    """One sample of the facts benchmark.

    The prompt is ``encode_prompt(tokenizer, context, question, answer_prefix)``: ``context`` holds a short
    instruction and the haystack with the facts, ``question`` the query. ``answers`` must all occur in the answer
    (case-insensitive); an answer with any of ``decoys`` (the distractors' codes) scores 0.
    ``context_tokens`` counts ``context`` alone and ``prompt_tokens`` the whole templated prompt.
    """

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    context_tokens: int
    prompt_tokens: int
    facts: list[str] = field(default_factory=list)  # the sentences inserted in the haystack
    decoys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Facts:
    facts: list[str]
    question: str
    answer_prefix: str
    answers: list[str]
    decoys: list[str]


# ---------------------------------------------------------------- the haystack


@lru_cache(maxsize=1)
def _paragraphs() -> tuple[str, ...]:
    """The prose paragraphs of the language reference (not code, grammar or tables), whitespace collapsed."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(block.split())
            prose = not block.startswith(" ") and len(text) >= _PROSE_MIN_CHARS and text.endswith(".")
            if prose and sum(c.isalpha() or c == " " for c in text) >= 0.85 * len(text):
                paragraphs.append(text)
    return tuple(dict.fromkeys(paragraphs))  # a few topics share paragraphs


def haystack_text() -> str:
    """The whole haystack once: the prose paragraphs in order, joined by blank lines."""
    return "\n\n".join(_paragraphs())


def haystack_id() -> str:
    """A short hash of the haystack: it comes with the running Python, and another version may change it."""
    return hashlib.sha256(haystack_text().encode()).hexdigest()[:12]


def _haystack_source(start: int) -> Callable[[int], str]:
    """The paragraphs from ``start`` on, joined by blank lines and repeated past the end, cut to ``chars``."""
    paragraphs = _paragraphs()

    def source(chars: int) -> str:
        pieces, total, i = [], 0, start
        while total < chars:
            pieces.append(paragraphs[i % len(paragraphs)])
            total += len(pieces[-1]) + 2
            i += 1
        return "\n\n".join(pieces)[:chars]

    return source


# ---------------------------------------------------------------- the facts of each task


def _people(draw: random.Random, n: int) -> list[tuple[str, str]]:
    """``n`` people as (full name, surname), distinct surnames."""
    return [(f"{draw.choice(_TITLES)} {surname}", surname) for surname in draw.sample(_SURNAMES, n)]


def _places(draw: random.Random, n: int) -> list[str]:
    """``n`` rooms, each of another name and on another deck."""
    return [f"{room} on deck {deck}" for room, deck in zip(draw.sample(_ROOMS, n), draw.sample(range(1, 13), n))]


def _codes(draw: random.Random, n: int) -> list[str]:
    return [str(v) for v in draw.sample(range(10000, 100000), n)]


def _single(draw: random.Random, distractors: int = 0) -> _Facts:
    places = _places(draw, 1 + distractors)
    codes = _codes(draw, len(places))
    facts = [draw.choice(_CODE_FACTS).format(place=p, value=c) for p, c in zip(places, codes)]
    question, prefix = (text.format(place=places[0]) for text in draw.choice(_CODE_QUESTIONS))
    return _Facts(facts, question, prefix, [codes[0]], codes[1:])


def _pair(draw: random.Random) -> _Facts:
    (person, _), item, container = _people(draw, 1)[0], draw.choice(_ITEMS), draw.choice(_CONTAINERS)
    extension = _codes(draw, 1)[0][:4]  # a 4-digit extension
    facts = [
        draw.choice(_KEEPS_FACTS).format(person=person, item=item, container=container),
        draw.choice(_EXTENSION_FACTS).format(person=person, value=extension),
    ]
    question, prefix = (text.format(person=person, item=item) for text in draw.choice(_PAIR_QUESTIONS))
    return _Facts(facts, question, prefix, [container, extension], [])


def _hop(draw: random.Random) -> _Facts:
    (person, _), place, code = _people(draw, 1)[0], _places(draw, 1)[0], _codes(draw, 1)[0]
    facts = [
        draw.choice(_WORKS_FACTS).format(person=person, place=place),
        draw.choice(_CODE_FACTS).format(place=place, value=code),
    ]
    question, prefix = (text.format(person=person) for text in draw.choice(_HOP_QUESTIONS))
    return _Facts(facts, question, prefix, [place, code], [])


def _list(draw: random.Random, n_speakers: int = 3) -> _Facts:
    people = _people(draw, n_speakers)
    language = draw.choice(_LANGUAGES)
    facts = [draw.choice(_SPEAKS_FACTS).format(person=p, language=language) for p, _ in people]
    question, prefix = (text.format(language=language) for text in draw.choice(_LIST_QUESTIONS))
    return _Facts(facts, question, prefix, [surname for _, surname in people], [])


_TASK_FACTS: dict[str, Callable[[random.Random], _Facts]] = {
    "fact_single": _single,
    "fact_distractors": partial(_single, distractors=4),
    "fact_pair": _pair,
    "fact_hop": _hop,
    "fact_list": _list,
}
assert tuple(_TASK_FACTS) == TASKS


def _builder(measure: Measure, rng: Callable[[str], random.Random], task: str) -> tuple[Builder, _Facts]:
    chosen = _TASK_FACTS[task](rng("facts"))
    facts = list(chosen.facts)
    rng("order").shuffle(facts)  # the order they appear in (a hop's code may come before its room)
    depths = sorted(rng("depths").sample(range(101), len(facts)))
    prefix = TokenPrefix(measure.tokenizer, _haystack_source(rng("start").randrange(len(_paragraphs()))))

    def build(n_tokens: int) -> Draft:
        context = f"{_PREAMBLE}\n\n{insert_at_depths(prefix(n_tokens), facts, depths)}"
        return Draft(context, chosen.question, chosen.answer_prefix, list(chosen.answers))

    return Builder(build, 0, 1.0), chosen


# ---------------------------------------------------------------- public API


def generate(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    n: int,
    seed: int = 0,
    *,
    max_length: int | None = None,
) -> list[FactSample]:
    """Generate ``n`` samples of a facts task whose prompts are about ``length`` tokens.

    Parameters
    ----------
    task : str
        One of ``TASKS``.
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer: lengths are measured in its tokens, on the chat-templated prompt.
    length : int
        Target prompt length in tokens; every prompt has ``(1 - LENGTH_TOLERANCE) * length`` to ``length`` tokens.
    n : int
        Number of samples.
    seed : int
        Seeds everything: same arguments (and Python's ``pydoc_data``, ``haystack_id``), same samples; and
        ``generate(..., n=k)`` is a prefix of ``generate(..., n=k + 1)``.
    max_length : int, optional
        The model's maximum context; default ``tokenizer.model_max_length``.

    Returns
    -------
    list of FactSample

    Raises
    ------
    CriticalKVError
        Unknown task; ``length`` not positive, above the maximum context, or too short for the instruction,
        facts and question.
    """
    if task not in _TASK_FACTS:
        raise CriticalKVError(f"Unknown facts task {task!r}; choose one of: {', '.join(TASKS)}.")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise CriticalKVError(f"length must be a positive number of tokens, got {length!r}.")
    if n < 0:
        raise CriticalKVError(f"n must be >= 0, got {n}.")
    limit = max_length if max_length is not None else getattr(tokenizer, "model_max_length", None)
    if limit is not None and length > limit:
        raise CriticalKVError(f"length {length} exceeds the model's maximum context of {limit} tokens.")
    measure = Measure(tokenizer)
    lo = math.ceil(length * (1 - LENGTH_TOLERANCE))
    samples: list[FactSample] = []
    start: int | None = None
    for index in range(n):

        def rng(purpose: str, index: int = index) -> random.Random:
            return random.Random(f"criticalkv-facts/{seed}/{task}/{index}/{purpose}")

        builder, chosen = _builder(measure, rng, task)
        best = fit_length(measure, builder, lo, length, start, partial(_too_short, task, length))
        start = best.size
        samples.append(
            FactSample(
                task=task,
                index=index,
                context=best.draft.context,
                question=best.draft.question,
                answer_prefix=best.draft.answer_prefix,
                answers=list(best.draft.answers),
                context_tokens=measure.count(best.draft.context),
                prompt_tokens=best.tokens,
                facts=list(chosen.facts),
                decoys=list(chosen.decoys),
            )
        )
    return samples


def _too_short(task: str, length: int, minimum: int) -> CriticalKVError:
    return CriticalKVError(
        f"length {length} is too short for {task}: its instruction, facts and question alone take {minimum} tokens."
    )


def score(sample: FactSample, prediction: str) -> float:
    """The share of ``sample.answers`` found in ``prediction`` (case-insensitive) x 100; 0 if it names a decoy."""
    if sample.decoys and string_match(sample.decoys, "part", prediction):
        return 0.0
    return string_match(sample.answers, "all", prediction)


def task_score(samples: Sequence[FactSample], predictions: Sequence[str]) -> float:
    """Mean ``score`` over the samples of one task (the benchmark's score = mean of the task scores)."""
    if len(samples) != len(predictions):
        raise CriticalKVError(f"{len(predictions)} predictions for {len(samples)} samples.")
    if not samples:
        raise CriticalKVError("No samples to score.")
    return sum(score(s, p) for s, p in zip(samples, predictions)) / len(samples)
