"""Allocators: AdaKV against a brute-force reference of its definition, PyramidKV's layer budgets against kvpress's
formula, HeadKV's profile-driven budgets and profile handling, and end to end on a tiny random Llama."""

from __future__ import annotations

import functools
import json
import math
import shutil
import warnings

import pytest
import torch
from conftest import save_random_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

import criticalkv
from criticalkv.allocators import (
    AdaKVAllocator,
    HeadKVAllocator,
    HeadProfile,
    HeadProfileError,
    HeadProfileWarning,
    PyramidAllocator,
    load_profile,
)
from criticalkv.allocators import head_profile as head_profile_module
from criticalkv.allocators.pyramid import pyramid_budgets
from criticalkv.errors import BudgetError, CriticalKVError
from criticalkv.eval.head_calibration import calibrate_head_profile
from criticalkv.methods import PRESETS, build_method
from criticalkv.models.presets import PRESETS as MODEL_PRESETS
from criticalkv.runtime.method import Method
from criticalkv.scorers import LayerView, SnapKVScorer
from criticalkv.selectors import CriticalSelector, TopKSelector

# --------------------------------------------------------------------------------------------------------------
# helpers


class _Attn(nn.Module):
    """What the allocators read of an attention module: its layer index and the model config."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.o_proj = nn.Linear(config.num_attention_heads * 4, config.hidden_size, bias=False)


def _config(layers: int = 4, heads: int = 4, kv_heads: int = 2, hidden: int = 64, **kw) -> LlamaConfig:
    kw.setdefault("vocab_size", 96)
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        **kw,
    )


def _view(lengths: list[int], t: int, h_kv: int, config: LlamaConfig | None = None, layer: int = 0) -> LayerView:
    """A left-padded view whose tensors only carry shapes (allocators read ``valid`` and the module)."""
    b = len(lengths)
    config = config or _config(kv_heads=h_kv, heads=h_kv, hidden=16 * h_kv)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for row, n in enumerate(lengths):
        valid[row, t - n :] = True
    g = config.num_attention_heads // config.num_key_value_heads
    keys = torch.randn(b, h_kv, t, 4)
    return LayerView(_Attn(config, layer), torch.randn(b, h_kv * g, t, 4), keys, torch.randn_like(keys), valid, 0.5)


def _window(view: LayerView, w: int) -> torch.Tensor:
    t = view.valid.shape[1]
    prot = torch.zeros_like(view.valid)
    if w:
        prot[:, t - w :] = True
    return prot & view.valid


def _distinct_scores(b: int, h: int, t: int, seed: int) -> torch.Tensor:
    """Scores all distinct across the whole layer (AdaKV compares heads with each other)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(b * h * t, generator=gen).float() + 1).view(b, h, t) / (b * h * t)


def _adakv_reference(scores, budgets, valid, protected, safeguard, beside_window=False) -> torch.Tensor:
    """AdaKV's picks by its definition, one entry at a time: (b, h, t) bool. A head reserves the first ``n_safe``
    of its own order (kvpress), or with ``beside_window`` its protected positions and ``n_safe`` more (the AdaKV
    authors' code: the best ``n_safe`` others lifted to the top score, then the window appended at that score)."""
    b, h, t = scores.shape
    picked = torch.zeros(b, h, t, dtype=torch.bool)
    for row in range(b):
        budget = int(budgets[row])
        n_safe = min(max(1, math.floor(safeguard * budget + 1e-9)), budget)
        entries = []  # (tier, secondary, head, position)
        for head in range(h):
            mine = [i for i in range(t) if valid[row, i]]
            # a head's own order: protected positions (most recent first), then by score
            own = sorted(
                mine, key=lambda i: (not protected[row, i], -i if protected[row, i] else -scores[row, head, i])
            )
            n_protected = sum(bool(protected[row, i]) for i in mine)
            safe = set(own[: min(budget, n_protected + n_safe)] if beside_window else own[:n_safe])
            for i in mine:
                tier = 2 if i in safe else (1 if protected[row, i] else 0)
                secondary = i if protected[row, i] else float(scores[row, head, i])
                entries.append((tier, secondary, head, i))
        # ties inside the protected tier: the same position in every head, lower head first
        entries.sort(key=lambda e: (-e[0], -e[1], e[2]))
        for _, _, head, i in entries[: h * budget]:
            picked[row, head, i] = True
    return picked


