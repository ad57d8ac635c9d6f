"""`criticalkv eval longbench`: local JSONL read, prompts truncated and split as THUDM builds them, rows written and
resumed by the sweep runner, scores equal to ``score_samples``, clean errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_random_llama
from tokenizers import Tokenizer, normalizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
from typer.testing import CliRunner

from criticalkv.cli import app
from criticalkv.errors import CriticalKVError
from criticalkv.eval import longbench_run
from criticalkv.eval.longbench import LongBenchSample, build_prompt, prompt_parts, score_samples, truncate_middle
from criticalkv.eval.sweep import SETTINGS_FILE, load_rows

SENTENCE = "The quick brown fox jumps over the lazy dog. "


def _record(dataset: str, index: int, repeats: int = 6) -> dict:
    return {
        "input": f"What is the special magic number {index}?",
        "context": SENTENCE * repeats,
        "answers": ["the lazy dog", "fox"],
        "length": 9 * repeats,
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "_id": f"{dataset}-{index}",
    }


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A folder of two datasets (three samples each) and a Chinese file the runner leaves alone."""
    folder = tmp_path / "longbench"
    folder.mkdir()
    for dataset in ("hotpotqa", "lcc"):
        _write(folder / f"{dataset}.jsonl", [_record(dataset, i) for i in range(3)])
    (folder / "dureader.jsonl").write_text("not read\n")
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tiny_tokenizer) -> Path:
    """A random 2-layer float32 Llama over the tiny tokenizer, saved as a folder the CLI loads."""
    return save_random_llama(
        tmp_path_factory.mktemp("tiny-llama"),
        tiny_tokenizer,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )


def _invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["eval", "longbench", *args])
    return result.exit_code, " ".join(result.output.split())


def test_read_datasets_from_a_folder_or_a_file(data: Path, tmp_path: Path) -> None:
    groups = longbench_run.read_datasets(data)
    assert {name: [s.id for s in samples] for name, samples in groups.items()} == {
        "hotpotqa": ["hotpotqa-0", "hotpotqa-1", "hotpotqa-2"],
        "lcc": ["lcc-0", "lcc-1", "lcc-2"],
    }
    assert list(longbench_run.read_datasets(data, ["lcc"])) == ["lcc"]
    mixed = _write(tmp_path / "mixed.jsonl", [_record("trec", 0) | {"all_classes": ["A"]}, _record("qasper", 0)])
    assert list(longbench_run.read_datasets(mixed)) == ["trec", "qasper"]
    assert list(longbench_run.read_datasets(mixed, ["qasper"])) == ["qasper"]

    # the published folder holds LongBench-E's files beside LongBench's: read only when named
    published = tmp_path / "published"
    published.mkdir()
    _write(published / "hotpotqa.jsonl", [_record("hotpotqa", 0)])
    _write(published / "hotpotqa_e.jsonl", [_record("hotpotqa", 1) | {"dataset": "hotpotqa_e"}])
    assert list(longbench_run.read_datasets(published)) == ["hotpotqa"]
    assert list(longbench_run.read_datasets(published, ["hotpotqa_e"])) == ["hotpotqa_e"]


def test_longbench_e_rows_are_scored_per_length_bucket() -> None:
    """THUDM's scorer_e means LongBench-E's scores over samples of 0-4k, 4-8k and 8k+ words apart: each row's task
    carries its bucket, so the report's mean per task is that."""
    lengths = {3999: "0-4k", 4000: "4-8k", 7999: "4-8k", 8000: "8k+"}
    for length, bucket in lengths.items():
        sample = dataclasses.replace(_sample("hotpotqa"), dataset="hotpotqa_e", length=length)
        assert longbench_run.task_name("hotpotqa_e", sample) == f"hotpotqa_e {bucket}"
    assert longbench_run.task_name("hotpotqa", _sample("hotpotqa")) == "hotpotqa"


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["hotpotqa", "nope"], "Unknown LongBench dataset 'nope'"),
        (["qasper"], "no qasper.jsonl in"),
    ],
)
def test_read_datasets_refuses_bad_names(data: Path, names: list[str], message: str) -> None:
    with pytest.raises(CriticalKVError, match=message):
        longbench_run.read_datasets(data, names)


