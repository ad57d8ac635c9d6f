"""Sweep folders on disk: --out never overwrites another sweep, a killed run's cut line resumes, files are refused."""

import json
import warnings
from dataclasses import asdict

import pytest
import torch
from test_merge import SETTINGS, _folder
from test_sweep import Toy, _tiny_model
from transformers import LlamaConfig
from typer.testing import CliRunner

from criticalkv.budget import Budget
from criticalkv.cli import app
from criticalkv.errors import CriticalKVError
from criticalkv.eval.merge import merge_sweeps
from criticalkv.eval.sweep import IncompleteRowWarning, Row, check_out_folder, load_rows, run_sweep


def _row(index, method, budget, prediction="Paris"):
    return Row("qa_1", index, "agnostic", method, budget, 0.0, prediction, 100, 1.0 if method == "full" else budget)


def _report(*args):
    result = CliRunner().invoke(app, ["report", *map(str, args)])
    return result.exit_code, " ".join(result.output.split())  # rich wraps long lines


def _sweep_setup(tiny_tokenizer, out_dir):
    """A 2-layer float32 Llama, four toy samples, and run_sweep's keyword arguments for one pair into ``out_dir``."""
    torch.manual_seed(0)
    model = _tiny_model(LlamaConfig, tiny_tokenizer, max_position_embeddings=2048)
    words = "the grass is green the sky is blue the sun is yellow".split()  # noqa: SIM905
    samples = [
        Toy("toy", i, " ".join(words[(i + j) % len(words)] for j in range(100)), "what is blue?", "it is", "sky")
        for i in range(4)
    ]
    kwargs = dict(
        methods=["snapkv"],
        budgets=[Budget(0.5)],
        regime="agnostic",
        out_dir=out_dir,
        max_new_tokens=lambda s: 2,
        settings=SETTINGS,
    )
    return model, samples, kwargs


def _score(sample, prediction):
    return 100.0 * (sample.answer in prediction)


def _keys(path):
    return sorted((r.index, r.method) for r in load_rows(path))


# 1. --out of a merge or report never overwrites another sweep


def test_merge_refuses_an_out_that_holds_another_sweep(tmp_path):
    a = _folder(tmp_path / "a", [_row(0, "full", 1.0)])
    other = _folder(tmp_path / "other", [_row(0, "full", 1.0), _row(0, "snapkv", 0.2, "Rome")])
    before = (other / "results.jsonl").read_text()
    with pytest.raises(CriticalKVError, match=r"already holds a sweep \(results.jsonl, sweep.json\).*new or empty"):
        merge_sweeps([a], other)
    code, output = _report(a, "--out", other)
    assert code == 2 and f"--out {other} already holds a sweep" in output
    assert (other / "results.jsonl").read_text() == before and not (other / "report.md").exists()
    settings_only = tmp_path / "settings_only"  # a sweep that failed before its first row... still a sweep's folder
    settings_only.mkdir()
    (settings_only / "sweep.json").write_text(json.dumps(SETTINGS))
    with pytest.raises(CriticalKVError, match=r"already holds a sweep \(sweep.json\)"):
        merge_sweeps([a], settings_only)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert merge_sweeps([a], empty) == 1  # an empty folder, or a new one, is fine
    code, output = _report(a, "--out", tmp_path / "new")
    assert code == 0, output


# 2. a killed run's incomplete last line is dropped; any other bad line is corruption


def test_an_incomplete_last_line_is_dropped_with_a_warning(tmp_path):
    a = _folder(tmp_path / "a", [_row(0, "full", 1.0), _row(0, "snapkv", 0.2)])
    path = a / "results.jsonl"
    path.write_text(path.read_text() + json.dumps(asdict(_row(1, "full", 1.0)))[:40])  # killed mid-write
    with pytest.warns(IncompleteRowWarning, match=r"results.jsonl: line 3 is incomplete.*answered again"):
        assert [(r.index, r.method) for r in load_rows(path)] == [(0, "full"), (0, "snapkv")]
    path.write_text(path.read_text().rsplit("\n", 1)[0])  # the partial line gone: a whole last row, no newline
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [(r.index, r.method) for r in load_rows(path)] == [(0, "full"), (0, "snapkv")]  # kept, no warning


