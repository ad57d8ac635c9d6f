"""Faults a user or the machine injects, each answered by a clear refusal or a clean state (the hardening issue)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_runtime import _ids, _model

from criticalkv.budget import Budget
from criticalkv.errors import CacheStateError, UnsupportedModelError
from criticalkv.models import load_model
from criticalkv.runtime.session import ContextSession


class _Interrupt:
    """A forward hook that raises ``KeyboardInterrupt`` on its ``nth`` call."""

    def __init__(self, nth: int) -> None:
        self.nth, self.calls = nth, 0

    def __call__(self, *args: object) -> None:
        self.calls += 1
        if self.calls == self.nth:
            raise KeyboardInterrupt


@pytest.mark.parametrize(("family", "method"), [("llama", "snapkv"), ("llama", "full"), ("gemma3", "critical-snapkv")])
def test_interrupted_ask_leaves_the_context_clean(family, method):
    """Ctrl-C on the 4th forward of an answer (after the first layer, before the second: a half-appended step) leaves
    the cache as it was: the next answer equals an uninterrupted session's."""
    model = _model(family)
    context, question, other = _ids(40, seed=1), _ids(5, seed=2), _ids(7, seed=3)
    reference = ContextSession(model, method, 0.5)
    reference.prefill(context)
    expected = reference.ask(question, max_new_tokens=6)
    session = ContextSession(model, method, 0.5)
    session.prefill(context)
    hook = model.model.layers[0].register_forward_hook(_Interrupt(4))
    try:
        with pytest.raises(KeyboardInterrupt):
            session.ask(other, max_new_tokens=6)
    finally:
        hook.remove()
    assert session.cache.get_seq_length() == 40
    answer = session.ask(question, max_new_tokens=6)
    assert torch.equal(answer.tokens, expected.tokens)
    assert session.kv_entries() == reference.kv_entries()


def test_interrupted_prefill_is_not_answered_on():
    """A prefill stopped part-way leaves no context to answer on: ``ask`` refuses instead of using half a cache."""
    model = _model("llama")
    session = ContextSession(model, "snapkv", 0.5)
    hook = model.model.layers[1].register_forward_hook(_Interrupt(1))
    try:
        with pytest.raises(KeyboardInterrupt):
            session.prefill(_ids(40, seed=1))
    finally:
        hook.remove()
    with pytest.raises(CacheStateError, match="prefill"):
        session.ask(_ids(5, seed=2))


def _remote_code_folder(folder: Path) -> Path:
    """A model folder whose config names an unknown model type and its own code (``auto_map``); that code, if ever
    run, creates ``ran.marker`` beside it."""
    folder.mkdir()
    marker = folder / "ran.marker"
    code = f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
    code += "from transformers import PretrainedConfig\n\n\nclass EvilConfig(PretrainedConfig):\n"
    code += "    model_type = 'evil'\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(code)
    auto_map = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": auto_map}))
    return folder


def test_a_folder_of_remote_code_is_refused_without_running_it(tmp_path, monkeypatch):
    """A folder with ``auto_map`` and an unknown model type: refused, with no "run the custom code? [y/N]" prompt (a
    user answering yes to it ran the folder's code) and without running the code."""
    folder = _remote_code_folder(tmp_path / "evil")
    monkeypatch.setattr("builtins.input", lambda *args: "y")  # a user who would answer yes to transformers' prompt
    with pytest.raises(UnsupportedModelError, match="auto_map"):
        load_model(str(folder))
    assert not (folder / "ran.marker").exists()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("decimal", ["0.7", "0.2", "0.35", "0.1", "0.9"])
def test_numpy_budgets_keep_what_their_decimal_says(dtype, decimal):
    """A numpy scalar budget keeps what its decimal keeps: float32 0.7 of 1000 is 700 entries, not 699."""
    lengths = torch.tensor([1000, 4095, 37])
    expected = Budget(float(decimal)).entries_for(lengths)
    assert torch.equal(Budget(dtype(decimal)).entries_for(lengths), expected)
    assert torch.equal(Budget.parse(dtype(decimal)).entries_for(lengths), expected)


def test_a_float32_budget_of_0_7_keeps_700_of_1000():
    assert int(Budget(np.float32(0.7)).entries_for(torch.tensor([1000]))[0]) == 700
