"""Faults a user or the machine injects, each answered by a clear refusal or a clean state (the hardening issue)."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_merge import SETTINGS
from test_runtime import FAMILIES, VOCAB, _ids, _model
from test_sweep_folders import _score, _sweep_setup
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from criticalkv import Method, compress
from criticalkv.budget import Budget
from criticalkv.cli import app
from criticalkv.errors import (
    CacheStateError,
    CriticalKVError,
    MethodOptionError,
    UnknownMethodError,
    UnreadableFileError,
    UnsupportedModelError,
)
from criticalkv.eval import method_record, sweep
from criticalkv.eval.longbench import load_longbench
from criticalkv.eval.sweep import load_rows, run_sweep, stored_settings
from criticalkv.methods import build_method
from criticalkv.models import load_model
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill
from criticalkv.scorers import SnapKVScorer


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


class _FullDiskFile:
    """A file opened for writing whose writes fail as on a full disk (after the open truncated it, if it did)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str) -> object:
        return getattr(self.handle, name)


@pytest.fixture
def full_disk(monkeypatch):
    """Call it to fill the disk: every file then opened for writing through ``Path.open`` (``write_text``
    included) fails to write."""
    real = Path.open

    def open_(self, mode="r", *args, **kwargs):
        handle = real(self, mode, *args, **kwargs)
        return _FullDiskFile(handle) if any(c in mode for c in "wxa") else handle

    return lambda: monkeypatch.setattr(Path, "open", open_)


def test_a_full_disk_leaves_the_sweep_folder_files_whole(tmp_path, full_disk):
    """methods.json and sweep.json rewritten on a full disk: the write fails, and the old files stay whole (they were
    truncated to 0 bytes, and every later resume crashed on them), with no temporary file left."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / "methods.json").write_bytes(json.dumps({"snapkv": "old"}).encode())
    (folder / "sweep.json").write_bytes(json.dumps(SETTINGS).encode())
    before = sorted(p.name for p in folder.iterdir())
    full_disk()
    with pytest.raises(OSError, match="No space"):
        method_record.record(folder, {"tova": "new"})
    with pytest.raises(OSError, match="No space"):
        sweep._record_settings(folder, {**SETTINGS, "seed": 1})
    assert method_record.recorded(folder) == {"snapkv": "old"}
    assert stored_settings(folder) == SETTINGS
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("name", ["methods.json", "sweep.json"])
@pytest.mark.parametrize("content", [b"", b'{"snapkv": "Method(', b"\xff\xfe{}"])
def test_a_damaged_sweep_file_is_named_when_resuming(tmp_path, tiny_tokenizer, name, content):
    """A 0-byte, truncated or non-UTF-8 methods.json / sweep.json: the resume fails with an error naming the file
    (it was a raw JSONDecodeError), before any sample is answered."""
    model, samples, kwargs = _sweep_setup(tiny_tokenizer, tmp_path / "sweep")
    run_sweep(model, tiny_tokenizer, samples[:1], _score, **kwargs)
    (tmp_path / "sweep" / name).write_bytes(content)
    with pytest.raises(UnreadableFileError, match=re.escape(str(tmp_path / "sweep" / name))):
        run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)
    assert len(load_rows(tmp_path / "sweep" / "results.jsonl")) == 2


class _Tampered(SnapKVScorer):
    """SnapKV's scores with one real, unprotected position set to ``value`` (or cast to ``dtype``)."""

    def __init__(self, value: float | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(window=4)
        self.value, self.dtype = value, dtype

    def score(self, view):
        scores = super().score(view)  # (b, h_kv, t)
        if self.value is not None:
            scores[:, 0, 3] = self.value
        return scores if self.dtype is None else (scores * 1000).to(self.dtype)


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), float("inf")])
def test_non_finite_scores_of_a_custom_scorer_are_refused(value):
    """NaN or infinite scores under top-k were ranked silently (NaN first, -inf last); now refused, by name."""
    model = _model("llama")
    method = Method(_Tampered(value))
    with pytest.raises(CriticalKVError, match="_Tampered gave NaN or infinite"), compress(model, method, 0.5):
        model(_ids(40, seed=1))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_scores_of_a_custom_scorer_are_refused(dtype):
    """Integer scores failed deep inside with torch.finfo's TypeError; now refused, by name."""
    model = _model("llama")
    method = Method(_Tampered(dtype=dtype))
    with pytest.raises(CriticalKVError, match=f"_Tampered gave {dtype} scores"), compress(model, method, 0.5):
        model(_ids(40, seed=1))


