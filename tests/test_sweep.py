"""The sweep runner answers every sample with every pair, resumes after an interruption, and reports."""

import json
from dataclasses import asdict, dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from criticalkv.budget import Budget
from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.eval.report import summarise, write_report
from criticalkv.eval.sweep import Row, load_rows, run_sweep
from criticalkv.runtime.session import ContextSession


@dataclass
class Toy:
    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answer: str


def _tiny_model(config_class, tokenizer, **extra):
    """A 2-layer float32 model of ``config_class`` (4 query heads on 2 KV heads) over the tokenizer's vocabulary."""
    config = config_class(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        **extra,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def _setup(tiny_tokenizer):
    torch.manual_seed(0)
    model = _tiny_model(LlamaConfig, tiny_tokenizer, max_position_embeddings=2048)
    words = ("the grass is green the sky is blue the sun is yellow here we go there and back again").split()  # noqa: SIM905
    samples = [
        Toy("toy", i, " ".join(words[(i + j) % len(words)] for j in range(200)), "what is blue?", "it is", "sky")
        for i in range(3)
    ]
    return model, samples


def _score(sample, prediction):
    return 100.0 * (sample.answer in prediction)


def test_sweep_resumes_and_matches_separate_runs(tmp_path, tiny_tokenizer, monkeypatch):
    model, samples = _setup(tiny_tokenizer)
    batches = []
    stacked = ContextSession.stacked
    monkeypatch.setattr(ContextSession, "stacked", lambda sessions: batches.append(len(sessions)) or stacked(sessions))
    budgets = [Budget(0.3), Budget(0.6)]
    kwargs = dict(
        methods=["snapkv", "critical-snapkv"],
        budgets=budgets,
        regime="agnostic",
        out_dir=tmp_path,
        max_new_tokens=lambda s: 4,
        batch_answers=True,
    )
    run_sweep(model, tiny_tokenizer, samples[:2], _score, **kwargs)  # "interrupted" after two samples
    rows = run_sweep(model, tiny_tokenizer, samples, _score, **kwargs)
    assert {r.index for r in rows} == {2}  # only the missing sample ran
    assert batches == [4, 4, 4]  # the four compressed pairs of each sample answered as one batch
    assert [r.batched for r in rows] == [False, True, True, True, True]  # the full cache answered alone
    stored = load_rows(tmp_path / "results.jsonl")
    assert len(stored) == 3 * (1 + 2 * 2)
    # each stored answer (float32: batched or not) equals a separate, unshared run of that pair
    from criticalkv.prompts import encode_prompt

    sample = samples[1]
    prefix_ids, suffix_ids = encode_prompt(tiny_tokenizer, sample.context, sample.question, sample.answer_prefix)
    for row in (r for r in stored if r.index == 1):
        session = ContextSession(model, row.method, row.budget)
        session.prefill(torch.tensor([prefix_ids]))
        tokens = session.ask(torch.tensor([suffix_ids]), max_new_tokens=4, eos_token_id=tiny_tokenizer.eos_token_id)
        assert tiny_tokenizer.decode(tokens.tokens[0], skip_special_tokens=True).strip() == row.prediction
        assert row.kept_fraction == 1.0 if row.method == "full" else row.kept_fraction < 1.0


def test_report_tables_and_loss(tmp_path):
    rows = [
        {
            "task": t,
            "index": i,
            "regime": "agnostic",
            "method": m,
            "budget": b,
            "score": s,
            "prediction": "",
            "prompt_tokens": 100,
            "kept_fraction": 1.0,
        }
        for t in ("a", "b")
        for i in range(2)
        for m, b, s in (("full", 1.0, 80.0), ("snapkv", 0.2, 40.0), ("critical-snapkv", 0.2, 60.0))
    ]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    summary = summarise(load_rows(tmp_path / "results.jsonl"))
    by_method = {e["method"]: e for e in summary["rows"]}
    assert by_method["full"]["loss"] == 0.0
    assert by_method["snapkv"]["loss"] == 0.5 and by_method["critical-snapkv"]["loss"] == 0.25
    report = write_report(tmp_path, "toy")
    text = report.read_text()
    assert "| snapkv | 0.2 | 40.0 | 40.0 | 40.0 | 50.0% (50.0-50.0) |" in text  # every sample alike: no spread
    assert "| critical-snapkv | snapkv | 0.2 | 0.50 (0.50-0.50) |" in text
    assert (tmp_path / "score_vs_budget_agnostic.png").stat().st_size > 1000
    assert "Samples per task: 2." in text
    assert "![compression loss, question-agnostic](loss_agnostic.png)" in text
    assert (tmp_path / "loss_agnostic.png").stat().st_size > 1000
    assert (tmp_path / "summary.csv").read_text().count("\n") == 4


def test_report_loss_compares_with_the_full_cache_on_the_same_samples(tmp_path):
    """A pair that answered only some samples (a run in progress, merged folders) is compared on those alone."""
    full = {("a", 0): 100.0, ("a", 1): 0.0, ("b", 0): 100.0, ("b", 1): 100.0}
    rows = [Row(t, i, "agnostic", "full", 1.0, s, "", 100, 1.0) for (t, i), s in full.items()]
    rows += [Row("a", 0, "agnostic", "snapkv", 0.2, 50.0, "", 100, 0.2)]  # one sample answered so far
    by_method = {e["method"]: e for e in summarise(rows)["rows"]}
    assert by_method["full"]["mean"] == 75.0  # (50 + 100) / 2 over every sample
    assert by_method["snapkv"]["loss"] == 0.5  # against the full cache's 100 on sample a#0, not its 75 overall


def test_report_counts_a_sample_answered_twice_once():
    """Folders resumed before the sweep answered only missing pairs hold repeated rows: one sample, counted once."""
    rows = [Row("a", i, "agnostic", "full", 1.0, 100.0, "", 100, 1.0) for i in range(2)]
    rows += [Row("a", 0, "agnostic", "snapkv", 0.2, 0.0, "", 100, 0.2)] * 2
    rows += [Row("a", 1, "agnostic", "snapkv", 0.2, 100.0, "", 100, 0.2)]
    by_method = {e["method"]: e for e in summarise(rows)["rows"]}
    assert by_method["snapkv"]["samples"] == 2 and by_method["snapkv"]["mean"] == 50.0
    with pytest.raises(CriticalKVError, match="scored twice for snapkv"):
        summarise([*rows, Row("a", 1, "agnostic", "snapkv", 0.2, 0.0, "", 100, 0.2)])


def test_report_names_each_rows_samples_when_they_differ(tmp_path):
    rows = [Row(t, i, "agnostic", "full", 1.0, 100.0, "", 100, 1.0) for t in ("a", "b") for i in range(2)]
    rows += [Row("a", i, "agnostic", "snapkv", 0.2, 0.0, "", 100, 0.2) for i in range(2)]
    rows += [Row("b", 0, "agnostic", "snapkv", 0.2, 0.0, "", 100, 0.2)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in rows))
    text = write_report(tmp_path).read_text()
    assert "Samples per task: per row (column samples)." in text
    assert "| method | budget | samples | a | b | mean | loss |" in text
    assert "| full |  | 2 | 100.0 | 100.0 | 100.0 |  |" in text
    assert "| snapkv | 0.2 | 1-2 | 0.0 | 0.0 | 0.0 | 100.0% (100.0-100.0) |" in text


