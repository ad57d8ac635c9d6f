"""Output-perturbation analysis: the vectorised figures against a slow per-head loop, the bounds never exceeded, the
capture against the model's own attention, the analytic compressed output against the runtime's, the brute-force
optimum against a naive search, and the command end to end on a tiny random model."""

from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig
from typer.testing import CliRunner

import criticalkv
from criticalkv.analysis.capture import attention_modules, capture
from criticalkv.analysis.command import (
    TEXT_QUESTION,
    essay_window_prompts,
    parse_pairs,
    perturbation,
    run_analysis,
    window_prompts,
)
from criticalkv.analysis.exhaustive import (
    exhaustive_check,
    optimal_subset,
    random_head,
    selector_masks,
    subset_perturbations,
)
from criticalkv.analysis.perturbation import (
    LayerAttention,
    compare,
    head_output_weights,
    head_perturbation,
    head_value_norms,
    kept_mask,
    measure_prompt,
    violation_slack,
)
from criticalkv.budget import Budget
from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.methods import build_method
from criticalkv.selectors import projected_value_norm

VOCAB = 320


# --- helpers ------------------------------------------------------------------------------------------------------


def _random_layer(seed: int, b=1, h_kv=2, g=2, t=20, f=3, d=8, hidden=12, padding=0, sharp=2.0):
    gen = torch.Generator().manual_seed(seed)
    h_q = h_kv * g
    query = torch.randn(b, h_q, f, d, generator=gen) * sharp
    keys = torch.randn(b, h_kv, t, d, generator=gen)
    values = torch.randn(b, h_kv, t, d, generator=gen) * torch.exp(torch.randn(b, h_kv, t, 1, generator=gen))
    follow_keys = torch.randn(b, h_kv, f, d, generator=gen)
    follow_values = torch.randn(b, h_kv, f, d, generator=gen)
    weight = torch.randn(hidden, h_q * d, generator=gen) / d**0.5
    valid = torch.ones(b, t, dtype=torch.bool)
    if padding:
        valid[-1, :padding] = False  # left padding of the last row
    keep = (torch.rand(b, h_kv, t, generator=gen) < 0.5) & valid[:, None, :]
    keep[..., -1] = True  # at least one valid entry per head
    return query, keys, values, weight, follow_keys, follow_values, valid, keep, d**-0.5


def _reference(query, keys, values, keep, weight, scaling, follow_keys, follow_values, valid):
    """Obviously correct per (row, head, query) loop: returns perturbation, paper bound, tight bound, kept mass."""
    b, h_q, f, d = query.shape
    h_kv = keys.shape[1]
    g = h_q // h_kv
    out = torch.zeros(4, b, h_q, f)
    for row in range(b):
        for head in range(h_q):
            kv = head // g
            w = weight[:, head * d : (head + 1) * d].T.double()  # (d, hidden)
            for j in range(f):
                ks = torch.cat([keys[row, kv], follow_keys[row, kv, : j + 1]]).double()
                vs = torch.cat([values[row, kv], follow_values[row, kv, : j + 1]]).double()
                allowed = torch.cat([valid[row], torch.ones(j + 1, dtype=torch.bool)])
                kept = torch.cat([keep[row, kv] & valid[row], torch.ones(j + 1, dtype=torch.bool)])
                logits = (ks @ query[row, head, j].double()) * scaling
                a = torch.softmax(logits.masked_fill(~allowed, -torch.inf), -1)
                a_hat = torch.softmax(logits.masked_fill(~kept, -torch.inf), -1)
                u = vs @ w  # (n, hidden)
                loss = ((a - a_hat) @ u).abs().sum()
                sigma = a[kept].sum()
                weighted = a * u.abs().sum(-1)
                paper = weighted[~kept].sum() + (1 / sigma - 1) * weighted[kept].sum()
                tight = ((a * ~kept) @ u).abs().sum() + (1 / sigma - 1) * ((a * kept) @ u).abs().sum()
                out[:, row, head, j] = torch.stack([loss, paper, tight, sigma]).float()
    return out