def test_finite_scores_of_a_custom_scorer_decide_as_before(capture_decisions):
    """The check refuses nothing finite: a custom scorer equal to SnapKV's keeps what SnapKV keeps."""
    model = _model("llama")
    for method in (Method(_Tampered()), Method(SnapKVScorer(window=4))):
        with compress(model, method, 0.5):
            model(_ids(40, seed=1))
    custom, builtin = capture_decisions[:2], capture_decisions[2:]
    assert len(custom) == len(builtin) == 2
    assert all(torch.equal(a[2].keep, b[2].keep) for a, b in zip(custom, builtin, strict=True))


@pytest.mark.parametrize(
    ("spec", "options", "suggestion"),
    [
        ("critcal-snapkv", {}, "Did you mean 'critical-snapkv'?"),
        ("snapvk", {}, "Did you mean 'snapkv'?"),
        ("snapkv", {"windw": 8}, "Did you mean 'window'?"),
        ("critical-snapkv:alhpa=0.5", {}, "Did you mean 'alpha'?"),
    ],
)
def test_a_mistyped_method_or_option_gets_a_suggestion(spec, options, suggestion):
    with pytest.raises(UnknownMethodError, match=re.escape(suggestion)):
        build_method(spec, **options)


def test_the_cli_suggests_methods_and_tasks(monkeypatch):
    """The CLI's refusals carry the suggestion (a model name had one; method names and RULER tasks had none)."""
    monkeypatch.setattr("criticalkv.distributed.launch.load_model", _never_loaded)
    for args, suggestion in [
        (["run", "--method", "critcal-snapkv"], "Did you mean 'critical-snapkv'?"),
        (["eval", "ruler", "--methods", "snapkv,tvoa"], "Did you mean 'tova'?"),
        (["eval", "ruler", "--tasks", "niah_single1"], "Did you mean 'niah_single_1'?"),
    ]:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2
        assert suggestion in " ".join(result.output.split())


def _never_loaded(*args, **kwargs):
    raise AssertionError("the model was loaded")


