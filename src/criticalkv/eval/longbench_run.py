"""LongBench samples as the sweep runner answers them: THUDM's truncation and chat rule, split before the question.

``read_datasets`` reads local LongBench JSONL (one file, or a folder of ``<dataset>.jsonl`` files);
``longbench_items`` truncates and encodes every sample once, up front, so a max length too small for a sample's
question fails before the first answer. ``criticalkv eval longbench`` runs them through ``run_sweep``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError
from criticalkv.eval.longbench import (
    DATASETS,
    NEWLINE_STOP_DATASETS,
    LongBenchSample,
    dataset_key,
    load_longbench,
    prompt_parts,
    score_prediction,
    truncate_middle,
    uses_chat_template,
)
from criticalkv.eval.sweep import StopRule
from criticalkv.prompts import chat_split

__all__ = [
    "PROTOCOL",
    "LongBenchItem",
    "encode_sample",
    "longbench_items",
    "read_datasets",
    "score_item",
    "split_prompt_ids",
    "stop_rule",
    "task_name",
    "truncated_parts",
]


# The version of THUDM's protocol this module follows, kept in a run's sweep.json (see commands). 5: LongBench-E's
# rows by length bucket; 4: predictions scored (and stored) as decoded, not stripped; 3: non-samsum answers end at
# the model's generation_config eos.
PROTOCOL = 5


@dataclass(frozen=True)
class LongBenchItem:
    """One sample with its prompt ids, keyed for results.jsonl by (dataset, position in that dataset)."""

    task: str  # the sample's dataset, as its file names it; LongBench-E's with its length bucket (``task_name``)
    index: int  # the sample's position among that dataset's samples
    sample: LongBenchSample
    prefix_ids: list[int]  # template start and the (truncated) context: what question-agnostic compresses
    suffix_ids: list[int]  # the question part, the end of the user turn, the assistant's start


def read_datasets(path: Path, names: Sequence[str] = ()) -> dict[str, list[LongBenchSample]]:
    """The samples of each dataset under ``path``, in file order.

    Parameters
    ----------
    path : Path
        A LongBench JSONL file (possibly of several datasets), or a folder of ``<dataset>.jsonl`` files as
        published (files of datasets outside ``DATASETS``, such as the Chinese ones, are left alone).
    names : sequence of str
        Datasets to keep; empty: every dataset of the file, or every LongBench (v1) file of the folder. The
        published folder holds LongBench-E's ``<dataset>_e.jsonl`` beside them: read only when named (their rows
        are then scored per length bucket, as THUDM's ``scorer_e``: ``task_name``).

    Raises
    ------
    CriticalKVError
        The path is missing; a name is not a LongBench dataset; a named dataset has no file in the folder or no
        sample in the file; a file holds no sample.
    """
    for name in names:
        dataset_key(name)  # an unknown name fails before any file is read
    if not path.exists():
        raise CriticalKVError(f"LongBench data not found: {path}")
    if path.is_dir():
        files = [path / f"{name}.jsonl" for name in names] or sorted(
            f for f in path.glob("*.jsonl") if f.stem in DATASETS
        )
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CriticalKVError(f"no {', '.join(missing)} in {path}")
        if not files:
            raise CriticalKVError(
                f"no LongBench file in {path}; expected <dataset>.jsonl for one of {', '.join(DATASETS)}"
            )
    else:
        files = [path]
    groups: dict[str, list[LongBenchSample]] = {}
    for file in files:
        samples = load_longbench(file)
        if not samples:
            raise CriticalKVError(f"no samples in {file}")
        for sample in samples:
            groups.setdefault(sample.dataset, []).append(sample)
    if names and not path.is_dir():  # a folder's files were chosen by name
        absent = [name for name in names if name not in groups]
        if absent:
            raise CriticalKVError(f"no samples of {', '.join(absent)} in {path}")
        groups = {name: groups[name] for name in names}
    return groups


def truncated_parts(tokenizer: PreTrainedTokenizerBase, sample: LongBenchSample, max_length: int) -> tuple[str, str]:
    """THUDM's prompt after ``truncate_middle`` to ``max_length`` tokens, split before the question part.

    Returns ``prompt_parts(sample)`` when the prompt fits; else (the truncated prompt less the question part, the
    question part, as the decoding of its tokens gives it back). Raises ``CriticalKVError`` when the question part
    does not survive the truncation whole: it is longer than the ``max_length // 2`` tokens THUDM keeps at the end,
    or the truncated prompt ends with neither it nor its decoding.
    """
    head, tail = prompt_parts(sample)
    prompt = truncate_middle(tokenizer, head + tail, max_length)
    if prompt == head + tail:
        return head, tail
    where = f"{sample.dataset} sample {sample.id}"
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    if len(tail_ids) > max_length // 2:
        raise CriticalKVError(
            f"max length {max_length} is too small for {where}: its question part has {len(tail_ids)} tokens, a "
            f"truncated prompt keeps its last {max_length // 2}"
        )
    # the kept end is decoded text: a tokenizer whose decoding alters text (normalises, cleans up spaces) alters
    # the question in THUDM's prompt too
    for question in (tail, tokenizer.decode(tail_ids, skip_special_tokens=True)):
        if prompt.endswith(question):
            return prompt[: len(prompt) - len(question)], question
    raise CriticalKVError(f"{where}: its prompt truncated to {max_length} tokens no longer ends with the question")


def encode_sample(
    tokenizer: PreTrainedTokenizerBase, sample: LongBenchSample, max_length: int
) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of THUDM's prompt for ``sample``: truncated, then chat-templated where THUDM
    templates it (``uses_chat_template``, and the tokenizer has a template).

    Their concatenation is exactly the tokenization of the whole prompt in one call, as THUDM's ``pred.py`` feeds
    it (``split_prompt_ids``); the split falls at the token boundary before the question part.
    """
    head, tail = truncated_parts(tokenizer, sample, max_length)
    templated = uses_chat_template(sample.dataset) and bool(getattr(tokenizer, "chat_template", None))
    if templated:
        head, tail = chat_split(tokenizer, head, tail)
    # a raw prompt gets the tokenizer's special tokens (BOS) as in THUDM's pred.py; a template writes its own
    return split_prompt_ids(tokenizer, head, tail, add_special_tokens=not templated)


