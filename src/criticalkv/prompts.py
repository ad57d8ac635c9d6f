"""Encoding a prompt the way criticalkv's commands do: a context and a question in one chat-templated user message,
split where the context ends, so that the context can be prefilled (and compressed) before the question is seen.

    context_ids, question_ids = criticalkv.encode_prompt(tokenizer, document, "Who wrote it?")

``context_ids + question_ids`` is the whole prompt (the question-aware regime compresses it all); ``context_ids``
alone is what the question-agnostic regime compresses, the question's ids then read that compressed cache.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError

SEPARATOR = "\n\n"  # between the context and the question in the user message
_SPLIT_MARKER = "\ue000CRITICALKV-SPLIT\ue000"  # private-use chars: never in real text


def chat_split(tokenizer: PreTrainedTokenizerBase, head: str, tail: str) -> tuple[str, str]:
    """The chat-templated prompt of the user message ``head + tail`` (with the generation prompt), split where
    ``head`` ends: (template start + ``head``, ``tail`` + end of the user turn + assistant start).

    The template is rendered once with a marker between the two, so the parts join into exactly the templated
    prompt. Raises ``CriticalKVError`` when the template alters the marker.
    """
    message = {"role": "user", "content": f"{head}{_SPLIT_MARKER}{tail}"}
    full = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
    if not isinstance(full, str) or full.count(_SPLIT_MARKER) != 1:
        raise CriticalKVError("The chat template altered the split marker; cannot split the prompt.")
    prefix, suffix = full.split(_SPLIT_MARKER)
    return prefix, suffix


def chat_prompt_parts(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    answer_prefix: str = "",
    separator: str = SEPARATOR,
) -> tuple[str, str]:
    """Split a chat-templated prompt into a context part and a question part.

    The user message is ``context + separator + question``; the template is rendered once with a marker after
    the context and split there, so ``prefix + suffix`` is exactly the templated prompt followed by
    ``answer_prefix``. Without a chat template the parts are plain text (``answer_prefix`` after a blank line).

    Tokenize the parts separately: ``prefix`` with ``add_special_tokens=False`` when the tokenizer has a chat
    template (the template already writes its own BOS) and ``True`` otherwise; ``suffix`` always with
    ``add_special_tokens=False`` (``encode_prompt_parts`` does both).

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
    context : str
        The long document.
    question : str
    answer_prefix : str
        Written after the assistant turn's start to prime the answer (e.g. a needle sample's
        ``answer_prefix``); empty by default.
    separator : str
        Between the context and the question, inside the user message: a blank line by default.

    Returns
    -------
    (str, str)
        ``prefix`` (template start through the context) and ``suffix`` (separator, question, end of user turn,
        assistant start, answer prefix).
    """
    if not getattr(tokenizer, "chat_template", None):
        return context, f"{separator}{question}\n\n{answer_prefix}".rstrip("\n")
    prefix, suffix = chat_split(tokenizer, context, f"{separator}{question}")
    return prefix, suffix + answer_prefix


def encode_prompt_parts(tokenizer: PreTrainedTokenizerBase, prefix: str, suffix: str) -> tuple[list[int], list[int]]:
    """Token ids of ``chat_prompt_parts``' output: ``prefix`` ids (with BOS exactly once) and ``suffix`` ids (no
    special tokens added)."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    prefix_ids = tokenizer(prefix, add_special_tokens=not templated)["input_ids"]
    suffix_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    return prefix_ids, suffix_ids


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    answer_prefix: str = "",
    separator: str = SEPARATOR,
) -> tuple[list[int], list[int]]:
    """Context ids and question ids of a chat-templated prompt: ``chat_prompt_parts`` then ``encode_prompt_parts``.

    ``context_ids + question_ids`` is the whole prompt (question-aware); ``context_ids`` alone is what a
    question-agnostic run compresses before the question is seen. ``answer_prefix`` (optional) primes the
    answer; ``separator`` stands between the context and the question (a blank line by default).
    """
    prefix, suffix = chat_prompt_parts(tokenizer, context, question, answer_prefix, separator)
    return encode_prompt_parts(tokenizer, prefix, suffix)


def text_token_span(tokenizer: PreTrainedTokenizerBase, prefix: str, text: str, n_tokens: int) -> tuple[int, int]:
    """Token span [start, end) of the first occurrence of ``text`` in ``prefix``, as ``encode_prompt_parts`` encodes
    the prefix into ``n_tokens`` tokens (the needle sentence, or the needle's number)."""
    start_char = prefix.find(text)
    if start_char < 0:
        raise CriticalKVError(f"{text!r} is not in the prompt prefix")
    end_char = start_char + len(text)
    templated = bool(getattr(tokenizer, "chat_template", None))
    enc = tokenizer(prefix, add_special_tokens=not templated, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if len(offsets) != n_tokens:
        raise CriticalKVError("tokenizing the prefix with offsets gave another tokenization")
    inside = [i for i, (a, b) in enumerate(offsets) if b > start_char and a < end_char and b > a]
    return inside[0], inside[-1] + 1