# --------------------------------------------------------------------------------------------------------------
# AdaKV


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=st.integers(1, 4),
    t=st.integers(6, 40),
    window=st.integers(0, 8),
    safeguard=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    beside_window=st.booleans(),
    data=st.data(),
)
def test_adakv_matches_bruteforce_reference(h, t, window, safeguard, beside_window, data):
    lengths = [t, data.draw(st.integers(1, t))]  # batch 2, the second row left-padded
    budgets = torch.tensor([data.draw(st.integers(1, n)) for n in lengths])
    view = _view(lengths, t, h)
    protected = _window(view, window)
    scores = _distinct_scores(2, h, t, seed=data.draw(st.integers(0, 10_000)))
    scores = scores.masked_fill(~view.valid[:, None, :], 123.0)  # padding holds garbage: must never be picked

    got = AdaKVAllocator(safeguard, safeguard_beside_window=beside_window).allocate(scores, budgets, view, protected)
    picked = _adakv_reference(scores, budgets, view.valid, protected, safeguard, beside_window)
    assert torch.equal(got, picked.sum(-1))
    assert torch.equal(got.sum(-1), h * budgets)  # exact totals
    n_safe = torch.clamp(torch.floor(budgets * safeguard + 1e-9).long(), min=1)
    floor = n_safe + protected.sum(-1) if beside_window else n_safe
    assert bool((got >= torch.minimum(floor, budgets)[:, None]).all())  # safeguard respected
    assert bool((got >= 1).all())
    assert bool((got <= torch.tensor(lengths)[:, None]).all())

    # top-k selection then keeps exactly AdaKV's picks: the layer-wide top-k with the safeguard
    keep = TopKSelector().select(scores, got, protected, view)
    assert torch.equal(keep, picked)
    assert not bool((keep & ~view.valid[:, None, :]).any())


def test_adakv_moves_budget_to_spread_heads():
    """A head with one sharp peak gives entries to a head whose scores are flat but high."""
    t, budget = 20, 5
    scores = torch.zeros(1, 2, t)
    scores[0, 0] = torch.linspace(0.01, 0.02, t)
    scores[0, 0, 3] = 1.0  # sharp head
    scores[0, 1] = torch.linspace(0.5, 0.6, t)  # spread head
    view = _view([t], t, 2)
    got = AdaKVAllocator(0.2).allocate(scores, torch.tensor([budget]), view)
    assert got.tolist() == [[1, 9]]  # the sharp head keeps its reserved peak, the rest goes to the spread head


def test_adakv_protected_window_always_counts():
    t, w, budget = 30, 6, 10
    view = _view([t], t, 3)
    protected = _window(view, w)
    scores = _distinct_scores(1, 3, t, 0)
    scores[..., t - w :] = 0.0  # even with the lowest scores the window survives the global cut
    got = AdaKVAllocator().allocate(scores, torch.tensor([budget]), view, protected)
    assert bool((got >= w).all()) and int(got.sum()) == 3 * budget
    keep = TopKSelector().select(scores, got, protected, view)
    assert bool(keep[..., t - w :].all())