def split_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, head: str, tail: str, add_special_tokens: bool
) -> tuple[list[int], list[int]]:
    """The ids of ``head + tail`` tokenized in one call, split before the first token whose text reaches into
    ``tail``: a token straddling the boundary belongs to the tail part (the question, never compressed).

    Raises ``CriticalKVError`` for a tokenizer that gives no character offsets (not a fast tokenizer).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise CriticalKVError(
            f"LongBench needs a fast tokenizer (character offsets place the split before the question); "
            f"{type(tokenizer).__name__} is not one"
        )
    encoding = tokenizer(head + tail, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding.get("offset_mapping")
    if offsets is None or len(offsets) != len(ids):
        raise CriticalKVError(f"{type(tokenizer).__name__} gave no character offsets; cannot split the prompt")
    # offsets: (start, end) characters of each token in head + tail; special tokens added around it are (0, 0)
    cut = next((i for i, (_, end) in enumerate(offsets) if end > len(head)), len(ids))
    return ids[:cut], ids[cut:]


def longbench_items(
    tokenizer: PreTrainedTokenizerBase, groups: dict[str, list[LongBenchSample]], limit: int, max_length: int
) -> list[LongBenchItem]:
    """The first ``limit`` samples of each dataset (all for 0), encoded by ``encode_sample``."""
    return [
        LongBenchItem(task_name(dataset, sample), index, sample, *encode_sample(tokenizer, sample, max_length))
        for dataset, samples in groups.items()
        for index, sample in enumerate(samples[:limit] if limit else samples)
    ]


E_BUCKETS = ((4000, "0-4k"), (8000, "4-8k"))  # THUDM's scorer_e: by the sample's length (words), then "8k+"


def task_name(dataset: str, sample: LongBenchSample) -> str:
    """The row's task: the dataset, and for LongBench-E's ``<name>_e`` its length bucket (``"hotpotqa_e 4-8k"``), so
    the report's mean per task is THUDM's ``scorer_e`` per bucket."""
    if not dataset.endswith("_e"):
        return dataset
    bucket = next((name for limit, name in E_BUCKETS if sample.length < limit), "8k+")
    return f"{dataset} {bucket}"


def stop_rule(tokenizer: PreTrainedTokenizerBase, model_eos: int | list[int] | None, item: LongBenchItem) -> StopRule:
    """Where THUDM's ``pred.py`` ends the sample's answer: at the model's end-of-sequence tokens (``model_eos``, its
    ``generation_config.eos_token_id``, which ``generate`` stops at by default; a list on some chat models); on samsum
    (``NEWLINE_STOP_DATASETS``) at the tokenizer's end-of-sequence token or the last token of "\\n", neither as the
    first new token."""
    if dataset_key(item.sample.dataset) not in NEWLINE_STOP_DATASETS:
        return StopRule(model_eos)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return StopRule([*eos, newline], min_new_tokens=1)


def score_item(item: LongBenchItem, prediction: str) -> float:
    """The sample's THUDM score x 100 (``score_prediction``): the mean per dataset is ``score_samples``'."""
    sample = item.sample
    return 100 * score_prediction(sample.dataset, prediction, sample.answers, sample.all_classes)