@functools.cache
def _tiny_model(attn: str = "sdpa", config_class=LlamaConfig, **extra):
    torch.manual_seed(7)
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():  # sharper attention than the default init, so evictions change the output visibly
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def _ids(t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


# --- the figures ----------------------------------------------------------------------------------------------------


def test_keeping_everything_is_zero():
    q, k, v, w, fk, fv, valid, _, scaling = _random_layer(0, b=2, padding=5)
    everything = valid[:, None, :].expand(-1, k.shape[1], -1)
    hp = head_perturbation(q, k, v, everything, w, scaling, fk, fv, valid)
    assert torch.equal(hp.perturbation, torch.zeros_like(hp.perturbation))
    assert hp.bound_paper.abs().max() < 1e-5 and hp.bound_tight.abs().max() < 1e-5
    assert torch.allclose(hp.kept_mass, torch.ones_like(hp.kept_mass))


@pytest.mark.parametrize(
    "shape",
    [
        dict(b=1, h_kv=1, g=1, t=7, f=1),
        dict(b=2, h_kv=2, g=3, t=25, f=4, padding=6),  # GQA groups of 3, a left-padded row
        dict(b=1, h_kv=3, g=2, t=40, f=2, d=16, hidden=20),
    ],
)
def test_vectorised_equals_per_head_loop(shape):
    q, k, v, w, fk, fv, valid, keep, scaling = _random_layer(1, **shape)
    hp = head_perturbation(q, k, v, keep, w, scaling, fk, fv, valid)
    ref = _reference(q, k, v, keep, w, scaling, fk, fv, valid)
    for i, got in enumerate((hp.perturbation, hp.bound_paper, hp.bound_tight, hp.kept_mass)):
        torch.testing.assert_close(got, ref[i], rtol=1e-4, atol=1e-5)


def _layer_reference(query, keys, values, keep, weight, scaling, follow_keys, follow_values, valid):
    """Obviously correct: the layer's attention output, heads concatenated and multiplied by o_proj, with the full
    cache and with the kept entries; the L1 norm of their difference per (row, query): (b, f)."""
    b, h_q, f, _ = query.shape
    g = h_q // keys.shape[1]
    out = torch.zeros(b, f, dtype=torch.float64)
    for row in range(b):
        for j in range(f):
            full, kept_out = [], []
            for head in range(h_q):
                kv = head // g
                ks = torch.cat([keys[row, kv], follow_keys[row, kv, : j + 1]]).double()
                vs = torch.cat([values[row, kv], follow_values[row, kv, : j + 1]]).double()
                allowed = torch.cat([valid[row], torch.ones(j + 1, dtype=torch.bool)])
                kept = torch.cat([keep[row, kv] & valid[row], torch.ones(j + 1, dtype=torch.bool)])
                logits = (ks @ query[row, head, j].double()) * scaling
                full.append(torch.softmax(logits.masked_fill(~allowed, -torch.inf), -1) @ vs)
                kept_out.append(torch.softmax(logits.masked_fill(~kept, -torch.inf), -1) @ vs)
            o_proj = weight.double()  # (hidden, h_q * d): the layer's output is o_proj(concatenated heads)
            out[row, j] = (o_proj @ torch.cat(full) - o_proj @ torch.cat(kept_out)).abs().sum()
    return out.float()


def test_layer_output_change_equals_o_proj_of_the_concatenated_heads():
    """The per-layer figure is the attention block's output change (heads summed through o_proj), which head
    changes can partly cancel: at most the sum of the heads' perturbations."""
    for shape in (dict(b=2, h_kv=2, g=3, t=25, f=4, padding=6), dict(b=1, h_kv=3, g=2, t=40, f=2, d=16, hidden=20)):
        q, k, v, w, fk, fv, valid, keep, scaling = _random_layer(2, **shape)
        hp = head_perturbation(q, k, v, keep, w, scaling, fk, fv, valid)
        torch.testing.assert_close(hp.layer_perturbation, _layer_reference(q, k, v, keep, w, scaling, fk, fv, valid),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
        assert bool((hp.layer_perturbation <= hp.perturbation.sum(1) * (1 + 1e-5)).all())
        assert bool((hp.layer_perturbation < hp.perturbation.sum(1)).any())  # heads cancel in part


def test_causal_context_queries_equal_following_queries():
    """Context queries at known positions (the window subset) read the context causally: the same figures as the
    same tokens treated as following tokens over the shorter context, when the kept set holds them."""
    q, k, v, w, _, _, _, keep, scaling = _random_layer(3, b=2, h_kv=2, g=2, t=30, f=5)
    t, f = 30, 5
    keep[..., t - f :] = True
    w_heads = head_output_weights(w, q.shape[1])
    window = LayerAttention(q, k, v, w_heads, scaling, query_positions=torch.arange(t - f, t)).perturbation(keep)
    split = LayerAttention(q, k[:, :, : t - f], v[:, :, : t - f], w_heads, scaling, k[:, :, t - f :], v[:, :, t - f :])
    follow = split.perturbation(keep[..., : t - f])
    for name in ("perturbation", "bound_paper", "bound_tight", "kept_mass"):
        torch.testing.assert_close(getattr(window, name), getattr(follow, name), rtol=1e-5, atol=1e-6)


def test_head_output_weights_are_the_o_proj_column_slices():
    w = torch.randn(10, 3 * 4)
    heads = head_output_weights(w, 3)
    for h in range(3):
        assert torch.equal(heads[h], w[:, h * 4 : (h + 1) * 4].T)


def test_selector_value_norm_is_the_group_mean_of_the_head_norms():
    """The value norm CriticalKV selects with is the GQA-group mean of the per-head norms the bound uses."""
    _, _, values, weight, *_ = _random_layer(4, b=2, h_kv=3, g=2, t=11, d=8, hidden=12)
    per_head = head_value_norms(values, head_output_weights(weight, 6))  # (b, h_q, t)
    torch.testing.assert_close(projected_value_norm(values, weight), per_head.view(2, 3, 2, 11).mean(2))


@settings(max_examples=60)
@given(
    seed=st.integers(0, 10_000),
    h_kv=st.integers(1, 2),
    g=st.integers(1, 3),
    t=st.integers(2, 30),
    f=st.integers(1, 4),
    top=st.floats(0.5, 0.95),
    sharp=st.floats(0.1, 4.0),
)
def test_bounds_hold_when_half_the_mass_is_kept(seed, h_kv, g, t, f, top, sharp):
    """L <= tight <= paper, with the kept set built so that the kept mass is >= 1/2 for every query."""
    q, k, v, w, fk, fv, valid, _, scaling = _random_layer(seed, h_kv=h_kv, g=g, t=t, f=f, sharp=sharp)
    attention = LayerAttention(q, k, v, head_output_weights(w, q.shape[1]), scaling, fk, fv, valid)
    # keep, per KV head, the context entries by descending max attention (over queries and the group) until every
    # query has `top` of its mass kept
    a = attention.attention[..., :t]  # (b, h_kv, G, f, t)
    order = a.amax(dim=(2, 3)).argsort(-1, descending=True)  # (b, h_kv, t)
    keep = torch.zeros(1, h_kv, t, dtype=torch.bool)
    for n_kept in range(t + 1):
        keep.zero_()
        keep.scatter_(-1, order[..., :n_kept], True)
        hp = attention.perturbation(keep)
        if bool((hp.kept_mass >= top).all()):
            break
    assert bool((hp.kept_mass >= 0.5).all())
    slack = violation_slack(hp)
    assert bool((hp.perturbation <= hp.bound_tight + slack).all())
    assert bool((hp.bound_tight <= hp.bound_paper + slack).all())
    # the paper's form C - (2 - 1/sigma) sum_S a_i is the same number
    weighted = attention.weighted.reshape(1, -1, f, attention.weighted.shape[-1])
    follow = attention.follow_allowed.expand(1, h_kv, 1, f, f)
    kept = torch.cat([keep[:, :, None, None, :].expand(1, h_kv, 1, f, t), follow], -1)
    kept_weighted = (attention.weighted * kept).sum(-1).reshape(1, -1, f)
    paper = weighted.sum(-1) - (2 - 1 / hp.kept_mass) * kept_weighted
    assert bool(((paper - hp.bound_paper).abs() <= 1e-5 * hp.total + 1e-6).all())  # C - ... cancels in float32


# --- real tensors of a tiny model -----------------------------------------------------------------------------------


def test_capture_matches_the_models_own_attention():
    """The captured queries, keys and values reproduce each layer's attention output (o_proj's input) of an eager
    forward over the whole sequence, for the context and the following tokens."""
    model = _tiny_model("sdpa")
    context, question = _ids(90, 1), _ids(5, 2)
    cap = capture(model, context, question, generate=4)
    assert model.config._attn_implementation == "sdpa"
    assert not any("_criticalkv_capture" in m.__dict__ for m in attention_modules(model))
    assert cap.labels == ["question"] * 5 + ["generated"] * 4 and cap.chunks == [5, 1, 1, 1, 1]
    sequence = torch.cat([context, cap.follow_ids], dim=1)
    seen = {}
    hooks = [
        m.o_proj.register_forward_pre_hook(lambda mod, args, i=m.layer_idx: seen.__setitem__(i, args[0].detach()))
        for m in attention_modules(model)
    ]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=sequence, output_hidden_states=True)
    finally:
        model.set_attn_implementation("sdpa")
        for h in hooks:
            h.remove()
    t, f = context.shape[1], cap.follow_ids.shape[1]
    for layer in cap.layers:
        g = layer.query.shape[1] // layer.keys.shape[1]
        q = torch.cat([layer.query, layer.follow_query], dim=2)  # (1, h_q, t + f, d)
        k = torch.cat([layer.keys, layer.follow_keys], dim=2).repeat_interleave(g, 1)
        v = torch.cat([layer.values, layer.follow_values], dim=2).repeat_interleave(g, 1)
        logits = (q @ k.transpose(-1, -2)) * layer.scaling
        causal = torch.ones(t + f, t + f, dtype=torch.bool).tril()
        expected = torch.softmax(logits.masked_fill(~causal, -torch.inf), -1) @ v  # (1, h_q, t + f, d)
        got = seen[layer.layer].view(1, t + f, -1, q.shape[-1]).transpose(1, 2)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cap.hidden, out.hidden_states[-1][:, t:], rtol=1e-4, atol=1e-4)