def test_report_marks_a_row_that_answered_only_some_tasks(tmp_path):
    """A method run on one task of three (a folder resumed with --tasks): its missing tasks show "–", its sample
    count names them (0), and its mean is marked as not comparable with the full rows'."""
    rows = [Row(t, i, "agnostic", "full", 1.0, 100.0, "", 100, 1.0) for t in ("a", "b", "c") for i in range(2)]
    rows += [Row("a", i, "agnostic", "snapkv", 0.2, 50.0, "", 100, 0.2) for i in range(2)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in rows))
    text = write_report(tmp_path).read_text()
    assert "| method | budget | samples | a | b | c | mean | loss |" in text
    assert "| full |  | 2 | 100.0 | 100.0 | 100.0 | 100.0 |  |" in text
    assert "| snapkv | 0.2 | 0-2 | 50.0 | – | – | 50.0* | 50.0% (50.0-50.0) |" in text
    assert "the mean of the tasks the row answered" in text and "nan" not in text


def test_eval_cli_refuses_bad_input():
    from typer.testing import CliRunner

    from criticalkv.cli import app

    result = CliRunner().invoke(app, ["eval", "ruler", "--tasks", "niah_single_1,nope"])
    assert result.exit_code == 2 and "unknown RULER task(s) ['nope']" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["eval", "ruler", "--tasks", "vt", "--budgets", "1.5"])
    assert result.exit_code == 2 and "fractional budget must be in (0, 1]" in " ".join(result.output.split())