def test_a_malformed_line_before_the_last_is_an_error_naming_it(tmp_path):
    a = _folder(tmp_path / "a", [_row(0, "full", 1.0), _row(0, "snapkv", 0.2)])
    path = a / "results.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:30] + "\n" + lines[1])
    with pytest.raises(CriticalKVError, match=r"results.jsonl: line 2 is not a JSON row.*corrupted"):
        load_rows(path)
    code, output = _report(a, "--out", tmp_path / "m")
    assert code == 2 and "line 2 is not a JSON row" in output


def test_a_resumed_sweep_answers_a_cut_row_again_on_a_line_of_its_own(tmp_path, tiny_tokenizer):
    model, samples, kwargs = _sweep_setup(tiny_tokenizer, tmp_path)
    run_sweep(model, tiny_tokenizer, samples[:2], _score, **kwargs)
    path = tmp_path / "results.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 25])  # killed while writing the last row: (1, snapkv)
    with pytest.warns(IncompleteRowWarning, match="answered again"):
        rows = run_sweep(model, tiny_tokenizer, samples[:3], _score, **kwargs)
    assert [(r.index, r.method) for r in rows] == [(1, "snapkv"), (2, "full"), (2, "snapkv")]
    assert _keys(path) == [(i, m) for i in range(3) for m in ("full", "snapkv")]  # every line whole, each once
    path.write_text(path.read_text()[:-1])  # a complete last row without its newline: kept, and not joined
    run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)
    assert _keys(path) == [(i, m) for i in range(4) for m in ("full", "snapkv")]


def test_a_resumed_sweep_refuses_a_corrupted_file_before_any_work(tmp_path, tiny_tokenizer):
    model, samples, kwargs = _sweep_setup(tiny_tokenizer, tmp_path)
    run_sweep(model, tiny_tokenizer, samples[:2], _score, **kwargs)
    path = tmp_path / "results.jsonl"
    path.write_text("{not json\n" + path.read_text())
    before = path.read_text()
    with pytest.raises(CriticalKVError, match=rf"{path}: line 1 is not a JSON row"):
        run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)
    assert path.read_text() == before


# 3. an --out that is a file


def test_an_out_that_is_a_file_is_refused_clearly(tmp_path, tiny_tokenizer):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(CriticalKVError, match=rf"--out {file} is a file, not a folder"):
        check_out_folder(file)
    with pytest.raises(CriticalKVError, match=rf"--out {file / 'sub'} is inside {file}, which is a file"):
        check_out_folder(file / "sub")
    check_out_folder(tmp_path)  # an existing folder, or a new one, is fine
    check_out_folder(tmp_path / "new" / "deeper")
    a = _folder(tmp_path / "a", [_row(0, "full", 1.0)])
    with pytest.raises(CriticalKVError, match="is a file, not a folder"):
        merge_sweeps([a], file)
    code, output = _report(a, "--out", file)
    assert code == 2 and f"--out {file} is a file, not a folder" in output
    model, samples, kwargs = _sweep_setup(tiny_tokenizer, file)
    with pytest.raises(CriticalKVError, match="is a file, not a folder"):
        run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)
    assert file.read_text() == "mine"


def test_a_sweep_at_a_count_of_one_entry_resumes(tmp_path, tiny_tokenizer):
    """``Budget(1)`` (built on purpose: ``Budget.parse`` refuses the count 1) is stored as 1 and read back as the
    count it was, not refused as a user's "1"."""
    model, samples, kwargs = _sweep_setup(tiny_tokenizer, tmp_path)
    kwargs["budgets"] = [Budget(1)]
    run_sweep(model, tiny_tokenizer, samples[:1], _score, **kwargs)
    rows = run_sweep(model, tiny_tokenizer, samples[:2], _score, **kwargs)  # resumes: sample 1 only
    assert [(r.index, r.method, r.budget) for r in rows] == [(1, "full", 1.0), (1, "snapkv", 1)]