def test_analytic_compressed_output_equals_the_runtime():
    """Layer 0's ô computed from the captured tensors equals what criticalkv's runtime attention outputs for the
    following tokens over the compressed cache (layer 0's inputs do not depend on the compression)."""
    model = _tiny_model()
    context, question = _ids(120, 3), _ids(4, 4)
    cap = capture(model, context, question, generate=3)
    budget = Budget(0.3)
    layer = cap.layers[0]
    keep = kept_mask(build_method("critical-snapkv"), layer.view(), budget)
    w_heads = head_output_weights(layer.module.o_proj.weight, layer.query.shape[1])
    attention = LayerAttention(
        layer.follow_query, layer.keys, layer.values, w_heads, layer.scaling, layer.follow_keys, layer.follow_values
    )
    expected = attention.perturbation(keep, return_output=True).compressed_output  # (1, h_q, f, d)
    seen = []
    hook = layer.module.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad(), criticalkv.compress(model, "critical-snapkv", budget) as compressor:
            compressor.record_keep = True
            out = model(input_ids=context, use_cache=True)
            seen.clear()
            cache, offset = out.cache, 0
            for size in cap.chunks:
                model(input_ids=cap.follow_ids[:, offset : offset + size], cache=cache, use_cache=True)
                offset += size
    finally:
        hook.remove()
    assert torch.equal(compressor.records[0].keep, keep)
    got = torch.cat(seen, dim=1)  # (1, f, h_q * d)
    got = got.view(1, got.shape[1], -1, layer.query.shape[-1]).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_measured_prompt_bounds_and_runtime_agreement():
    model = _tiny_model()
    cap = capture(model, _ids(150, 5), _ids(6, 6), generate=4)
    methods = {"snapkv": build_method("snapkv"), "critical-snapkv": build_method("critical-snapkv")}
    result = measure_prompt(model, cap, methods, [Budget(0.3), Budget(0.6), Budget(1.0)], one_forward=False)
    assert result.info["full_path_vs_capture_l1"] == 0.0  # the comparison path itself adds nothing
    fast = measure_prompt(model, cap, {"snapkv": methods["snapkv"]}, [Budget(0.3)])  # following tokens at once
    assert fast.info["full_path_vs_capture_l1"] < 1e-4 * float(cap.hidden.abs().sum(-1).mean())
    assert fast.scalars[("snapkv", "0.3")]["hidden_l1_all"] == pytest.approx(
        result.scalars[("snapkv", "0.3")]["hidden_l1_all"], rel=1e-3
    )
    for (name, budget), scalars in result.scalars.items():
        assert scalars["bound_violations_paper"] == 0 and scalars["bound_violations_tight"] == 0, (name, budget)
        assert scalars["runtime_kept_same_set"] == 1.0, (name, budget)
        heads = result.heads[(name, budget)]
        assert heads["perturbation"]["all"].shape == (2, 6) and heads["perturbation"]["window"].shape == (2, 6)
        if budget == "1":
            assert (heads["perturbation"]["all"] == 0).all() and scalars["hidden_l1_all"] == 0.0
        else:
            assert (heads["perturbation"]["all"] > 0).any() and scalars["hidden_l1_all"] > 0


