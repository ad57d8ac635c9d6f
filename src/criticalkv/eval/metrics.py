"""LongBench v1 metrics, reimplemented to give the same numbers as THUDM's ``metrics.py``.

Every function takes one prediction and one gold answer and returns a score in [0, 1]; LongBench
takes the maximum over a sample's gold answers, averages over the samples and multiplies by 100 (see
``criticalkv.eval.longbench.score_predictions``). The behaviours below are THUDM's, quirks included:

* ``qa_f1_score``: SQuAD normalisation (lower-case, ASCII punctuation removed, the articles a/an/the
  removed, whitespace collapsed), then token-level F1.
* ``rouge_score``: ROUGE-L F of the ``rouge`` package (pltrdy/rouge, *not* Google's ``rouge-score``),
  called exactly as THUDM does; any error (empty prediction, recursion depth on long texts) gives 0.
* ``classification_score``: the class names that occur in the prediction are collected; names that
  are a substring of the gold class (but not equal to it) are removed while iterating over the same
  list, so -- as in THUDM's loop -- the element after a removed one is not examined; the score is
  ``1 / len(matches)`` when the gold class is among them, else 0. (THUDM's fallback branch for "no
  match" is unreachable there -- ``em_match_list != 0`` is always true -- so it is not reproduced.)
* ``retrieval_score``: the gold id is the number in ``"Paragraph <id>"``; score = occurrences of that
  id among all the numbers of the prediction / number of numbers.
* ``count_score``: numbers of the prediction equal to the gold count / number of numbers.
* ``code_sim_score``: the first line (after stripping leading newlines) that contains none of
  ````` ``, ``#``, ``//``, compared with fuzzywuzzy's ``fuzz.ratio`` / 100. ``fuzz.ratio`` is
  reproduced from the standard library -- ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())``
  with its guards (equal strings 100, an empty one 0) -- which is what fuzzywuzzy computes without
  the optional ``python-Levenshtein`` speed-up (THUDM's requirements do not install it). rapidfuzz's
  ``fuzz.ratio`` differs (an unrounded float, and Indel distance instead of difflib's matching blocks).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Sequence

from criticalkv.errors import CriticalKVError

__all__ = [
    "classification_score",
    "code_sim_score",
    "count_score",
    "fuzz_ratio",
    "normalize_answer",
    "qa_f1_score",
    "retrieval_score",
    "rouge_score",
    "token_f1",
]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_PARAGRAPH_ID = re.compile(r"Paragraph (\d+)")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop ASCII punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """F1 of two token lists, counting shared tokens with multiplicity (0 when none is shared)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Token F1 after ``normalize_answer`` (narrativeqa, qasper, multifieldqa_en, the multi-hop QAs, triviaqa)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def rouge_score(prediction: str, ground_truth: str, **_: object) -> float:
    """ROUGE-L F of the ``rouge`` package (gov_report, qmsum, multi_news, samsum); 0 when it raises."""
    from rouge import Rouge  # the package THUDM uses; imported lazily (only the summaries need it)

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # THUDM: a bare except -> 0 (empty texts, RecursionError on very long ones)
        return 0.0
    return float(scores["rouge-l"]["f"])


def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str], **_: object) -> float:
    """TREC: ``1 / #matched classes`` when the gold class is among the class names found in the prediction."""
    matches = [name for name in all_classes if name in prediction]
    # THUDM removes items from the list it is iterating over; a Python list iterator then skips the
    # element that slides into the removed one's place. Reproduced with an explicit index.
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)  # removes the first equal item, like list.remove in THUDM's loop
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def retrieval_score(prediction: str, ground_truth: str, **_: object) -> float:
    """PassageRetrieval-en: share of the prediction's numbers that equal the gold paragraph id."""
    found = _PARAGRAPH_ID.findall(ground_truth)
    if not found:
        raise CriticalKVError(f"a passage_retrieval answer must read 'Paragraph <n>', got {ground_truth!r}")
    numbers = _NUMBER.findall(prediction)
    return numbers.count(found[0]) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str, **_: object) -> float:
    """PassageCount: share of the prediction's numbers that equal the gold count."""
    numbers = _NUMBER.findall(prediction)
    return numbers.count(str(ground_truth)) / len(numbers) if numbers else 0.0


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` (pure-Python path): ``round(100 * SequenceMatcher ratio)``, 0..100."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio())


def code_sim_score(prediction: str, ground_truth: str, **_: object) -> float:
    """LCC / RepoBench-P: fuzzy ratio / 100 of the first line that is no fence or comment."""
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return fuzz_ratio(first, ground_truth) / 100
