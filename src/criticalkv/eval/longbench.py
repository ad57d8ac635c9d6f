"""LongBench v1 (English and code subsets) from local JSONL files, with THUDM's prompts and scoring.

LongBench cannot be downloaded offline; users who have the published files (``data/<dataset>.jsonl``
of the ``THUDM/LongBench`` dataset, one JSON object per line with the fields ``input``, ``context``,
``answers``, ``length``, ``dataset``, ``language``, ``all_classes``, ``_id``) load them with
``load_longbench``. Prompts (``DATASET2PROMPT``) and generation lengths (``DATASET2MAXLEN``) are the
data of THUDM's ``config/dataset2prompt.json`` and ``config/dataset2maxlen.json``; they must stay
identical to THUDM's. Scoring follows THUDM's ``eval.py``: the metric of the dataset, maximum over
the gold answers, only the first line of the prediction for trec / triviaqa / samsum, mean x 100.

THUDM's ``pred.py`` also (1) applies no chat template on trec, triviaqa, samsum, lsht, lcc and
repobench-p (``uses_chat_template``), (2) truncates over-long prompts in the middle
(``truncate_middle``) and (3) ends samsum's answers at a line break too, after at least one new token
(``NEWLINE_STOP_DATASETS``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from criticalkv.errors import CriticalKVError
from criticalkv.eval.metrics import (
    classification_score,
    code_sim_score,
    count_score,
    qa_f1_score,
    retrieval_score,
    rouge_score,
)

__all__ = [
    "DATASET2MAXLEN",
    "DATASET2METRIC",
    "DATASET2PROMPT",
    "DATASETS",
    "FIRST_LINE_DATASETS",
    "NEWLINE_STOP_DATASETS",
    "LongBenchSample",
    "build_prompt",
    "dataset_key",
    "load_longbench",
    "max_new_tokens",
    "prompt_parts",
    "score_prediction",
    "score_predictions",
    "score_samples",
    "truncate_middle",
    "uses_chat_template",
]

DATASETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip

# THUDM/LongBench config/dataset2prompt.json (v1), English and code entries. Must match THUDM's text
# character for character. narrativeqa keeps the release's "asconcisely" (no space), as in the copies
# SnapKV, PyramidKV and AdaKV evaluate with; a later THUDM commit spells it "as concisely".
_PASSAGES_QA = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other "
    "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
    'answered based on the information in the article, write "unanswerable". If the question is a yes/no '
    'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
        "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
        "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\n"
        f"Article: {{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\n"
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based "
        "on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
        "Answer:"
    ),
    "hotpotqa": _PASSAGES_QA,
    "2wikimqa": _PASSAGES_QA,
    "musique": _PASSAGES_QA,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
        "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the "
        "final count of unique paragraphs after removing duplicates. The output format should only contain the "
        "number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: "
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# THUDM/LongBench config/dataset2maxlen.json: max_new_tokens per dataset.
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip

Metric = Callable[..., float]
# THUDM/LongBench eval.py dataset2metric.
DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score, "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score, "musique": qa_f1_score, "gov_report": rouge_score, "qmsum": rouge_score,
    "multi_news": rouge_score, "trec": classification_score, "triviaqa": qa_f1_score, "samsum": rouge_score,
    "passage_count": count_score, "passage_retrieval_en": retrieval_score, "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}  # fmt: skip

FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})  # scored on the first line only
# pred.py generates these with eos_token_id=[eos, last token of "\n"] and min_length=prompt length + 1: the answer
# ends at its first line break, which cannot be its first token
NEWLINE_STOP_DATASETS = frozenset({"samsum"})
_NO_CHAT_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "input": str,
    "context": str,
    "answers": list,
    "length": int,
    "dataset": str,
    "language": str,
    "all_classes": (list, type(None)),
    "_id": str,
}


@dataclass(frozen=True)
class LongBenchSample:
    """One LongBench record (the published JSONL fields; ``_id`` is ``id`` here)."""

    input: str
    context: str
    answers: list[str]
    length: int  # words (English) as published, not tokens
    dataset: str
    language: str
    all_classes: list[str] | None
    id: str


def dataset_key(dataset: str) -> str:
    """The THUDM config key of a dataset name (LongBench-E's ``<name>_e`` maps to ``<name>``).

    Raises ``CriticalKVError`` for a name outside ``DATASETS`` (and their ``_e`` versions)."""
    key = dataset.removesuffix("_e") if dataset.removesuffix("_e") in DATASET2PROMPT else dataset
    if key not in DATASET2PROMPT:
        raise CriticalKVError(
            f"Unknown LongBench dataset {dataset!r}; supported (English and code): {', '.join(DATASETS)}."
        )
    return key


def load_longbench(path: str | Path) -> list[LongBenchSample]:
    """Read a LongBench JSONL file in the published format.

    Parameters
    ----------
    path : str or Path
        A ``<dataset>.jsonl`` file of LongBench v1 (or LongBench-E): one JSON object per line with the
        fields ``input``, ``context``, ``answers`` (list of str), ``length``, ``dataset``, ``language``,
        ``all_classes`` (list of str or null) and ``_id``. Blank lines are skipped.

    Returns
    -------
    list of LongBenchSample

    Raises
    ------
    CriticalKVError
        The file is missing, a line is not JSON, a field is missing or has the wrong type, or the
        dataset is not one of ``DATASETS``; the message names the file, the line and the field.
    """
    path = Path(path)
    if not path.is_file():
        raise CriticalKVError(f"LongBench file not found: {path}")
    samples: list[LongBenchSample] = []
    with path.open("rb") as handle:  # decoded line by line: a bad byte is reported with its line
        for number, raw in enumerate(handle, start=1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CriticalKVError(
                    f"{where}: not UTF-8 text (byte {raw[error.start]:#04x} at column {error.start})."
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CriticalKVError(f"{where}: not valid JSON ({error.msg}).") from error
            if not isinstance(record, dict):
                raise CriticalKVError(f"{where}: expected a JSON object, got {type(record).__name__}.")
            for field, kind in _FIELDS.items():
                if field not in record:
                    raise CriticalKVError(f"{where}: missing field {field!r} (LongBench needs {', '.join(_FIELDS)}).")
                value = record[field]
                if not isinstance(value, kind) or (field == "length" and isinstance(value, bool)):
                    raise CriticalKVError(f"{where}: field {field!r} has type {type(value).__name__}.")
            for field in ("answers", "all_classes"):
                if record[field] is not None and not all(isinstance(item, str) for item in record[field]):
                    raise CriticalKVError(f"{where}: field {field!r} must be a list of strings.")
            if not record["answers"]:
                raise CriticalKVError(f"{where}: field 'answers' is empty.")
            if dataset_key(record["dataset"]) == "trec" and not record["all_classes"]:
                raise CriticalKVError(f"{where}: trec needs 'all_classes' (the class names).")
            samples.append(
                LongBenchSample(
                    input=record["input"],
                    context=record["context"],
                    answers=list(record["answers"]),
                    length=record["length"],
                    dataset=record["dataset"],
                    language=record["language"],
                    all_classes=None if record["all_classes"] is None else list(record["all_classes"]),
                    id=record["_id"],
                )
            )
    return samples


def build_prompt(sample: LongBenchSample) -> str:
    """The dataset's THUDM prompt with the sample's ``context`` and ``input`` filled in."""
    return DATASET2PROMPT[dataset_key(sample.dataset)].format(context=sample.context, input=sample.input)


def prompt_parts(sample: LongBenchSample) -> tuple[str, str]:
    """``build_prompt`` split after the context: (template start + context, rest with the question).

    For question-agnostic compression the first part is prefilled and compressed before the second is
    seen. ``head + tail == build_prompt(sample)``; for lcc the tail is just "Next line of code:\\n".
    """
    template = DATASET2PROMPT[dataset_key(sample.dataset)]
    head, tail = template.split("{context}")
    return head.format(input=sample.input) + sample.context, tail.format(input=sample.input)


def uses_chat_template(dataset: str) -> bool:
    """False for the few-shot and code sets, on which THUDM's ``pred.py`` feeds the raw prompt."""
    return dataset_key(dataset) not in _NO_CHAT_DATASETS


def max_new_tokens(dataset: str) -> int:
    """THUDM's generation length for ``dataset``."""
    return DATASET2MAXLEN[dataset_key(dataset)]


def truncate_middle(tokenizer, prompt: str, max_length: int) -> str:
    """THUDM's truncation: keep the first and last ``max_length // 2`` tokens of an over-long prompt."""
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def score_prediction(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """One sample's score in [0, 1]: the dataset's metric, maximum over the gold ``answers``.

    trec, triviaqa and samsum are scored on the first line of the prediction only.
    """
    key = dataset_key(dataset)
    if key in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[key]
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return score


def score_predictions(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """A dataset's LongBench score: mean sample score x 100 (THUDM rounds it to 2 decimals for display)."""
    if len(predictions) != len(answers):
        raise CriticalKVError(f"{len(predictions)} predictions for {len(answers)} answer lists.")
    if not predictions:
        raise CriticalKVError("No predictions to score.")
    total = sum(score_prediction(dataset, p, a, all_classes) for p, a in zip(predictions, answers))
    return 100 * total / len(predictions)


def score_samples(samples: Sequence[LongBenchSample], predictions: Sequence[str]) -> dict[str, float]:
    """Scores per dataset (x 100) for samples of possibly several datasets, plus their ``"average"``."""
    if len(samples) != len(predictions):
        raise CriticalKVError(f"{len(predictions)} predictions for {len(samples)} samples.")
    groups: dict[str, list[float]] = {}
    for sample, prediction in zip(samples, predictions):
        key = dataset_key(sample.dataset)
        groups.setdefault(key, []).append(score_prediction(key, prediction, sample.answers, sample.all_classes))
    scores = {key: 100 * sum(values) / len(values) for key, values in groups.items()}
    if scores:
        scores["average"] = sum(scores.values()) / len(scores)
    return scores