# --- brute force ----------------------------------------------------------------------------------------------------


def test_optimum_equals_naive_brute_force():
    gen = torch.Generator().manual_seed(11)
    for n, budget in [(5, 2), (7, 3), (8, 4), (8, 1)]:
        q, k, v, w, scaling = random_head(gen, entries=n, queries=3, head_dim=8, hidden=10)
        mask, best = optimal_subset(q, k, v, w, budget, scaling, chunk=7)  # small chunks: several blocks
        naive = []
        for combo in itertools.combinations(range(n), budget):
            keep = torch.zeros(1, 1, n, dtype=torch.bool)
            keep[0, 0, list(combo)] = True
            hp = head_perturbation(q[None, None], k[None, None], v[None, None], keep, w.T, scaling)
            naive.append((float(hp.perturbation.mean()), combo))
        value, combo = min(naive)
        assert best == pytest.approx(value, rel=1e-5, abs=1e-7)
        assert int(mask.sum()) == budget
        chosen = tuple(int(i) for i in mask.nonzero().flatten())
        assert chosen == combo or dict((c, v) for v, c in naive)[chosen] == pytest.approx(value, rel=1e-5)


def test_optimum_is_below_every_selector():
    gen = torch.Generator().manual_seed(12)
    for _ in range(8):
        q, k, v, w, scaling = random_head(gen, entries=11, queries=4)
        _, best = optimal_subset(q, k, v, w, 4, scaling)
        masks = selector_masks(q, k, v, w, 4, scaling)
        for name, mask in masks.items():
            assert int(mask.sum()) == 4, name
            assert float(subset_perturbations(q, k, v, w, scaling, mask[None])[0]) >= best * (1 - 1e-6), name
    summary = exhaustive_check(trials=5, entries=9, budget=3)
    for stats in summary["selectors"].values():
        assert stats["mean_ratio"] >= 1 - 1e-6 and stats["median_ratio"] >= 1 - 1e-6
    with pytest.raises(ValueError):
        optimal_subset(*random_head(gen, entries=17)[:4], 4, 0.25)


