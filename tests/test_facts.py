"""The facts benchmark: generated deterministically to a token length, scored, and swept from the command line."""

from __future__ import annotations

import json
import math

import pytest
from conftest import ONE_LAYER_LLAMA, save_random_llama
from typer.testing import CliRunner

from criticalkv.cli import app
from criticalkv.errors import CriticalKVError
from criticalkv.eval import facts
from criticalkv.eval.facts import TASKS, FactSample, generate, score, task_score
from criticalkv.prompts import encode_prompt

LENGTH = 1200


@pytest.fixture(scope="module")
def samples(tiny_tokenizer) -> dict[str, list[FactSample]]:
    return {task: generate(task, tiny_tokenizer, LENGTH, 3, seed=0) for task in TASKS}


def test_same_seed_same_samples_and_more_samples_extend_them(samples, tiny_tokenizer) -> None:
    for task in ("fact_single", "fact_hop"):
        assert generate(task, tiny_tokenizer, LENGTH, 2, seed=0) == samples[task][:2]
        assert generate(task, tiny_tokenizer, LENGTH, 3, seed=1) != samples[task]


def test_prompts_fit_the_length(samples, tiny_tokenizer) -> None:
    low = math.ceil(LENGTH * (1 - facts.LENGTH_TOLERANCE))
    for sample in (s for task in TASKS for s in samples[task]):
        prefix_ids, suffix_ids = encode_prompt(tiny_tokenizer, sample.context, sample.question, sample.answer_prefix)
        assert low <= len(prefix_ids) + len(suffix_ids) == sample.prompt_tokens <= LENGTH


def test_answers_are_in_the_context_and_the_question_paraphrases_the_facts(samples) -> None:
    for task in TASKS:
        for sample in samples[task]:
            context = sample.context.lower()
            assert all(answer.lower() in context for answer in sample.answers), (task, sample.answers)
            assert all(fact in sample.context for fact in sample.facts)
            assert not any(fact.rstrip(".").lower() in sample.question.lower() for fact in sample.facts)
            assert not any(answer.lower() in sample.question.lower() for answer in sample.answers)
            assert "magic" not in sample.context + sample.question  # not RULER's phrasing
    assert [len(samples[task][0].facts) for task in TASKS] == [1, 5, 2, 2, 3]


def test_no_answer_or_name_is_part_of_another() -> None:
    names = [name.lower() for name in facts._SURNAMES]
    assert len(set(names)) == len(names)
    assert not [(a, b) for a in names for b in names if a != b and a in b]


def test_haystack_is_the_language_reference() -> None:
    paragraphs = facts._paragraphs()
    assert len(paragraphs) > 300 and any('"try" statement' in p for p in paragraphs)
    assert len(facts.haystack_id()) == 12


def test_score_counts_answers_and_refuses_decoys() -> None:
    sample = FactSample("fact_list", 0, "c", "q", "Answer:", ["Okafor", "Tanaka"], 1, 1, decoys=["Novak"])
    assert score(sample, "Dr. okafor and Professor TANAKA") == 100.0
    assert score(sample, "Only Okafor.") == 50.0
    assert score(sample, "Okafor, Tanaka and Novak") == 0.0  # naming everyone is no answer
    single = FactSample("fact_single", 0, "c", "q", "Answer:", ["48213"], 1, 1)
    assert score(single, "The code is 48213.") == 100.0 and score(single, "48231") == 0.0
    assert task_score([sample, single], ["Tanaka", "48213"]) == 75.0
    with pytest.raises(CriticalKVError, match="predictions"):
        task_score([single], [])


def test_bad_arguments(tiny_tokenizer) -> None:
    with pytest.raises(CriticalKVError, match="Unknown facts task"):
        generate("fact_many", tiny_tokenizer, LENGTH, 1)
    with pytest.raises(CriticalKVError, match="too short for fact_list"):
        generate("fact_list", tiny_tokenizer, 60, 1)


def test_eval_facts_sweeps_index_major_and_reports(tmp_path, tiny_tokenizer) -> None:
    model = save_random_llama(tmp_path / "llama", tiny_tokenizer, **ONE_LAYER_LLAMA, max_position_embeddings=512)
    out = tmp_path / "facts"
    args = ["eval", "facts", "--model", str(model), "--tasks", "fact_single,fact_pair", "--samples", "2"]
    args += ["--length", "400", "--methods", "snapkv", "--budgets", "0.5", "--max-new-tokens", "2", "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    order = list(dict.fromkeys((r["index"], r["task"]) for r in rows))
    assert order == [(0, "fact_single"), (0, "fact_pair"), (1, "fact_single"), (1, "fact_pair")]
    assert {r["method"] for r in rows} == {"full", "snapkv"}
    settings = json.loads((out / "sweep.json").read_text())
    assert settings["benchmark"] == "facts" and settings["haystack"] == facts.haystack_id()
    assert "Facts-400" in (out / "report.md").read_text()
    assert CliRunner().invoke(app, ["report", str(out)]).exit_code == 0


def test_eval_facts_refuses_bad_input_before_loading() -> None:
    for args, message in (
        (["--tasks", "fact_single,fact_nope"], "unknown facts task(s) ['fact_nope']"),
        (["--samples", "0"], "--samples must be >= 1, got 0"),
        (["--mode", "both"], "--mode must be 'agnostic' or 'aware'"),
    ):
        result = CliRunner().invoke(app, ["eval", "facts", "--model", "/nonexistent", *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
