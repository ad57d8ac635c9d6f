"""criticalkv.encode_prompt: a context and a question in one chat-templated user message, split where the context
ends; the answer prefix optional, the separator a parameter."""

from __future__ import annotations

import pytest

import criticalkv
from criticalkv.prompts import chat_prompt_parts, encode_prompt


@pytest.fixture(scope="module")
def templated(tiny_tokenizer):
    """The tiny tokenizer with a minimal chat template: ``<s>user: {content}</s>assistant: ``."""
    tokenizer = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    tokenizer.chat_template = (
        "<s>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def test_the_package_exports_it() -> None:
    assert criticalkv.encode_prompt is encode_prompt


def test_the_parts_join_into_the_rendered_template(templated) -> None:
    """Split where the context ends, the two parts are exactly the template's rendering of one user message
    ``context + "\\n\\n" + question`` (the default separator), with nothing after the assistant's start."""
    context, question = "The fox is brown.", "What colour is the fox?"
    prefix, suffix = chat_prompt_parts(templated, context, question)
    message = [{"role": "user", "content": f"{context}\n\n{question}"}]
    assert prefix + suffix == templated.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    assert prefix.endswith(context) and suffix.startswith("\n\n" + question)


def test_separator_and_answer_prefix(templated) -> None:
    prefix, suffix = chat_prompt_parts(templated, "Ctx.", "Q?", answer_prefix="A:", separator=" | ")
    assert prefix == "<s>user: Ctx." and suffix == " | Q?</s>assistant: A:"
    context_ids, question_ids = encode_prompt(templated, "Ctx.", "Q?", answer_prefix="A:", separator=" | ")
    assert context_ids == templated(prefix, add_special_tokens=False)["input_ids"]  # the template writes the BOS
    assert question_ids == templated(suffix, add_special_tokens=False)["input_ids"]


def test_default_separator_keeps_the_needle_prompts(tiny_tokenizer) -> None:
    """The default is the blank line every measured prompt used: passing it explicitly changes nothing."""
    args = (tiny_tokenizer, "Some context.", "Question?", "Answer:")
    assert encode_prompt(*args) == encode_prompt(*args, separator="\n\n")
    assert chat_prompt_parts(tiny_tokenizer, "Some context.", "Question?") == ("Some context.", "\n\nQuestion?")