def test_compare_counts_and_ratios():
    a = torch.tensor([1.0, 2.0, 4.0, 0.0]).numpy()
    b = torch.tensor([0.1, 2.0, 8.0, 1.0]).numpy()
    c = compare(a, b)
    assert c["n"] == 4 and c["fraction_b_lower"] == 0.25 and c["fraction_equal"] == 0.25 and c["n_ratio"] == 3
    assert c["median_log10_ratio"] == pytest.approx(0.0) and c["mean_log10_ratio"] == pytest.approx(
        (-1 + 0 + 0.30103) / 3, abs=1e-4
    )


# --- the command ----------------------------------------------------------------------------------------------------


def test_parse_pairs():
    assert parse_pairs(None, ["a", "b", "c"]) == [("a", "b"), ("a", "c")]
    assert parse_pairs("b:c", ["a", "b", "c"]) == [("b", "c")]
    for bad in ("a", "a:z", ":b"):
        with pytest.raises(CriticalKVError):
            parse_pairs(bad, ["a", "b"])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    _tiny_model().save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def _app():
    app = typer.Typer()
    app.command("perturbation")(perturbation)
    app.command("noop")(lambda: None)  # two commands: the command name stays a sub-command
    return app


def test_command_end_to_end(tiny_folder, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. What is the special magic number? " * 30)
    out = tmp_path / "out"
    args = ["perturbation", "--model", str(tiny_folder), "--methods", "snapkv,critical-snapkv,streaming"]
    args += ["--budgets", "0.5,48", "--prompts", str(text), "--n", "2", "--length", "96", "--generate", "3"]
    args += ["--out", str(out), "--exhaustive-check", "--exhaustive-trials", "3", "--exhaustive-entries", "8"]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "perturbation.json").read_text())
    assert data["meta"]["attention"] == "sdpa" and data["meta"]["dtype"] == "float32"
    assert len(data["prompts"]) == 2 and data["layers"] == [0, 1]
    heads = data["results"]["critical-snapkv"]["48"]["heads"]["perturbation"]["all"]
    assert len(heads) == 2 and len(heads[0]) == 2 and len(heads[0][0]) == 6  # prompt x layer x query head
    pairs = {(p["a"], p["b"], p["budget"], p["subset"]) for p in data["summary"]["pairs"]}
    assert ("snapkv", "critical-snapkv", "0.5", "all") in pairs and ("snapkv", "streaming", "48", "question") in pairs
    for row in data["summary"]["pairs"]:
        assert 0.0 <= row["heads"]["fraction_b_lower"] <= 1.0
    for by_budget in data["summary"]["bounds"].values():
        for bounds in by_budget.values():
            assert bounds["bound_violations_paper"] == 0 and bounds["runtime_kept_same_set"] == 1.0
    layer_output = data["results"]["critical-snapkv"]["48"]["layer_output"]["all"]
    assert len(layer_output) == 2 and len(layer_output[0]) == 2  # prompt x layer
    assert len(data["summary"]["per_layer_output"]["snapkv"]["0.5"]["all"]) == 2
    assert all(0.0 <= p["layer_output"]["fraction_b_lower"] <= 1.0 for p in data["summary"]["pairs"])
    assert set(data["exhaustive"]["selectors"]) == {"topk", "critical", "measured"}
    for name in ("layers", "layer_output", "hidden", "hist_snapkv_vs_critical-snapkv", "heatmap_snapkv_vs_streaming"):
        assert (out / f"{name}.png").stat().st_size > 1000, name
    # the summary and figures again from the JSON alone, for another pair
    again = CliRunner().invoke(_app(), ["perturbation", "--from-json", str(out / "perturbation.json"),
                                        "--pairs", "streaming:critical-snapkv", "--out", str(out)])  # fmt: skip
    assert again.exit_code == 0, again.output
    redone = json.loads((out / "perturbation.json").read_text())
    assert {(p["a"], p["b"]) for p in redone["summary"]["pairs"]} == {("streaming", "critical-snapkv")}
    assert redone["results"] == data["results"]
    assert (out / "hist_streaming_vs_critical-snapkv.png").exists()