def test_adakv_safeguard_beside_the_window_reserves_both():
    """A starved head: kvpress's rule counts the window as its safeguard (it keeps max(n_safe, P) = 8); the AdaKV
    authors' code reserves its best n_safe = 4 others beside the window (8 + 4)."""
    t, w, budget = 60, 8, 20
    view = _view([t], t, 2)
    protected = _window(view, w)
    scores = torch.zeros(1, 2, t)
    scores[0, 0] = torch.linspace(0.0, 0.01, t)  # starved: every score below every score of head 1
    scores[0, 1] = torch.linspace(0.5, 0.6, t)
    kvpress_rule = AdaKVAllocator(0.2).allocate(scores, torch.tensor([budget]), view, protected)
    beside = AdaKVAllocator(0.2, safeguard_beside_window=True).allocate(scores, torch.tensor([budget]), view, protected)
    assert kvpress_rule.tolist() == [[8, 32]]
    assert beside.tolist() == [[12, 28]]


def test_adakv_rejects_bad_safeguard():
    with pytest.raises(ValueError):
        AdaKVAllocator(1.5)


# --------------------------------------------------------------------------------------------------------------
# PyramidKV


def _kvpress_pyramid(q_len: int, budget: int, layers: int, beta: float) -> list[int]:
    """kvpress 0.5.5 PyramidKVPress.get_layer_budget with window_size=0 (no window: the formulas coincide)."""
    min_num = budget / beta
    max_num = budget * 2 - min_num
    if max_num >= q_len:
        max_num = q_len
        min_num = budget * 2 - max_num
    steps = (max_num - min_num) / (layers - 1)
    return [round(max_num - i * steps) for i in range(layers)]


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("budget", [3, 40, 77, 180])
def test_pyramid_budgets_decrease_and_average_to_the_budget(window, budget):
    layers, n = 12, 200
    got = pyramid_budgets(torch.tensor([budget]), torch.tensor([n]), torch.tensor([window]), layers, 20.0)[0]
    assert int(got.sum()) == layers * budget  # mean exactly the requested budget
    assert bool((got[:-1] >= got[1:]).all())  # non-increasing in depth
    assert int(got[0]) > int(got[-1]) or budget - min(window, budget) < 2
    assert int(got.min()) >= min(window, budget) and int(got.max()) <= n
    if window == 0:  # kvpress's formula, up to its per-layer rounding
        ref = torch.tensor(_kvpress_pyramid(n, budget, layers, 20.0))
        assert int((got - ref).abs().max()) <= 1


def test_pyramid_allocator_per_layer_and_row():
    config = _config(layers=6, kv_heads=2, heads=4)
    lengths, t, window = [64, 40], 64, 4
    budgets = torch.tensor([20, 10])
    per_layer = []
    for layer in range(6):
        view = _view(lengths, t, 2, config, layer)
        out = PyramidAllocator(beta=20).allocate(torch.rand(2, 2, t), budgets, view, _window(view, window))
        assert out.shape == (2, 2) and bool((out[:, 0] == out[:, 1]).all())  # every head gets the layer's budget
        per_layer.append(out[:, 0])
    per_layer = torch.stack(per_layer, 1)  # (b, layers)
    assert torch.equal(per_layer.sum(1), 6 * budgets)
    assert bool((per_layer[:, :-1] >= per_layer[:, 1:]).all()) and bool((per_layer[:, 0] > per_layer[:, -1]).all())
    assert bool((per_layer >= window).all())
    uniform = PyramidAllocator(beta=1).allocate(torch.rand(2, 2, t), budgets, _view(lengths, t, 2, config, 3))
    assert torch.equal(uniform, budgets[:, None].expand(2, 2))
    with pytest.raises(ValueError):
        PyramidAllocator(beta=0.5)


# --------------------------------------------------------------------------------------------------------------
# HeadKV and profiles


def _profile(config: LlamaConfig, seed: int = 0) -> HeadProfile:
    gen = torch.Generator().manual_seed(seed)
    importance = torch.rand(config.num_hidden_layers, config.num_key_value_heads, generator=gen) + 0.01
    return HeadProfile.from_config(config, importance, name="test", measurement={"samples": 0})