def test_batched_answers_refuse_sliding_window_models(tmp_path, tiny_tokenizer):
    """Sliding-window layers (Gemma 3) do not stack: --batch-answers says so before any work, never falls back."""
    model = _tiny_model(
        Gemma3TextConfig,
        tiny_tokenizer,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    with pytest.raises(UnsupportedModelError, match="sliding-window layers"):
        run_sweep(
            model,
            tiny_tokenizer,
            [],
            _score,
            ["snapkv"],
            [Budget(0.3)],
            "agnostic",
            tmp_path,
            lambda s: 4,
            batch_answers=True,
        )
    assert not (tmp_path / "results.jsonl").exists()


def test_resuming_a_folder_with_other_settings_is_refused(tmp_path, tiny_tokenizer):
    model, samples = _setup(tiny_tokenizer)
    kwargs = dict(
        methods=["snapkv"], budgets=[Budget(0.5)], regime="agnostic", out_dir=tmp_path, max_new_tokens=lambda s: 2
    )
    settings = {"benchmark": "ruler", "model": "toy", "length": 256, "seed": 0, "max_new_tokens": 0}
    run_sweep(model, tiny_tokenizer, samples[:1], _score, settings=settings, **kwargs)
    assert json.loads((tmp_path / "sweep.json").read_text()) == settings
    rows = run_sweep(model, tiny_tokenizer, samples[:2], _score, settings=dict(settings), **kwargs)  # same: resumes
    assert {r.index for r in rows} == {1}
    with pytest.raises(CriticalKVError, match=r"length: 256 there, 512 now.*use another --out"):
        run_sweep(model, tiny_tokenizer, samples, _score, settings={**settings, "length": 512}, **kwargs)
    assert len(load_rows(tmp_path / "results.jsonl")) == 2 * 2  # nothing appended by the refused run
    # a setting on one side only (an option recorded only when given) conflicts both ways
    with pytest.raises(CriticalKVError, match=r"dtype: None there, 'float32' now"):
        run_sweep(model, tiny_tokenizer, samples, _score, settings={**settings, "dtype": "float32"}, **kwargs)
    (tmp_path / "sweep.json").write_text(json.dumps({**settings, "dtype": "float32"}))
    with pytest.raises(CriticalKVError, match=r"dtype: 'float32' there, None now"):
        run_sweep(model, tiny_tokenizer, samples, _score, settings=dict(settings), **kwargs)


def test_adding_methods_to_a_sweep_answers_only_the_new_pairs(tmp_path, tiny_tokenizer):
    """No pair answers a sample twice: the report would count the sample twice."""
    model, samples = _setup(tiny_tokenizer)
    kwargs = dict(budgets=[Budget(0.3)], regime="agnostic", out_dir=tmp_path / "new", max_new_tokens=lambda s: 2)
    run_sweep(model, tiny_tokenizer, samples[:2], _score, methods=["snapkv"], **kwargs)  # creates its folder
    rows = run_sweep(model, tiny_tokenizer, samples[:2], _score, methods=["snapkv", "critical-snapkv"], **kwargs)
    assert sorted((r.index, r.method) for r in rows) == [(0, "critical-snapkv"), (1, "critical-snapkv")]
    assert all(0 < r.kept_fraction < 1 for r in rows)  # against the full cache, prefilled though not answered
    stored = load_rows(tmp_path / "new" / "results.jsonl")
    keys = [(r.task, r.index, r.method, r.budget) for r in stored]
    assert len(keys) == len(set(keys)) == 2 * 3
    assert run_sweep(model, tiny_tokenizer, samples[:2], _score, methods=["critical-snapkv"], **kwargs) == []


def test_a_sweep_that_fails_before_its_first_row_leaves_no_settings(tmp_path, tiny_tokenizer):
    """The corrected rerun into the same folder is then not refused for the failed run's settings."""
    model, samples = _setup(tiny_tokenizer)
    kwargs = dict(budgets=[Budget(0.5)], regime="agnostic", out_dir=tmp_path, max_new_tokens=lambda s: 2)
    settings = {"benchmark": "ruler", "model": "toy", "length": 0}

    def failing_samples():
        raise CriticalKVError("length must be positive")
        yield  # a generator, as the RULER samples are

    with pytest.raises(CriticalKVError, match="length must be positive"):
        run_sweep(model, tiny_tokenizer, failing_samples(), _score, methods=["snapkv"], settings=settings, **kwargs)
    assert not (tmp_path / "sweep.json").exists()
    with pytest.raises(CriticalKVError, match=r"given twice: snapkv@0.5"):
        run_sweep(model, tiny_tokenizer, samples, _score, methods=["snapkv", "snapkv"], settings=settings, **kwargs)
    run_sweep(
        model, tiny_tokenizer, samples[:1], _score, methods=["snapkv"], settings={**settings, "length": 256}, **kwargs
    )
    assert json.loads((tmp_path / "sweep.json").read_text())["length"] == 256


def test_report_takes_its_title_from_the_sweep_settings(tmp_path):
    """`criticalkv report DIR` keeps the title `eval ruler` gave the report."""
    rows = [Row("a", 0, "agnostic", m, b, 50.0, "", 100, 1.0) for m, b in (("full", 1.0), ("snapkv", 0.2))]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(asdict(r)) for r in rows))
    (tmp_path / "sweep.json").write_text(json.dumps({"benchmark": "ruler", "model": "/m/qwen2.5-0.5b", "length": 4096}))
    assert write_report(tmp_path).read_text().startswith("# RULER-4096, qwen2.5-0.5b, question-agnostic\n")
    (tmp_path / "sweep.json").unlink()
    assert write_report(tmp_path).read_text().startswith("# Sweep results\n")


