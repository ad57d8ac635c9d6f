"""How a document and a question become token ids: the document is the start of the chat template's user message
(compressed once, question-agnostic), the question the rest of it and the assistant's turn (never compressed)."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from criticalkv.prompts import chat_prompt_parts, encode_prompt_parts

#: a stand-in document when only the question's part of the template is wanted (the split does not depend on it)
_ANY_DOCUMENT = "document"


def document_ids(tokenizer: PreTrainedTokenizerBase, document: str) -> torch.Tensor:
    """(1, t) ids of the template's start through the document: what is compressed."""
    prefix, _ = chat_prompt_parts(tokenizer, document, "", answer_prefix="")
    ids, _ = encode_prompt_parts(tokenizer, prefix, "")
    return torch.tensor([ids])


def question_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> torch.Tensor:
    """(1, q) ids of the question, the end of the user turn and the assistant turn's start."""
    _, suffix = chat_prompt_parts(tokenizer, _ANY_DOCUMENT, question, answer_prefix="")
    _, ids = encode_prompt_parts(tokenizer, "", suffix)
    return torch.tensor([ids])


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> torch.Tensor:
    """(1, t) ids of a whole conversation with the generation prompt (a request without a stored context)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return torch.tensor([list(ids)])
    text = "\n\n".join(message["content"] for message in messages)
    return torch.tensor([tokenizer(text)["input_ids"]])


class TextStream:
    """Decodes tokens as they come and gives back only the new text, holding back an incomplete character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = 0  # characters already given out

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split over tokens: wait for its end
            return ""
        new, self.sent = text[self.sent :], len(text)
        return new

    def flush(self) -> str:
        """The text held back at the end (a character the answer left incomplete decodes as U+FFFD)."""
        text = self.text()
        new, self.sent = text[self.sent :], len(text)
        return new

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)
