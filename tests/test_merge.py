"""Merging sweep folders of the same samples: union of rows, one report; other settings or answers are refused."""

import json
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from criticalkv.cli import app
from criticalkv.errors import CriticalKVError
from criticalkv.eval.merge import merge_sweeps
from criticalkv.eval.sweep import Row, load_rows

SETTINGS = {"benchmark": "ruler", "model": "toy", "length": 256, "seed": 0, "max_new_tokens": 0}


def _row(task, method, budget, prediction, score=0.0, batched=False):
    return Row(
        task, 0, "agnostic", method, budget, score, prediction, 100, 1.0 if method == "full" else budget, batched
    )


def _folder(path, rows, settings=SETTINGS):
    path.mkdir()
    (path / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    if settings is not None:
        (path / "sweep.json").write_text(json.dumps(settings))
    return path


def test_merge_keeps_each_answer_once_and_reports(tmp_path):
    a = _folder(tmp_path / "a", [_row("qa_1", "full", 1.0, "Paris", 100.0), _row("qa_1", "snapkv", 0.2, "Rome")])
    b = _folder(  # the same samples later, another budget: the full cache's answer comes again, identical
        tmp_path / "b", [_row("qa_1", "full", 1.0, "Paris", 100.0), _row("qa_1", "snapkv", 0.4, "Paris", 100.0)]
    )
    c = _folder(tmp_path / "c", [_row("vt", "full", 1.0, "x y", 50.0)])  # a folder of other tasks
    assert merge_sweeps([a, b, c], tmp_path / "m") == 4
    rows = load_rows(tmp_path / "m" / "results.jsonl")
    assert sorted((r.task, r.method, r.budget) for r in rows) == [
        ("qa_1", "full", 1.0),
        ("qa_1", "snapkv", 0.2),
        ("qa_1", "snapkv", 0.4),
        ("vt", "full", 1.0),
    ]
    assert json.loads((tmp_path / "m" / "sweep.json").read_text()) == SETTINGS
    result = CliRunner().invoke(app, ["report", str(a), str(b), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "| snapkv | 0.4 |" in (tmp_path / "r" / "report.md").read_text()


def test_merge_refuses_other_settings_other_answers_and_a_missing_out(tmp_path):
    a = _folder(tmp_path / "a", [_row("qa_1", "full", 1.0, "Paris", 100.0)])
    b = _folder(tmp_path / "b", [_row("qa_1", "full", 1.0, "Paris", 100.0)], settings={**SETTINGS, "length": 512})
    with pytest.raises(CriticalKVError, match="other settings"):
        merge_sweeps([a, b], tmp_path / "m")
    c = _folder(tmp_path / "c", [_row("qa_1", "full", 1.0, "Lyon", 0.0)])
    with pytest.raises(CriticalKVError, match=r"answered differently in .*'Paris'.*'Lyon'"):
        merge_sweeps([a, c], tmp_path / "m")
    with pytest.raises(CriticalKVError, match="is one of the folders"):
        merge_sweeps([a, c], a)
    unrecorded = _folder(tmp_path / "d", [_row("qa_1", "snapkv", 0.2, "Rome")], settings=None)  # no sweep.json
    with pytest.raises(CriticalKVError, match=r"d record no sweep.json .* cannot be checked"):
        merge_sweeps([a, unrecorded], tmp_path / "m")
    result = CliRunner().invoke(app, ["report", str(a), str(c)])
    assert result.exit_code == 2 and "give --out" in result.output


def test_report_of_some_methods_keeps_the_full_cache_and_needs_a_new_folder(tmp_path):
    rows = [_row("qa_1", "full", 1.0, "Paris", 100.0), _row("qa_1", "snapkv", 0.2, "Rome")]
    rows.append(_row("qa_1", "adakv", 0.2, ""))
    a = _folder(tmp_path / "a", rows)
    assert merge_sweeps([a], tmp_path / "m", methods=["snapkv"]) == 2
    assert sorted(r.method for r in load_rows(tmp_path / "m" / "results.jsonl")) == ["full", "snapkv"]
    with pytest.raises(CriticalKVError, match=r"no rows of \['nope'\]"):
        merge_sweeps([a], tmp_path / "n", methods=["snapkv", "nope"])
    result = CliRunner().invoke(app, ["report", str(a), "--methods", "snapkv"])
    assert result.exit_code == 2 and "give --out" in result.output
    result = CliRunner().invoke(app, ["report", str(a), "--methods", "adakv", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "r" / "report.md").read_text()
    assert "| adakv | 0.2 |" in text and "snapkv" not in text
    assert not (a / "report.md").exists()  # the folder's own report is left alone