def test_read_datasets_refuses_missing_and_empty_data(data: Path, tmp_path: Path) -> None:
    with pytest.raises(CriticalKVError, match="LongBench data not found"):
        longbench_run.read_datasets(tmp_path / "absent")
    empty = _write(data / "qasper.jsonl", [])
    with pytest.raises(CriticalKVError, match=r"no samples in .*qasper\.jsonl"):
        longbench_run.read_datasets(data)
    with pytest.raises(CriticalKVError, match="no samples of lcc in"):
        longbench_run.read_datasets(_write(tmp_path / "one.jsonl", [_record("hotpotqa", 0)]), ["lcc"])
    empty.unlink()
    (data / "hotpotqa.jsonl").unlink()
    (data / "lcc.jsonl").unlink()
    with pytest.raises(CriticalKVError, match="no LongBench file in"):
        longbench_run.read_datasets(data)


def _sample(dataset: str, index: int = 0, repeats: int = 6) -> LongBenchSample:
    record = _record(dataset, index, repeats)
    return LongBenchSample(**{k: v for k, v in record.items() if k != "_id"}, id=record["_id"])


def test_truncation_keeps_the_question_part_whole(tiny_tokenizer) -> None:
    sample = _sample("hotpotqa", repeats=40)
    head, tail = prompt_parts(sample)
    whole = len(tiny_tokenizer(build_prompt(sample))["input_ids"])
    assert longbench_run.truncated_parts(tiny_tokenizer, sample, whole) == (head, tail)  # fits: untouched
    cut_head, cut_tail = longbench_run.truncated_parts(tiny_tokenizer, sample, whole // 2)
    assert cut_tail == tail and len(cut_head) < len(head) // 2
    assert cut_head + cut_tail == truncate_middle(tiny_tokenizer, build_prompt(sample), whole // 2)  # THUDM's prompt
    tail_tokens = len(tiny_tokenizer(tail)["input_ids"])
    with pytest.raises(CriticalKVError, match=f"max length 40 is too small .* question part has {tail_tokens} tokens"):
        longbench_run.truncated_parts(tiny_tokenizer, sample, 40)


def test_truncation_by_a_tokenizer_whose_decoding_alters_text(tiny_tokenizer) -> None:
    """A lowercasing tokenizer decodes the kept end in lower case: the question part is the decoded one, as it
    stands in THUDM's truncated prompt."""
    backend = Tokenizer.from_str(tiny_tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Lowercase()
    lowering = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    sample = _sample("hotpotqa", repeats=40)
    prompt = build_prompt(sample)
    short = len(lowering(prompt)["input_ids"]) // 2
    head, tail = longbench_run.truncated_parts(lowering, sample, short)
    assert tail == prompt_parts(sample)[1].lower() != prompt_parts(sample)[1]
    assert head + tail == truncate_middle(lowering, prompt, short)


def test_chat_template_where_thudm_applies_one(tiny_tokenizer) -> None:
    """hotpotqa is templated (the template wraps its head and tail, no special tokens added); lcc is raw, with the
    tokenizer's own special tokens; without a template every dataset is raw. Each time the two parts join into the
    whole prompt tokenized in one call."""
    chat = copy.deepcopy(tiny_tokenizer)
    chat.chat_template = (
        "{% for m in messages %}<s>[U]{{ m['content'] }}[/U]{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"
    )
    sample = _sample("hotpotqa")
    head, tail = prompt_parts(sample)
    prefix_ids, suffix_ids = longbench_run.encode_sample(chat, sample, 3500)
    assert prefix_ids + suffix_ids == chat("<s>[U]" + head + tail + "[/U][A]", add_special_tokens=False)["input_ids"]
    assert chat.decode(prefix_ids) == "<s>[U]" + head and chat.decode(suffix_ids) == tail + "[/U][A]"
    raw = _sample("lcc")
    prefix_ids, suffix_ids = longbench_run.encode_sample(chat, raw, 3500)
    assert prefix_ids + suffix_ids == chat(build_prompt(raw))["input_ids"]
    prefix_ids, suffix_ids = longbench_run.encode_sample(tiny_tokenizer, sample, 3500)
    assert prefix_ids + suffix_ids == tiny_tokenizer(build_prompt(sample))["input_ids"]
    assert tiny_tokenizer.decode(suffix_ids) == tail


def test_split_is_the_whole_prompt_cut_at_a_token_boundary(smollm2_tokenizer) -> None:
    """lcc's template runs the context straight into "Next line of code": a context ending in a space makes the
    whole prompt's token " Next" straddle the split, which the parts tokenized apart would cut into " " and "Next".
    The ids are the whole prompt's, and the straddling token opens the question part."""
    sample = dataclasses.replace(_sample("lcc"), context="x = 1\ny = ")
    head, tail = prompt_parts(sample)
    whole = smollm2_tokenizer(build_prompt(sample))["input_ids"]
    apart = smollm2_tokenizer(head)["input_ids"] + smollm2_tokenizer(tail, add_special_tokens=False)["input_ids"]
    assert apart != whole  # the case the split must handle
    prefix_ids, suffix_ids = longbench_run.encode_sample(smollm2_tokenizer, sample, 3500)
    assert prefix_ids + suffix_ids == whole
    assert smollm2_tokenizer.decode(prefix_ids) == head.removesuffix(" ")
    assert smollm2_tokenizer.convert_ids_to_tokens(suffix_ids[:1]) == ["ĠNext"]  # the space and the question's word


def test_split_needs_a_fast_tokenizer(tiny_tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(type(tiny_tokenizer), "is_fast", property(lambda self: False))
    with pytest.raises(CriticalKVError, match="LongBench needs a fast tokenizer"):
        longbench_run.encode_sample(tiny_tokenizer, _sample("lcc"), 3500)


def test_rows_scores_and_resume(data: Path, model_folder: Path, tmp_path: Path, monkeypatch) -> None:
    args = [str(data), "--model", str(model_folder), "--device", "cpu", "--methods", "snapkv", "--budgets", "0.5"]
    args += ["--max-new-tokens", "3"]
    probe = tmp_path / "probe"
    code, output = _invoke([*args, "--samples", "2", "--out", str(probe)])
    assert code == 0, output
    rows = load_rows(probe / "results.jsonl")
    assert sorted({(r.task, r.index) for r in rows}) == [("hotpotqa", 0), ("hotpotqa", 1), ("lcc", 0), ("lcc", 1)]
    assert sorted((r.method, r.budget) for r in rows) == [("full", 1.0)] * 4 + [("snapkv", 0.5)] * 4
    assert all(r.regime == "agnostic" and 0 < r.kept_fraction <= 1 for r in rows)
    # the random model's answers score 0 on any real answer: its full-cache answers become the gold ones
    full = {(r.task, r.index): r.prediction for r in rows if r.method == "full"}
    for dataset in ("hotpotqa", "lcc"):
        records = [_record(dataset, i) for i in range(3)]
        for i in (0, 1):
            records[i]["answers"].append(full[(dataset, i)])
        _write(data / f"{dataset}.jsonl", records)

    out = tmp_path / "out"
    code, output = _invoke([*args, "--samples", "2", "--out", str(out)])
    assert code == 0, output
    answered = []
    real = longbench_run.score_item
    monkeypatch.setattr(longbench_run, "score_item", lambda item, p: answered.append(item.index) or real(item, p))
    code, output = _invoke([*args, "--samples", "3", "--out", str(out)])  # resumes: each dataset's third sample
    assert code == 0, output
    assert answered == [2, 2, 2, 2]  # two datasets x two pairs
    rows = load_rows(out / "results.jsonl")
    assert len(rows) == 12 and len({(r.task, r.index, r.method) for r in rows}) == 12

    groups = longbench_run.read_datasets(data)
    samples = [s for group in groups.values() for s in group]
    summary = json.loads((out / "summary.json").read_text())
    for method in ("full", "snapkv"):
        answers = {(r.task, r.index): r.prediction for r in rows if r.method == method}
        predictions = [answers[(s.dataset, i)] for group in groups.values() for i, s in enumerate(group)]
        expected = score_samples(samples, predictions)
        entry = next(e for e in summary["rows"] if e["method"] == method)
        assert entry["tasks"] == pytest.approx({k: v for k, v in expected.items() if k != "average"})
        assert entry["mean"] == pytest.approx(expected["average"])
    assert next(e for e in summary["rows"] if e["method"] == "full")["mean"] > 0
    report = (out / "report.md").read_text()
    assert report.startswith(f"# LongBench (max length 3500), {model_folder.name}, float32, question-agnostic\n")

    settings = json.loads((out / SETTINGS_FILE).read_text())  # a folder of the first protocol: no version key
    del settings["protocol"]
    (out / SETTINGS_FILE).write_text(json.dumps(settings))
    code, output = _invoke([*args, "--samples", "3", "--out", str(out)])
    assert code != 0 and "other settings" in output and "protocol" in output


def test_full_budget_answers_as_the_uncompressed_model(data: Path, model_folder: Path, tmp_path: Path) -> None:
    """snapkv at budget 1.0 and the full cache answer as transformers' own greedy generation on THUDM's prompt, up
    to hotpotqa's 32 new tokens."""
    out = tmp_path / "out"
    args = [str(data), "--model", str(model_folder), "--device", "cpu", "--datasets", "hotpotqa", "--samples", "1"]
    code, output = _invoke([*args, "--methods", "snapkv", "--budgets", "1.0", "--mode", "aware", "--out", str(out)])
    assert code == 0, output
    assert {r.regime for r in load_rows(out / "results.jsonl")} == {"aware"}
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    prompt = tokenizer(build_prompt(_sample("hotpotqa")), return_tensors="pt")["input_ids"]  # (1, t)
    eos = tokenizer.eos_token_id
    generated = model.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = generated[0, prompt.shape[1] :].tolist()
    assert len(new) == 32 or new[-1] == eos
    reference = tokenizer.decode(new, skip_special_tokens=True)  # scored as decoded, as THUDM does
    rows = load_rows(out / "results.jsonl")
    assert [(r.method, r.prediction) for r in rows] == [("full", reference), ("snapkv", reference)]
    assert all(r.prompt_tokens == prompt.shape[1] and r.kept_fraction == 1.0 for r in rows)


@pytest.fixture(scope="module")
def line_break_folder(tmp_path_factory, tiny_tokenizer) -> Path:
    """A Llama whose next token depends on the last token alone (attention and MLP outputs zero, so the last hidden
    state is its embedding): after any token but a line break the line break is far ahead; after it, never."""
    folder = tmp_path_factory.mktemp("line-break-llama")
    save_random_llama(folder, tiny_tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    newline = tiny_tokenizer.encode("\n", add_special_tokens=False)[-1]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight  # (vocab, hidden)
        embeddings[:, 0] = 10.0
        embeddings[newline, 0] = -10.0
        model.lm_head.weight[newline, 0] = 10.0  # the line break's logit: about +-80, against ~1 for the others
    model.save_pretrained(folder)
    return folder


def test_samsum_stops_at_the_first_line_break(line_break_folder: Path, tmp_path: Path) -> None:
    """samsum answers as THUDM's pred.py generates it: stopping at the end-of-sequence token or the line break,
    neither allowed as the first token; without the line-break stop the answer would go on past it."""
    file = _write(tmp_path / "samsum.jsonl", [_record("samsum", 0)])
    out = tmp_path / "out"
    args = [str(file), "--model", str(line_break_folder), "--device", "cpu", "--methods", "snapkv", "--budgets", "1.0"]
    code, output = _invoke([*args, "--out", str(out)])
    assert code == 0, output
    tokenizer = AutoTokenizer.from_pretrained(line_break_folder)
    model = AutoModelForCausalLM.from_pretrained(line_break_folder, dtype=torch.float32).eval()
    prompt = tokenizer(build_prompt(_sample("samsum")), return_tensors="pt")["input_ids"]  # (1, t)
    eos, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)[-1]
    thudm = {"max_new_tokens": 128, "do_sample": False, "pad_token_id": eos}
    stops = {"eos_token_id": [eos, newline], "min_length": prompt.shape[1] + 1}
    new = model.generate(prompt, **thudm, **stops)[0, prompt.shape[1] :].tolist()
    assert len(new) == 2 and new[1] == newline  # one token, then the line break
    reference = tokenizer.decode(new, skip_special_tokens=True)  # scored as decoded, as THUDM does
    rows = load_rows(out / "results.jsonl")
    assert [(r.method, r.prediction) for r in rows] == [("full", reference), ("snapkv", reference)]
    unstopped = model.generate(prompt, **thudm, eos_token_id=eos)[0, prompt.shape[1] :].tolist()
    assert tokenizer.decode(unstopped, skip_special_tokens=True).strip() != reference


def test_cli_errors(data: Path, model_folder: Path, tmp_path: Path, monkeypatch) -> None:
    def sweep(*args, **kwargs):
        raise AssertionError("the sweep started")

    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", sweep)
    model = ["--model", str(model_folder), "--device", "cpu", "--out", str(tmp_path / "out")]
    _write(tmp_path / "empty.jsonl", [])
    for args, message in [
        ([str(tmp_path / "absent")], f"LongBench data not found: {tmp_path / 'absent'}"),
        ([str(data), "--datasets", "hotpotqa,squad"], "Unknown LongBench dataset 'squad'"),
        ([str(tmp_path / "empty.jsonl")], "no samples in"),
        ([str(data), "--max-length", "30"], "max length 30 is too small for hotpotqa sample hotpotqa-0"),
        ([str(data), "--max-length", "0"], "--max-length must be >= 1, got 0"),
        ([str(data), "--samples", "-1"], "--samples must be >= 0, got -1"),
        ([str(data), "--max-new-tokens", "-2"], "--max-new-tokens must be >= 0, got -2"),
    ]:
        code, output = _invoke([*args, *model])
        assert code == 2 and "error:" in output and message in output, output
    assert not (tmp_path / "out").exists()


def test_other_datasets_stop_at_the_models_end_of_sequence_tokens(line_break_folder: Path, tmp_path: Path) -> None:
    """Outside samsum THUDM's pred.py calls ``generate`` with the model's defaults, so the answer ends at any token of
    the model's ``generation_config.eos_token_id``: here a list holding the line break, which the tokenizer's
    end-of-sequence token alone would run past."""
    folder = tmp_path / "model"
    shutil.copytree(line_break_folder, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)[-1]
    config = GenerationConfig.from_pretrained(folder)
    config.eos_token_id = [eos, newline]
    config.save_pretrained(folder)
    file = _write(tmp_path / "hotpotqa.jsonl", [_record("hotpotqa", 0)])
    out = tmp_path / "out"
    args = [str(file), "--model", str(folder), "--device", "cpu", "--methods", "snapkv", "--budgets", "1.0"]
    code, output = _invoke([*args, "--out", str(out)])
    assert code == 0, output
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tokenizer(build_prompt(_sample("hotpotqa")), return_tensors="pt")["input_ids"]  # (1, t)
    new = model.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=eos)[0, prompt.shape[1] :].tolist()
    assert new == [newline]  # the model's default stop: the line break, at once
    past = model.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert len(past[0]) - prompt.shape[1] > 1  # the tokenizer's token alone does not stop there
    rows = load_rows(out / "results.jsonl")
    # the stop token is part of the answer, decoded as THUDM's pred.py decodes generate's output
    assert [(r.method, r.prediction) for r in rows] == [("full", "\n"), ("snapkv", "\n")]


def test_resume_keeps_the_dtype_answered_in(data: Path, model_folder: Path, tmp_path: Path, monkeypatch) -> None:
    """The folder records the dtype the model loaded in (auto and its dtype are one setting); a folder of before
    recorded the word as typed: "auto" resumes with auto only, an alias (fp32) with any --dtype loading its dtype."""
    from criticalkv.eval.sweep import _settings_conflict

    recorded = []

    def sweep(*args, settings, **kwargs):
        recorded.append(settings)
        raise CriticalKVError("stop before answering")

    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", sweep)
    out = tmp_path / "out"
    args = [str(data), "--model", str(model_folder), "--device", "cpu", "--samples", "1", "--out", str(out)]

    def dtype_recorded(flag: list[str]) -> str:
        code, output = _invoke([*args, *flag])
        assert code != 0 and "stop before answering" in output
        return recorded[-1]["dtype"]

    # the random folder is saved in float32: auto loads float32
    assert [dtype_recorded(f) for f in ([], ["--dtype", "float32"], ["--dtype", "bf16"])] == [
        "float32", "float32", "bfloat16"
    ]  # fmt: skip
    out.mkdir()
    for word, flag, setting, refused in (
        ("auto", [], "auto", False),
        ("auto", ["--dtype", "float32"], "float32", True),
        ("fp32", [], "fp32", False),
        ("fp32", ["--dtype", "float"], "fp32", False),
        ("fp32", ["--dtype", "bfloat16"], "bfloat16", True),
    ):
        (out / SETTINGS_FILE).write_text(json.dumps({**recorded[0], "dtype": word}))
        assert dtype_recorded(flag) == setting
        conflict = _settings_conflict(out, recorded[-1])
        assert (conflict is not None) == refused, (word, flag)
        assert not refused or f"dtype: '{word}' there, '{setting}' now" in conflict