def test_a_folder_with_rows_but_no_settings_is_not_resumed(tiny_tokenizer, tmp_path):
    """Rows answered under settings nobody recorded (a folder of before sweep.json) cannot be checked: refused."""
    model, samples = _setup(tiny_tokenizer)
    kwargs = dict(budgets=[Budget(0.5)], regime="agnostic", out_dir=tmp_path, max_new_tokens=lambda s: 2)
    settings = {"benchmark": "ruler", "model": "toy", "length": 256}
    run_sweep(model, tiny_tokenizer, samples[:1], _score, methods=["snapkv"], settings=settings, **kwargs)
    (tmp_path / "sweep.json").unlink()
    with pytest.raises(CriticalKVError, match=r"holds results but no sweep\.json"):
        run_sweep(
            model, tiny_tokenizer, samples, _score, methods=["snapkv"], settings={**settings, "length": 64}, **kwargs
        )


def test_a_count_of_one_entry_and_the_fraction_one_are_reported_apart(tmp_path):
    """1 == 1.0 in Python: the report and the merge keyed both budgets as one."""
    from criticalkv.eval.merge import merge_sweeps

    rows = [Row("a", i, "agnostic", "full", 1.0, 100.0, "", 100, 1.0) for i in range(2)]
    rows += [
        Row("a", 0, "agnostic", "snapkv", 1, 40.0, "x", 100, 0.01),
        Row("a", 1, "agnostic", "snapkv", 1.0, 10.0, "y", 100, 1.0),
    ]
    means = {(e["method"], e["budget"], type(e["budget"])): e["mean"] for e in summarise(rows)["rows"]}
    assert means == {("full", 1.0, float): 100.0, ("snapkv", 1, int): 40.0, ("snapkv", 1.0, float): 10.0}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    assert merge_sweeps([tmp_path / "a"], tmp_path / "m") == 4