def test_headkv_sums_per_layer_and_follows_the_profile():
    config = _config(layers=3, heads=8, kv_heads=4)
    profile = _profile(config)
    lengths, t, window = [100, 70], 100, 8
    budgets = torch.tensor([30, 21])
    alloc = HeadKVAllocator(profile, base_share=0.2)
    for layer in range(3):
        view = _view(lengths, t, 4, config, layer)
        out = alloc.allocate(torch.rand(2, 4, t), budgets, view, _window(view, window))
        assert torch.equal(out.sum(-1), 4 * budgets)
        assert bool((out >= window).all()) and bool((out <= torch.tensor(lengths)[:, None]).all())
        w = profile.matrix[layer]
        for a in range(4):
            for c in range(4):
                if w[a] > w[c]:
                    assert bool((out[:, a] >= out[:, c]).all())
        # the formula: P + base*E + (1-base)*n*E*w/sum(w), up to rounding
        extra = (budgets - window).double()[:, None]
        ideal = window + 0.2 * extra + 0.8 * extra * 4 * (w / w.sum())[None, :]
        assert float((out - ideal).abs().max()) < 1.0
    uniform = HeadKVAllocator(profile, base_share=1.0).allocate(
        torch.rand(2, 4, t), budgets, _view(lengths, t, 4, config)
    )
    assert torch.equal(uniform, budgets[:, None].expand(2, 4))


def test_headkv_caps_heads_at_the_row_length():
    config = _config(layers=1, heads=2, kv_heads=2)
    profile = HeadProfile.from_config(config, [[100.0, 1.0]])
    out = HeadKVAllocator(profile, base_share=0.0).allocate(
        torch.rand(1, 2, 10), torch.tensor([8]), _view([10], 10, 2, config)
    )
    assert out.tolist() == [[10, 6]]


def test_headkv_model_scope_pools_all_layers():
    config = _config(layers=2, heads=2, kv_heads=2)
    profile = HeadProfile.from_config(config, [[4.0, 4.0], [1.0, 1.0]])
    alloc = HeadKVAllocator(profile, base_share=0.2, scope="model")
    outs = [alloc.allocate(torch.rand(1, 2, 50), torch.tensor([20]), _view([50], 50, 2, config, i)) for i in range(2)]
    assert int(outs[0].sum() + outs[1].sum()) == 2 * 2 * 20  # the model total is kept
    assert int(outs[0].sum()) > int(outs[1].sum())  # the important layer gets more


def test_headkv_errors():
    config = _config(layers=2, heads=4, kv_heads=2)
    other = _config(layers=3, heads=4, kv_heads=2)
    view = _view([20], 20, 2, config)
    with pytest.raises(HeadProfileError, match=r"another model.*num_layers: 3 vs 2"):
        HeadKVAllocator(_profile(other)).allocate(torch.rand(1, 2, 20), torch.tensor([5]), view)
    view4 = _view([20], 20, 4, config)  # the config says 2 KV heads, the layer has 4
    with pytest.raises(HeadProfileError, match=r"2 KV heads per layer.*has 4"):
        HeadKVAllocator(_profile(config)).allocate(torch.rand(1, 4, 20), torch.tensor([5]), view4)
    lopsided = HeadProfile.from_config(config, [[1000.0, 1.0], [1.0, 1.0]])
    with pytest.raises(BudgetError, match="zero entries"):
        HeadKVAllocator(lopsided, base_share=0.0).allocate(torch.rand(1, 2, 20), torch.tensor([2]), view)
    with pytest.raises(HeadProfileError):
        HeadProfile.from_config(config, torch.ones(3, 2))  # wrong matrix shape
    with pytest.raises(HeadProfileError):
        HeadProfile.from_config(config, torch.zeros(2, 2))  # importances must be > 0
    with pytest.raises(ValueError):
        HeadKVAllocator(base_share=1.5)
    assert issubclass(HeadProfileError, CriticalKVError)