def test_ctrl_c_in_a_sweep_says_that_rerunning_resumes(monkeypatch, tmp_path):
    """Ctrl-C during a sweep still exits 130, now with the hint that the same command resumes."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("criticalkv.eval.commands._load", lambda *args: (SimpleNamespace(dtype=torch.float32), None))
    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", interrupted)
    result = CliRunner().invoke(app, ["eval", "ruler", "--tasks", "vt", "--out", str(tmp_path / "r")])
    assert result.exit_code == 130
    output = " ".join(result.output.split())
    assert "run the same command again to resume" in output and str(tmp_path / "r") in output


def test_a_second_sweep_on_a_busy_folder_is_refused(tmp_path, tiny_tokenizer):
    """Two sweeps on one folder at once: the second is refused at once (both answered every sample and wrote every
    row twice), and the first finishes with every row written once."""
    folder = tmp_path / "sweep"
    model, samples, kwargs = _sweep_setup(tiny_tokenizer, folder)
    first_answered, second_done = threading.Event(), threading.Event()

    def paused_samples():
        yield samples[0]
        first_answered.set()  # sample 0's rows are on disk: the second sweep would skip it and answer the rest
        second_done.wait(timeout=120)
        yield from samples[1:]

    errors: list[BaseException] = []

    def first_sweep():
        try:
            run_sweep(model, tiny_tokenizer, paused_samples(), _score, **kwargs)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    thread = threading.Thread(target=first_sweep)
    thread.start()
    try:
        assert first_answered.wait(timeout=120)
        with pytest.raises(CriticalKVError, match="another sweep is writing to"):
            run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)
    finally:
        second_done.set()
        thread.join()
    assert not errors
    keys = [(row.index, row.method) for row in load_rows(folder / "results.jsonl")]
    assert sorted(keys) == sorted({(i, m) for i in range(4) for m in ("full", "snapkv")})
    run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)  # the folder is free again: a resume answers nothing
    assert len(load_rows(folder / "results.jsonl")) == 8


def _sliding_model(family: str, window: int):
    """The tiny ``family`` model of test_runtime with a sliding window of ``window`` tokens."""
    config = FAMILIES[family]()
    config.sliding_window = window
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _batched_questions(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Questions of ``lengths`` left-padded into one batch: ids (b, q), mask (b, q), and each question alone."""
    alone = [_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, question in enumerate(alone):
        ids[row, width - question.shape[1] :] = question[0]
        mask[row, width - question.shape[1] :] = 1
    return ids, mask, alone


@pytest.mark.parametrize("family", ["gemma3", "ministral"])
@pytest.mark.parametrize("method", ["full", "snapkv"])
@pytest.mark.parametrize("eos", [None, "stop"])
def test_padded_questions_that_reach_into_a_sliding_window_answer_as_alone(family, method, eos):
    """Questions of different lengths asked together on a sliding window the padding reaches into: each row answers
    as it does alone (the padding took slots of the window and pushed real tokens out: other answers)."""
    model = _sliding_model(family, window=16)
    context = _ids(24, seed=1)
    ids, mask, alone = _batched_questions([7, 2, 7, 4])
    answers = []
    for question in alone:
        solo = ContextSession(model, method, 0.5)
        solo.prefill(context)
        answers.append(solo.ask(question, max_new_tokens=6, eos_token_id=None).tokens[0])
    stop = int(answers[1][2]) if eos else None  # the second row ends early, the others may not
    session = ContextSession(model, method, 0.5)
    session.prefill(context.expand(4, -1))
    before = session.kv_entries()
    batched = session.ask(ids, max_new_tokens=6, question_mask=mask, eos_token_id=stop)
    for row, answer in enumerate(answers):
        if stop is not None and bool((answer == stop).any()):
            end = int((answer == stop).nonzero()[0]) + 1
            answer = torch.cat([answer[:end], answer.new_full((6 - end,), stop)])[: batched.tokens.shape[1]]
        assert torch.equal(batched.tokens[row], answer), row
    assert session.kv_entries() == before  # the session's own cache is untouched
    again = session.ask(ids, max_new_tokens=6, question_mask=mask, eos_token_id=stop)
    assert torch.equal(again.tokens, batched.tokens)


@pytest.mark.parametrize("family", ["gemma3", "ministral"])
def test_padded_questions_within_a_sliding_window_answer_as_alone(family):
    """When context, question and answer fit the window, padding pushes nothing out: each row of the batch answers
    as it does alone."""
    model = _sliding_model(family, window=64)
    context = _ids(24, seed=1)
    ids, mask, alone = _batched_questions([7, 2])
    session = ContextSession(model, "full")
    session.prefill(context.expand(2, -1))
    batched = session.ask(ids, max_new_tokens=4, question_mask=mask)
    for row, question in enumerate(alone):
        session_alone = ContextSession(model, "full")
        session_alone.prefill(context)
        assert torch.equal(batched.tokens[row], session_alone.ask(question, max_new_tokens=4).tokens[0])


def test_ask_stops_at_the_models_end_of_sequence_token_by_default():
    """As ``generate`` does: ``ask`` ends a row at ``generation_config.eos_token_id`` unless told otherwise (it ran to
    ``max_new_tokens``); ``eos_token_id=None`` runs to the end."""
    model = copy.deepcopy(_model("llama"))
    context, question = _ids(40, seed=1), _ids(5, seed=2)
    session = ContextSession(model, "snapkv", 0.5)
    session.prefill(context)
    unstopped = session.ask(question, max_new_tokens=8).tokens  # the tiny models have no eos of their own
    assert unstopped.shape[1] == 8
    stop = int(unstopped[0, 3])
    first = int((unstopped[0] == stop).nonzero()[0])
    model.generation_config.eos_token_id = stop
    assert torch.equal(session.ask(question, max_new_tokens=8).tokens, unstopped[:, : first + 1])
    assert torch.equal(session.ask(question, max_new_tokens=8, eos_token_id=None).tokens, unstopped)
    model.generation_config.eos_token_id = [VOCAB - 1, stop]  # a list, as Llama 3's configs have
    assert torch.equal(session.ask(question, max_new_tokens=8).tokens, unstopped[:, : first + 1])


def test_shared_prefill_targets_take_method_options():
    """A target's options (a window) set its own method, as ``ContextSession``'s options do, without build_method."""
    model = _model("llama")
    context, question = _ids(40, seed=1), _ids(5, seed=2)
    shared = SharedPrefill(model, [("w8", "snapkv", 0.5, {"window": 8}), ("default", "snapkv", 0.5)])
    assert [t.method.scorer.window for t in shared.targets] == [8, build_method("snapkv").scorer.window]
    sessions = shared.prefill(context)
    alone = ContextSession(model, "snapkv", 0.5, window=8)
    alone.prefill(context)
    assert torch.equal(sessions["w8"].ask(question).tokens, alone.ask(question).tokens)
    assert sessions["w8"].kv_entries() == alone.kv_entries()
    with pytest.raises(UnknownMethodError, match="Did you mean 'window'"):
        SharedPrefill(model, [("x", "snapkv", 0.5, {"windw": 8})])
    with pytest.raises(MethodOptionError, match="custom Method"):
        SharedPrefill(model, [("x", build_method("snapkv"), 0.5, {"window": 8})])


def test_sessions_report_their_prefill_and_compression_times():
    """A SharedPrefill's sessions carry the shared prefill's time and their own compression time (they had none:
    timing needed a second prefill); a ContextSession's compression time is its compressor's."""
    model = _model("llama")
    context = _ids(40, seed=1)
    sessions = SharedPrefill(model, [("full", "full", 1.0), ("snapkv", "snapkv", 0.5)]).prefill(context)
    seconds = {label: (s.prefill_seconds, s.compress_cpu_seconds) for label, s in sessions.items()}
    assert seconds["full"][0] == seconds["snapkv"][0] > 0  # one shared forward
    assert 0 < seconds["snapkv"][1] < float("inf") and seconds["full"][1] < seconds["snapkv"][1]
    for method in ("full", "snapkv"):
        session = ContextSession(model, method, 0.5)
        session.prefill(context)
        assert session.prefill_seconds > 0
        expected = 0.0 if method == "full" else session.compressor.compress_cpu_seconds
        assert session.compress_cpu_seconds == expected


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every refusal here must come first."""
    monkeypatch.setattr("criticalkv.distributed.launch.load_model", _never_loaded)


def _refused(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.split())
    assert result.exit_code == 2, (result.exception, output)
    assert message in output, output


def test_an_out_folder_that_cannot_be_written_is_refused_before_loading(no_model, tmp_path, monkeypatch):
    """A read-only folder as --out (or above it): refused before the model loads (it failed after the load)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the folder reads as read-only as it would to a user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and not (Path(p) == locked and mode & os.W_OK))
    try:
        for command in (["eval", "ruler"], ["eval", "needle"]):
            _refused([*command, "--out", str(locked / "sweep")], f"cannot write in {locked}")
            _refused([*command, "--out", str(locked)], f"cannot write in {locked}")
    finally:
        locked.chmod(0o755)