def test_score_plot_puts_entry_counts_on_their_own_axis_and_the_title_names_the_dtype(tmp_path):
    from criticalkv.eval.report import _plot_regime, sweep_title

    rows = [Row("a", 0, "agnostic", "full", 1.0, 100.0, "", 100, 1.0)]
    rows += [
        Row("a", 0, "agnostic", m, b, 50.0, "", 100, 0.2) for m in ("snapkv", "critical-snapkv") for b in (0.2, 512)
    ]
    figure = _plot_regime(summarise(rows), "agnostic", tmp_path / "plot.png")
    axes = figure.get_axes()
    assert [ax.get_xlabel() for ax in axes] == [
        "budget (fraction of the context kept)",
        "budget (entries kept per KV head)",
    ]
    assert [sorted(x for line in ax.get_lines()[:-1] for x in line.get_xdata()) for ax in axes] == [
        [0.2, 0.2],
        [512, 512],
    ]
    settings = {"benchmark": "ruler", "model": "m/qwen", "length": 4096, "dtype": "float32"}
    assert sweep_title(settings, {"aware"}) == "RULER-4096, qwen, float32, question-aware"


def test_a_method_name_that_meant_another_configuration_is_not_resumed_or_merged(tiny_tokenizer, tmp_path):
    """Rows record a method by its name: the folder records what the name meant (methods.json), so rows of a preset
    whose defaults changed since do not average with the new ones under one name."""
    from criticalkv.eval.merge import merge_sweeps
    from criticalkv.methods import build_method

    model, samples = _setup(tiny_tokenizer)
    settings = {"benchmark": "ruler", "model": "toy", "length": 256}
    kwargs = dict(budgets=[Budget(0.5)], regime="agnostic", max_new_tokens=lambda s: 2, settings=settings)
    first, second = tmp_path / "first", tmp_path / "second"
    run_sweep(model, tiny_tokenizer, samples[:1], _score, methods=["snapkv"], out_dir=first, **kwargs)
    assert json.loads((first / "methods.json").read_text()) == {"snapkv": repr(build_method("snapkv"))}
    run_sweep(model, tiny_tokenizer, samples, _score, methods=["snapkv", "tova"], out_dir=first, **kwargs)  # resumes
    assert set(json.loads((first / "methods.json").read_text())) == {"snapkv", "tova"}
    run_sweep(model, tiny_tokenizer, samples[:1], _score, methods=["snapkv"], out_dir=second, **kwargs)
    (second / "methods.json").write_text(json.dumps({"snapkv": "Method(scorer=SnapKVScorer(window=16))"}))
    with pytest.raises(CriticalKVError, match=r"rows of snapkv made with another configuration"):
        run_sweep(model, tiny_tokenizer, samples, _score, methods=["snapkv"], out_dir=second, **kwargs)
    with pytest.raises(CriticalKVError, match=r"another configuration of snapkv"):
        merge_sweeps([first, second], tmp_path / "merged")
    (second / "methods.json").unlink()
    merge_sweeps([first, second], tmp_path / "merged")
    assert set(json.loads((tmp_path / "merged" / "methods.json").read_text())) == {"snapkv", "tova"}


def test_ruler_samples_are_answered_index_major(monkeypatch, tmp_path, tiny_tokenizer):
    """Sample 0 of every task, then sample 1, ...: a long sweep stopped early has every task evenly answered."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from criticalkv.cli import app

    def load(model, dtype, device, methods, prepare):
        prepare(LlamaConfig(max_position_embeddings=4096), tiny_tokenizer)
        return SimpleNamespace(dtype=torch.float32), tiny_tokenizer

    seen = []
    monkeypatch.setattr("criticalkv.eval.commands._load", load)
    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", lambda model, tok, samples, *a, **k: seen.extend(samples))
    monkeypatch.setattr("criticalkv.eval.commands.write_report", lambda folder: folder)
    args = ["eval", "ruler", "--tasks", "vt,niah_single_1", "--samples", "2", "--length", "3000"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert [(s.index, s.task) for s in seen] == [(0, "vt"), (0, "niah_single_1"), (1, "vt"), (1, "niah_single_1")]