def test_profile_refuses_a_model_of_other_query_heads_or_head_dim():
    """Same layers x KV heads (the importance matrix fits) is not enough: GQA groups and head size are matched."""
    config = _config(layers=2, heads=4, kv_heads=2, head_dim=16)
    profile = _profile(config)
    assert profile.mismatches(_config(layers=2, heads=8, kv_heads=2, head_dim=16)) == ["num_heads: 4 vs 8"]
    with pytest.raises(HeadProfileError, match=r"another model.*head size 16.*head_dim: 16 vs 32"):
        profile.check(_config(layers=2, heads=4, kv_heads=2, head_dim=32))


def test_profile_json_round_trip(tmp_path):
    config = _config(layers=3, heads=6, kv_heads=3, hidden=96)
    profile = _profile(config)
    profile.query_scores = torch.rand(3, 6).tolist()
    path = profile.save(tmp_path / "p.json")
    loaded = HeadProfile.load(path)
    assert loaded.shape == profile.shape and loaded.name == "test" and loaded.measurement == {"samples": 0}
    assert torch.allclose(loaded.matrix, profile.matrix, atol=1e-6)
    assert torch.allclose(torch.tensor(loaded.query_scores), torch.tensor(profile.query_scores), atol=1e-6)
    data = json.loads(path.read_text())
    data["format"] = "something-else"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(HeadProfileError, match="not a criticalkv head profile"):
        HeadProfile.load(tmp_path / "bad.json")


def test_load_profile_finds_shipped_and_user_profiles(tmp_path, monkeypatch):
    monkeypatch.setattr(head_profile_module, "user_profile_dir", lambda: tmp_path)
    smollm2 = _config(layers=30, heads=9, kv_heads=3, hidden=576, head_dim=64, name_or_path="models/smollm2-135m")
    shipped = load_profile(smollm2)
    assert shipped.name == "smollm2-135m" and shipped.matrix.shape == (30, 3)
    assert shipped.measurement["samples"] >= 1 and "date" in shipped.measurement
    tiny = _config(layers=2, heads=4, kv_heads=2, name_or_path="test")
    with pytest.raises(HeadProfileError, match="calibrate-heads"):
        load_profile(tiny)
    _profile(tiny).save(tmp_path / "tiny.json")  # a user-calibrated profile is found next time
    assert load_profile(tiny).name == "test"