def test_summary_without_hidden_states_shows_dashes(tiny_folder, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    args = ["perturbation", "--model", str(tiny_folder), "--methods", "snapkv,critical-snapkv", "--budgets", "0.5"]
    args += ["--prompts", str(text), "--n", "1", "--length", "96", "--generate", "2", "--no-hidden"]
    result = CliRunner().invoke(_app(), [*args, "--out", str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "nan" not in result.output and "│ -" in result.output


def test_window_prompts_are_consecutive_windows_of_the_text(tiny_tokenizer):
    text = " ".join(f"word{i}" for i in range(400))
    tokens = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = window_prompts(tiny_tokenizer, text, "words", n=3, length=50)
    assert [p.info["start_token"] for p in prompts] == [0, 50, 100]
    for p in prompts:
        window = tiny_tokenizer.decode(tokens[p.info["start_token"] : p.info["start_token"] + 50])
        assert tiny_tokenizer.decode(p.context_ids).startswith(window)  # then the plain-text separator
        assert tiny_tokenizer.decode(p.question_ids).strip() == TEXT_QUESTION
    assert len({tuple(p.context_ids) for p in prompts}) == 3
    short = window_prompts(tiny_tokenizer, "a b c d e", "short", n=2, length=4)  # cycles through a short text
    assert [p.info["start_token"] for p in short] == [
        0,
        4 % len(tiny_tokenizer("a b c d e", add_special_tokens=False)["input_ids"]),
    ]
    with pytest.raises(CriticalKVError, match="holds no text"):
        window_prompts(tiny_tokenizer, "", "empty", n=1, length=4)


def test_essay_windows_are_different_texts_of_the_asked_length(smollm2_tokenizer):
    from criticalkv.eval.needle import load_haystack

    prompts = essay_window_prompts(smollm2_tokenizer, n=3, length=300)
    essays = smollm2_tokenizer(load_haystack()[:20000], add_special_tokens=False)["input_ids"]
    for i, p in enumerate(prompts):
        assert p.info == {"source": "essay windows", "start_token": 300 * i}
        assert smollm2_tokenizer.decode(essays[300 * i : 300 * i + 300]) in smollm2_tokenizer.decode(p.context_ids)
        assert abs(len(p.context_ids) - len(prompts[0].context_ids)) <= 5  # the same template around each window
    assert prompts[0].question_ids == prompts[2].question_ids


def test_command_refuses_bad_input(tiny_folder, tmp_path):
    runner = CliRunner()
    for methods in ("full,snapkv", "nope"):
        result = runner.invoke(_app(), ["perturbation", "--model", str(tiny_folder), "--methods", methods,
                                        "--out", str(tmp_path)])  # fmt: skip
        assert result.exit_code == 2, result.output


def test_question_aware_regime(tiny_folder, tmp_path):
    """--mode aware: the question is compressed with the context; only generated tokens follow."""
    from criticalkv.analysis.command import run_analysis

    text = tmp_path / "text.txt"
    text.write_text("A small text about a fox and a dog, repeated. " * 40)
    payload = run_analysis(model=str(tiny_folder), methods="snapkv,critical-snapkv", budgets="0.5",
                           prompts=str(text), n=1, length=80, out=tmp_path, mode="aware", generate=3,
                           plots=False, progress=False)  # fmt: skip
    assert payload["meta"]["regime"].startswith("question-aware")
    assert payload["prompts"][0]["question_tokens"] == 0 and payload["prompts"][0]["generated_tokens"] == 3
    assert payload["summary"]["subsets"] == ["all", "generated", "window"]
    with pytest.raises(CriticalKVError):
        run_analysis(model=str(tiny_folder), prompts=str(text), n=1, out=tmp_path, mode="aware", generate=0)


def test_bound_counts_are_of_the_following_queries_only():
    """The window's diagnostic queries have their own figures but stay out of the counts (docs: following queries)."""
    model = _tiny_model()
    cap = capture(model, _ids(150, 5), _ids(6, 6), generate=4)
    methods = {"snapkv": build_method("snapkv"), "streaming": build_method("streaming")}
    with_window, without = (
        measure_prompt(model, cap, methods, [Budget(0.5)], window=w, hidden=False).scalars for w in (32, 0)
    )
    for key in with_window:
        for count in ("kept_mass_below_half", "bound_violations_paper", "bound_violations_tight"):
            assert with_window[key][count] == without[key][count], (key, count)
    below = checked = 0
    for c in cap.analysed:  # the share over the following queries, directly
        attention = LayerAttention(
            c.follow_query, c.keys, c.values, head_output_weights(c.module.o_proj.weight, c.query.shape[1]),
            c.scaling, c.follow_keys, c.follow_values, c.valid,
        )  # fmt: skip
        kept_mass = attention.perturbation(kept_mask(methods["streaming"], c.view(), Budget(0.5))).kept_mass
        below, checked = below + int((kept_mass < 0.5).sum()), checked + kept_mass.numel()
    assert with_window[("streaming", "0.5")]["kept_mass_below_half"] == pytest.approx(below / checked)


def test_analysis_refuses_methods_that_decide_layers_together(tmp_path):
    for name in ("layer-defensive", "layer-defensive-bounded", "reconstruct", "critical-ada-reconstruct"):
        with pytest.raises(CriticalKVError, match="per-layer methods only"):
            run_analysis(model="unused", methods=f"snapkv,{name}", n=0, out=tmp_path)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_soft_capped_or_sink_attention_is_refused(family):
    from transformers import Gemma2Config, GptOssConfig

    config_class, extra = {
        "gemma2": (Gemma2Config, {"head_dim": 16}),
        "gpt_oss": (GptOssConfig, {"head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1}),
    }[family]
    model = _tiny_model("eager", config_class, **extra)
    with pytest.raises(UnsupportedModelError, match=r"soft-capped logits .* or attention sinks"):
        capture(model, _ids(60, 5), _ids(6, 6), generate=2)


def test_a_model_without_full_attention_layers_is_refused():
    from transformers import MistralConfig

    model = _tiny_model(config_class=MistralConfig, sliding_window=4096)  # every layer a sliding-window layer
    cap = capture(model, _ids(60, 5), _ids(6, 6), generate=2)
    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        measure_prompt(model, cap, {"snapkv": build_method("snapkv")}, [Budget(0.5)], hidden=False)