def test_a_full_disk_during_a_sweep_is_a_clear_error(tmp_path, tiny_tokenizer, full_disk):
    """The disk fills while a sweep appends its rows: a clear error that says the rows so far are kept and how to
    resume (it was a raw OSError traceback); the rows written before are whole."""
    model, samples, kwargs = _sweep_setup(tiny_tokenizer, tmp_path / "sweep")
    run_sweep(model, tiny_tokenizer, samples[:1], _score, **kwargs)
    before = (tmp_path / "sweep" / "results.jsonl").read_bytes()
    full_disk()
    with pytest.raises(CriticalKVError, match="No space left on device; the rows written so far are kept"):
        run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)
    assert (tmp_path / "sweep" / "results.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"\x89PNG\r\n\x1a\n\x00\x00\xff", "is not UTF-8 text"), (b"", "is empty"), (b" \n\n ", "is empty")],
)
def test_a_binary_or_empty_context_file_is_refused_before_loading(no_model, tmp_path, content, message):
    """A binary --context-file gave a raw UnicodeDecodeError, an empty one was answered without a word."""
    path = tmp_path / "context.txt"
    path.write_bytes(content)
    _refused(["run", "--context-file", str(path), "--question", "what?"], f"--context-file {path} {message}")


def test_a_longbench_line_with_a_bad_byte_is_named(tmp_path):
    record = {"input": "Who?", "context": "A fox.", "answers": ["fox"], "length": 2, "dataset": "hotpotqa"}
    record |= {"language": "en", "all_classes": None, "_id": "hotpotqa-0"}
    line = json.dumps(record).encode()
    path = tmp_path / "hotpotqa.jsonl"
    path.write_bytes(line + b"\n" + line.replace(b"A fox", b"A f\xe9x") + b"\n")
    with pytest.raises(CriticalKVError, match=re.escape(f"{path}, line 2: not UTF-8 text (byte 0xe9")):
        load_longbench(path)