def test_load_profile_prefers_the_models_own_and_warns_when_only_the_shape_matches(tmp_path, monkeypatch):
    """A profile named after the model's folder wins over one of the same shape found first (the user's own come
    before the shipped ones); a profile found by shape alone is used with a HeadProfileWarning naming both."""
    monkeypatch.setattr(head_profile_module, "user_profile_dir", lambda: tmp_path)
    smollm2 = _config(layers=30, heads=9, kv_heads=3, hidden=576, head_dim=64)
    mine = _profile(smollm2)
    mine.name = "my-finetune"
    mine.save(tmp_path / "my-finetune.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smollm2.name_or_path = "/models/smollm2-135m"  # the preset's converted folder
        assert load_profile(smollm2).name == "smollm2-135m"
        smollm2.name_or_path = "/data/my-finetune"
        assert load_profile(smollm2).name == "my-finetune"
    smollm2.name_or_path = "/data/another-finetune"
    with pytest.warns(HeadProfileWarning, match="'another-finetune'; using 'my-finetune'.*calibrate-heads"):
        assert load_profile(smollm2).name == "my-finetune"


def test_a_ragged_profile_file_is_a_clear_error_and_hides_no_other(tmp_path, monkeypatch):
    monkeypatch.setattr(head_profile_module, "user_profile_dir", lambda: tmp_path)
    tiny = _config(layers=2, heads=4, kv_heads=2, name_or_path="test")
    data = _profile(tiny).to_dict()
    data["importance"] = [[1.0, 2.0], [3.0]]  # a hand-edited file with a short row
    (tmp_path / "a-ragged.json").write_text(json.dumps(data))
    with pytest.raises(HeadProfileError, match="malformed head profile"):
        HeadProfile.load(tmp_path / "a-ragged.json")
    _profile(tiny).save(tmp_path / "b-tiny.json")
    assert load_profile(tiny).name == "test"


@pytest.mark.parametrize("preset", [p.name for p in MODEL_PRESETS.values()])
def test_every_model_preset_ships_a_head_profile_of_its_shape(tmp_path, monkeypatch, preset):
    monkeypatch.setattr(head_profile_module, "user_profile_dir", lambda: tmp_path)  # shipped profiles only
    arch = MODEL_PRESETS[preset].architecture
    config = AutoConfig.for_model(
        arch.model_type,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        hidden_size=arch.heads * arch.head_dim,
        name_or_path=f"models/{preset}",  # a preset's converted folder
    )
    profile = load_profile(config)
    assert profile.name == preset and profile.matrix.shape == (arch.layers, arch.kv_heads)
    assert profile.measurement["samples"] >= 1 and bool((profile.matrix > 0).all())


# --------------------------------------------------------------------------------------------------------------
# end to end on a tiny random Llama


@functools.cache
def _tiny_model():
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(
        _config(layers=2, heads=4, kv_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():  # sharper attention than the default init: heads disagree visibly
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def _prompt(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(lengths)
    ids = torch.randint(3, 96, (len(lengths), t), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, t - n :] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _check_records(compressor, lengths, h_kv=2, budget=0.3, differ=True):
    assert len(compressor.records) == 2
    wanted = torch.tensor([h_kv * math.floor(budget * n) for n in lengths])
    for record in compressor.records:
        assert torch.equal(record.kept.sum(-1), wanted)
    if differ:
        assert any(bool((r.kept[:, 0] != r.kept[:, 1]).any()) for r in compressor.records)


@pytest.mark.parametrize("method", ["critical-adakv", "adakv"])
def test_adakv_presets_end_to_end(method):
    model = _tiny_model()
    lengths = [200, 150]
    ids, mask = _prompt(lengths)
    with criticalkv.compress(model, method, budget=0.3) as compressor:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 204)
    _check_records(compressor, lengths)


def test_headkv_custom_method_end_to_end():
    model = _tiny_model()
    lengths = [200, 150]
    ids, mask = _prompt(lengths)
    profile = HeadProfile.from_config(model.config, [[3.0, 1.0], [1.0, 3.0]], name="tiny")
    method = Method(SnapKVScorer(), HeadKVAllocator(profile), CriticalSelector())
    with criticalkv.compress(model, method, budget=0.3) as compressor:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 204)
    _check_records(compressor, lengths)
    first, second = compressor.records
    assert bool((first.kept[:, 0] > first.kept[:, 1]).all()) and bool((second.kept[:, 1] > second.kept[:, 0]).all())


def test_pyramid_and_headkv_presets_end_to_end():
    model = _tiny_model()
    ids, mask = _prompt([200])
    with criticalkv.compress(model, "critical-pyramidkv", budget=0.3) as compressor:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    first, second = (r.kept[0, 0] for r in compressor.records)
    assert int(first) > int(second) and int(first + second) == 2 * 60
    with pytest.raises(HeadProfileError, match="calibrate-heads"), criticalkv.compress(model, "headkv", budget=0.3):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)


def test_presets_are_listed_and_take_options():
    for name in ("adakv", "critical-adakv", "pyramidkv", "critical-pyramidkv", "headkv", "critical-headkv"):
        assert name in PRESETS and PRESETS[name].summary
    method = build_method("critical-adakv", safeguard=0.1, alpha=0.25)
    assert method.allocator.safeguard == 0.1 and method.selector.alpha == 0.25
    assert build_method("pyramidkv", beta=5).allocator.beta == 5
    assert build_method("headkv", base_share=0.5).allocator.base_share == 0.5


def test_calibration_runs_on_a_tiny_model(tiny_tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        _config(layers=2, heads=4, kv_heads=2, vocab_size=tiny_tokenizer.vocab_size), attn_implementation="sdpa"
    )
    model.eval()
    profile = calibrate_head_profile(model, tiny_tokenizer, samples=2, lengths=(96,), progress=True, name="tiny")
    assert model.config._attn_implementation == "sdpa"  # eager only for the teacher-forced forward
    assert profile.matrix.shape == (2, 2) and bool((profile.matrix >= 0.01).all())
    assert torch.tensor(profile.query_scores).shape == (2, 4)
    assert profile.measurement["samples"] == 2 and profile.measurement["lengths"] == [96]
    assert not profile.mismatches(model.config)


def test_a_calibrated_folder_finds_its_own_profile(tmp_path, monkeypatch, tiny_tokenizer):
    """calibrate-heads names a profile as load_profile looks for it: after calibrating a folder, loading that
    folder finds its profile by name, without a shape-only warning, though another of its shape comes first."""
    from criticalkv.eval.head_calibration import calibrate_preset

    monkeypatch.setattr(head_profile_module, "user_profile_dir", lambda: tmp_path / "profiles")
    folder = save_random_llama(
        tmp_path / "my-llama",
        tiny_tokenizer,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    profile, path = calibrate_preset(str(folder), samples=1, lengths=(96,), progress=False)
    assert profile.name == "my-llama" and path == tmp_path / "profiles" / "my-llama.json"
    model = AutoModelForCausalLM.from_pretrained(folder)
    other = _profile(model.config)
    other.save(tmp_path / "profiles" / "a-first.json")  # "test", of the same shape, found first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_profile(model.config).name == "my-llama"
    # another folder of the same name and shape (run2/my-llama): a's profile is not taken for its own
    twin_folder = tmp_path / "run2" / "my-llama"
    shutil.copytree(folder, twin_folder)
    twin = AutoModelForCausalLM.from_pretrained(twin_folder)
    with pytest.warns(HeadProfileWarning, match="was measured on .*, not on this model"):
        assert load_profile(twin.config).measurement["source"] == str(folder.resolve())
    _, twin_path = calibrate_preset(str(twin_folder), samples=1, lengths=(96,), progress=False)
    assert twin_path != path and twin_path.name.startswith("my-llama-")  # the first folder's profile stays
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_profile(twin.config).measurement["source"] == str(twin_folder.resolve())
        assert load_profile(model.config).measurement["source"] == str(folder.resolve())
    _, again_path = calibrate_preset(str(folder), samples=1, lengths=(96,), progress=False)
    assert again_path == path  # calibrating a folder again replaces its own profile


def test_calibration_runs_on_a_model_with_sliding_window_layers(tiny_tokenizer):
    """Gemma 3's sliding layers hold only their window: each layer's hits are counted on the positions it holds."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=tiny_tokenizer.vocab_size,
        num_hidden_layers=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    profile = calibrate_head_profile(model, tiny_tokenizer, samples=2, lengths=(96,), progress=False, name="tiny")
    assert profile.matrix.shape == (2, 2) and bool((profile.matrix >= 0.01).all())
    assert torch.tensor(profile.query_scores).shape == (2, 4)
    assert not profile.mismatches(model.config)


def test_a_profile_option_names_a_saved_profile_by_its_path(tmp_path):
    """``--option profile=<path>`` (a string on the command line) loads the profile ``calibrate-heads --out``
    saved; a path that holds none is refused as a bad option value."""
    from criticalkv.errors import MethodOptionError
    from criticalkv.methods import build_method

    profile = _profile(_config(), seed=5)
    path = profile.save(tmp_path / "p.json")
    method = build_method("headkv", profile=str(path))
    assert method.allocator.profile == HeadProfile.load(path)
    assert build_method(f"critical-headkv:profile={path}").allocator.profile == method.allocator.profile
    with pytest.raises(MethodOptionError, match="cannot read head profile"):
        build_method("headkv", profile=str(tmp_path / "missing.json"))
