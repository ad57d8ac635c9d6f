"""LongBench v1 prompts, loading and THUDM's metrics, on small hand-made samples."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from criticalkv.errors import CriticalKVError
from criticalkv.eval import longbench
from criticalkv.eval.longbench import (
    DATASET2MAXLEN,
    DATASET2PROMPT,
    DATASETS,
    LongBenchSample,
    build_prompt,
    load_longbench,
    prompt_parts,
    score_prediction,
    score_predictions,
    score_samples,
)
from criticalkv.eval.metrics import (
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_score,
)

TREC_CLASSES = ["Location", "Other location", "City", "Country", "Individual"]


def record(**overrides) -> dict:
    base = {
        "input": "Who wrote it?",
        "context": "Passage 1:\nIt was written by {somebody}.",
        "answers": ["somebody"],
        "length": 7,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "abc123",
    }
    return base | overrides


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- metrics, values computed by hand


def test_qa_f1() -> None:
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    # "cat sat" vs "cat sat down": 2 shared tokens, P = 2/2, R = 2/3 -> F1 = 0.8
    assert qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert qa_f1_score("dog", "cat") == 0.0
    assert qa_f1_score("a the an", "the") == 0.0  # nothing left after normalisation
    # repeated tokens count with multiplicity: "a a b" vs "a b b" -> 2 shared of 3 and 3 -> 2/3
    assert qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)


def test_rouge_l_of_the_rouge_package() -> None:
    # LCS "quick fox jumps" = 3 words; 6 reference and 5 candidate words: R = 1/2, P = 3/5, F = 6/11
    assert rouge_score("a quick brown fox jumps", "the quick red fox jumps high") == pytest.approx(6 / 11, abs=1e-6)
    # the package counts distinct words (sets): LCS words {the, cat, on, mat} over 5 distinct words each
    # side -> 0.8, where Google's rouge-score would give 5/6
    assert rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-6)
    assert rouge_score("", "a summary") == 0.0  # the package raises on an empty hypothesis -> 0
    assert rouge_score("...", "a summary") == 0.0


def test_classification_score() -> None:
    assert classification_score("City", "City", all_classes=TREC_CLASSES) == 1.0
    # tie: two class names found, the gold one among them -> 1/2
    assert classification_score("City or Country", "City", all_classes=TREC_CLASSES) == 0.5
    assert classification_score("Country", "City", all_classes=TREC_CLASSES) == 0.0
    assert classification_score("no idea", "City", all_classes=TREC_CLASSES) == 0.0
    # matching is case-sensitive: "Location" is not found in "Other location" -> 1/1
    assert classification_score("Other location", "Other location", all_classes=TREC_CLASSES) == 1.0
    # a found name inside the gold name is dropped: "location" in "other location" -> 1/1
    assert classification_score("other location", "other location", all_classes=["location", "other location"]) == 1.0
    # THUDM's loop removes from the list it iterates: after dropping "loc", "location" slides into
    # its place and is never examined, so it stays -> 1/2 (a plain filter would give 1.0)
    classes = ["loc", "location", "other location"]
    assert classification_score("other location", "other location", all_classes=classes) == 0.5


def test_retrieval_and_count() -> None:
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    assert retrieval_score("Paragraph 3", "Paragraph 12") == 0.0
    assert retrieval_score("I do not know", "Paragraph 12") == 0.0
    assert count_score("There are 7 unique paragraphs out of 10.", "7") == 0.5
    assert count_score("7", "7") == 1.0
    assert count_score("seven", "7") == 0.0
    with pytest.raises(CriticalKVError, match="Paragraph"):
        retrieval_score("1", "12")


def test_code_sim_first_code_line() -> None:
    prediction = "\n\n```python\n# the next line\n// not this either\n    return x + 1\nprint(x)"
    assert code_sim_score(prediction, "    return x + 1") == 1.0  # fence, '#' and '//' lines skipped
    # difflib ratio 2 * 7 / 16 = 0.875 -> fuzzywuzzy rounds to 88 (round half to even) -> 0.88
    assert fuzz_ratio("return a", "return b") == 88
    assert code_sim_score("return a", "return b") == 0.88
    assert code_sim_score("# only comments", "x = 1") == 0.0  # no code line: "" vs gold -> 0
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("", "x") == 0


def test_fuzz_ratio_matches_fuzzywuzzy() -> None:
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz", reason="fuzzywuzzy not installed: cross-check skipped")
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choices("ab cd(x)=_.", k=rng.randint(0, 30)))
        b = "".join(rng.choices("ab cd(x)=_.", k=rng.randint(0, 30)))
        assert fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)


def test_first_line_max_over_answers_and_mean() -> None:
    # triviaqa: first line only; hotpotqa: the whole prediction
    assert score_prediction("triviaqa", "\nParis\nLondon is wrong", ["Paris"]) == 1.0
    assert score_prediction("hotpotqa", "\nParis\nLondon is wrong", ["Paris"]) == pytest.approx(0.4)  # P 1/4, R 1
    assert score_prediction("trec", "Country\nCity", ["City"], TREC_CLASSES) == 0.0
    assert score_prediction("trec", "City\nCountry", ["City"], TREC_CLASSES) == 1.0
    samsum = "Anna will bring the cake.\nDialogue: more text"
    assert score_prediction("samsum", samsum, ["Anna will bring the cake"]) == pytest.approx(1.0, abs=1e-6)
    assert score_prediction("hotpotqa", "cat", ["dog", "the cat"]) == 1.0  # max over gold answers
    assert score_prediction("passage_retrieval_en", "Paragraph 4", ["Paragraph 4"]) == 1.0
    assert score_predictions("hotpotqa", ["cat", "dog", "the cat sat"], [["cat"], ["cat"], ["a cat sat down"]]) == (
        pytest.approx(100 * (1 + 0 + 0.8) / 3)
    )
    samples = [
        LongBenchSample("q", "c", ["cat"], 1, "hotpotqa", "en", None, "1"),
        LongBenchSample("q", "c", ["7"], 1, "passage_count", "en", None, "2"),
    ]
    assert score_samples(samples, ["cat", "7 or 8"]) == {"hotpotqa": 100.0, "passage_count": 50.0, "average": 75.0}
    with pytest.raises(CriticalKVError, match="Unknown LongBench dataset 'dureader'"):
        score_prediction("dureader", "x", ["x"])


# ---------------------------------------------------------------- prompts and files


def test_prompt_tables() -> None:
    assert set(DATASETS) == set(DATASET2PROMPT) == set(DATASET2MAXLEN) == set(longbench.DATASET2METRIC)
    assert len(DATASETS) == 16
    assert DATASET2MAXLEN["gov_report"] == 512 and DATASET2MAXLEN["hotpotqa"] == 32 and DATASET2MAXLEN["samsum"] == 128
    assert DATASET2PROMPT["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    for dataset, template in DATASET2PROMPT.items():
        assert template.count("{context}") == 1, dataset
    assert not longbench.uses_chat_template("lcc") and longbench.uses_chat_template("qasper")
    assert longbench.max_new_tokens("qasper_e") == 128  # LongBench-E names map to the v1 configs


def test_load_and_build_prompt(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "hotpotqa.jsonl",
        [json.dumps(record()), "", json.dumps(record(dataset="trec", all_classes=TREC_CLASSES, _id="x2"))],
    )
    samples = load_longbench(path)
    assert [s.id for s in samples] == ["abc123", "x2"] and samples[1].all_classes == TREC_CLASSES
    prompt = build_prompt(samples[0])  # braces inside the context are left alone
    assert prompt == DATASET2PROMPT["hotpotqa"].replace("{context}", samples[0].context).replace(
        "{input}", "Who wrote it?"
    )
    head, tail = prompt_parts(samples[0])
    assert head + tail == prompt and head.endswith(samples[0].context) and "Who wrote it?" in tail
    lcc = LongBenchSample("", "def f():\n", ["    return 1"], 2, "lcc", "python", None, "3")
    assert prompt_parts(lcc) == ("Please complete the code given below. \ndef f():\n", "Next line of code:\n")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2: not valid JSON"),
        (json.dumps({k: v for k, v in record().items() if k != "answers"}), r"line 2: missing field 'answers'"),
        (json.dumps(record(length="7")), r"line 2: field 'length' has type str"),
        (json.dumps(record(answers=[1])), r"line 2: field 'answers' must be a list of strings"),
        (json.dumps(record(dataset="vcsum")), r"Unknown LongBench dataset 'vcsum'"),
        (json.dumps(record(dataset="trec")), r"line 2: trec needs 'all_classes'"),
        ("[1, 2]", r"line 2: expected a JSON object"),
    ],
)
def test_load_rejects_malformed_lines(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(record()), line])
    with pytest.raises(CriticalKVError, match=message):
        load_longbench(path)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CriticalKVError, match="not found"):
        load_longbench(tmp_path / "nope.jsonl")


def test_truncate_middle(tiny_tokenizer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    assert longbench.truncate_middle(tiny_tokenizer, "The fox.", 100) == "The fox."
    ids = tiny_tokenizer(prompt)["input_ids"]
    cut = longbench.truncate_middle(tiny_tokenizer, prompt, 40)
    assert cut == tiny_tokenizer.decode(ids[:20], skip_special_tokens=True) + tiny_tokenizer.decode(
        ids[-20:], skip_special_tokens=True
    )
