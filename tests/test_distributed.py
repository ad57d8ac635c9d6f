"""Tensor- and pipeline-parallel runs decide exactly as one process: a real ``torchrun`` launch (2 ranks, gloo on
CPU) of a tiny random Llama (4 query / 2 KV heads, float32) split by heads then by layers, against the same model
in this process. Plus the per-rank imbalance cap against a one-entry-at-a-time reference, and the early errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM
from transformers.cache_utils import DummyLayer
from transformers.distributed import DistributedConfig
from typer.testing import CliRunner

import criticalkv
from criticalkv.allocators import AdaKVAllocator, HeadProfile
from criticalkv.cache import CompressedCache
from criticalkv.cli import app
from criticalkv.core.layout import GATHERED_STYLES, plan_style
from criticalkv.distributed import (
    UnevenHeadsError,
    cap_rank_imbalance,
    check_even_heads,
    check_model,
    check_parallel_split,
    head_shard,
    launch,
    output_projection,
)
from criticalkv.distributed.equivalence import compare, prompt, run_method
from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.methods import build_method
from criticalkv.models import loading
from criticalkv.runtime.method import Method
from criticalkv.runtime.session import full_cache
from criticalkv.scorers import LayerView, Scorer

METHODS = ["critical-snapkv", "critical-adakv", "critical-headkv", "critical-tova", "layer-defensive", "defensive"]
CAPPED = "critical-adakv:max_rank_imbalance=0"  # every rank holds the same share of each layer
BUDGET, TOKENS, ROWS, NEW_TOKENS = 0.2, 256, 2, 6  # B = 51 entries per head > SnapKV's 32-token window
_SHAPE = {  # the fields of _config another family takes as they are
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
}


def _config(vocab: int, heads: int = 4, kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=16 * heads,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )


# --------------------------------------------------------------------------------------------------------------
# a real torchrun launch against this process


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory, tiny_tokenizer) -> Path:
    """``model/``: a random Llama with its tokenizer; ``cache/head_profiles/``: a HeadKV profile for its shape."""
    root = tmp_path_factory.mktemp("distributed")
    config = _config(len(tiny_tokenizer))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tiny_tokenizer.save_pretrained(root / "model")
    importance = torch.rand(4, 2, generator=torch.Generator().manual_seed(3)) + 0.1
    profile = HeadProfile.from_config(config, importance, name="model")  # the folder's name, as calibrate-heads does
    profile.save(root / "cache" / "head_profiles" / "tiny.json")
    return root


def _torchrun(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 -m <args>`` on this machine's CPUs (gloo), one thread per rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CRITICALKV_CACHE_DIR": str(root / "cache")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


@pytest.fixture(scope="module")
def split_runs(tiny_root: Path) -> dict:
    """One launch of 2 ranks: tensor parallelism over both, then 2 pipeline stages."""
    out = tiny_root / "split.pt"
    _torchrun(
        tiny_root,
        *("criticalkv.distributed.equivalence", "--model", str(tiny_root / "model")),
        *("--methods", ",".join([*METHODS, CAPPED]), "--budget", str(BUDGET), "--tokens", str(TOKENS)),
        *("--rows", str(ROWS), "--new-tokens", str(NEW_TOKENS), "--splits", "2x1,1x2", "--out", str(out)),
    )
    return torch.load(out, weights_only=False)


class _TwoRankCap(AdaKVAllocator):
    """AdaKV with the rank cap applied as if its heads were split over 2 ranks: the one-process reference."""

    def allocate(self, scores, row_budgets, view, protected=None):
        budgets = super().allocate(scores, row_budgets, view, protected)
        return cap_rank_imbalance(budgets, scores, view.valid, protected, 2, self.max_rank_imbalance)


@pytest.fixture(scope="module")
def single_runs(tiny_root: Path, split_runs) -> dict:
    """The same methods on the same prompt, in this process (one rank holds everything)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CRITICALKV_CACHE_DIR", str(tiny_root / "cache"))
        model, tokenizer = launch.load_model(str(tiny_root / "model"), dtype="float32")
        ids, mask = prompt(model, tokenizer, TOKENS, ROWS, seed=0)
        runs = {name: run_method(model, name, BUDGET, ids, mask, NEW_TOKENS) for name in METHODS}
        capped = build_method("critical-adakv", max_rank_imbalance=0.0)
        reference = Method(capped.scorer, _TwoRankCap(max_rank_imbalance=0.0), capped.selector)
        runs[CAPPED] = run_method(model, reference, BUDGET, ids, mask, NEW_TOKENS)
    return runs


def test_tensor_parallel_decides_as_one_process(split_runs, single_runs):
    split = split_runs["tp2xpp1"]
    assert compare(single_runs, split) == []  # kept indices, budgets, greedy tokens; logits within 1e-5
    assert sorted(split["critical-adakv"].keep) == [0, 1, 2, 3]
    assert split["critical-adakv"].keep[0].shape == (ROWS, 2, TOKENS)  # both ranks' heads, gathered


def test_pipeline_parallel_decides_as_one_process(split_runs, single_runs):
    split = split_runs["tp1xpp2"]
    uncapped = {name: run for name, run in single_runs.items() if name != CAPPED}
    assert compare(uncapped, split) == []
    assert compare({CAPPED: single_runs["critical-adakv"]}, split) == []  # no heads split: the cap does nothing


def test_rank_bytes(split_runs, single_runs):
    tp, pp = split_runs["tp2xpp1"], split_runs["tp1xpp2"]
    for name in METHODS:
        (total,) = single_runs[name].rank_bytes
        assert sum(tp[name].rank_bytes) == total == sum(pp[name].rank_bytes)
    snap = tp["critical-snapkv"].rank_bytes
    assert snap[0] == snap[1]  # uniform budgets: both ranks hold the same
    ada = tp["critical-adakv"].rank_bytes
    assert ada[0] != ada[1]  # AdaKV's head budgets load one rank more than the other...
    capped = tp[CAPPED].rank_bytes
    assert capped[0] == capped[1] < max(ada)  # ...unless the cap evens them out


@pytest.mark.parametrize(
    ("family", "projection"),
    [(Olmo2ForCausalLM, "k_proj"), (Phi3ForCausalLM, "qkv_proj")],
    ids=["olmo2", "phi3"],
)
def test_a_plan_that_gathers_the_heads_decides_as_one_process(family, projection, tmp_path, tiny_tokenizer):
    """OLMo 2's plan splits ``k_proj``'s weight but gathers its output, Phi-3's its fused ``qkv_proj``'s
    (``colwise_gather_output``): every rank holds every head, so the ranks must neither split the heads' decisions
    nor count each other's cache as theirs."""
    folder = tmp_path / "model"
    shape = {k: v for k, v in _config(len(tiny_tokenizer)).to_dict().items() if k in _SHAPE}
    torch.manual_seed(0)
    family(family.config_class(**shape, pad_token_id=1)).save_pretrained(folder)  # Phi-3 pads with id 32000
    tiny_tokenizer.save_pretrained(folder)
    methods = ["critical-snapkv", "critical-adakv", "critical-tova"]
    model, tokenizer = launch.load_model(str(folder), dtype="float32")
    assert plan_style(model, f"model.layers.0.self_attn.{projection}") in GATHERED_STYLES
    ids, mask = prompt(model, tokenizer, TOKENS, ROWS, seed=0)
    single = {name: run_method(model, name, BUDGET, ids, mask, NEW_TOKENS) for name in methods}
    out = tmp_path / "split.pt"
    _torchrun(
        tmp_path,
        *("criticalkv.distributed.equivalence", "--model", str(folder), "--methods", ",".join(methods)),
        *("--budget", str(BUDGET), "--tokens", str(TOKENS), "--rows", str(ROWS), "--new-tokens", str(NEW_TOKENS)),
        *("--tp-size", "2", "--out", str(out)),
    )
    (split,) = torch.load(out, weights_only=False).values()
    assert compare(single, split) == []
    for name in methods:
        (whole,) = single[name].rank_bytes
        assert split[name].rank_bytes == [whole, whole]  # each rank holds the whole cache


def test_cli_run_under_torchrun(tiny_root: Path, monkeypatch):
    """``criticalkv run`` split over 2 ranks answers as on one process; rank 0 alone prints and writes."""
    args = ["run", "--model", str(tiny_root / "model"), "--method", "critical-adakv", "--mode", "aware"]
    args += ["--context-tokens", "200"]
    args += ["--max-new-tokens", "3", "--dtype", "float32"]
    split = _torchrun(tiny_root, "criticalkv.cli", *args, "--json", str(tiny_root / "split.json"))
    assert split.stdout.count("question-aware (--mode aware)") == 1  # printed once: rank 1 printed nothing
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tiny_root / "cache"))
    single = CliRunner().invoke(app, [*args, "--json", str(tiny_root / "single.json")])
    assert single.exit_code == 0, single.output
    (split_report, single_report) = (json.loads((tiny_root / f).read_text()) for f in ("split.json", "single.json"))
    assert split_report["parallel"] == {"tensor_parallel": 2, "pipeline_stages": 1}
    for got, want in zip(split_report["results"], single_report["results"], strict=True):
        assert got["answer"] == want["answer"]
        assert got["kept_entries"] == want["kept_entries"]  # the whole model's, summed over the ranks
        assert got["kv_bytes_after_compression"] == want["kv_bytes_after_compression"] == sum(got["kv_bytes_per_rank"])
        assert len(got["kv_bytes_per_rank"]) == 2


def test_cli_agnostic_under_pipeline_stages(tiny_root: Path, monkeypatch):
    """Question-agnostic ``criticalkv run`` over 2 pipeline stages: every method, the full cache (transformers' own
    ``DynamicCache``) included, answers each question after the shared context as one process does."""
    args = ["run", "--model", str(tiny_root / "model"), "--method", "critical-snapkv", "--mode", "agnostic"]
    args += ["--context-tokens", "200", "--max-new-tokens", "12", "--dtype", "float32"]
    args += ["--question", "What_is_the_quick_fox", "--question", "dog_lazy"]
    _torchrun(tiny_root, "criticalkv.cli", "--pp-size", "2", *args, "--json", str(tiny_root / "pp-agnostic.json"))
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tiny_root / "cache"))
    single = CliRunner().invoke(app, [*args, "--json", str(tiny_root / "single-agnostic.json")])
    assert single.exit_code == 0, single.output
    split_report, single_report = (
        json.loads((tiny_root / f).read_text()) for f in ("pp-agnostic.json", "single-agnostic.json")
    )
    assert split_report["parallel"] == {"tensor_parallel": 1, "pipeline_stages": 2}
    for got, want in zip(split_report["results"], single_report["results"], strict=True):
        assert (got["method"], got["answer"]) == (want["method"], want["answer"])
        assert got["kv_bytes_after_compression"] == want["kv_bytes_after_compression"]


def test_eval_under_torchrun_batches_answers_as_one_process(tiny_root: Path, monkeypatch):
    """``criticalkv eval needle`` split over 2 ranks, the compressed pairs answering as one batch on each rank's
    head shard, stores the answers of one process; only rank 0 writes."""
    args = ["eval", "needle", "--model", str(tiny_root / "model"), "--methods", "snapkv,critical-adakv"]
    args += ["--budget", "0.3", "--lengths", "300", "--depths", "0,1", "--batch-answers"]
    _torchrun(tiny_root, "criticalkv.cli", *args, "--out", str(tiny_root / "needle-split"))
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tiny_root / "cache"))
    single = CliRunner().invoke(app, [*args, "--out", str(tiny_root / "needle-single")])
    assert single.exit_code == 0, single.output
    split_rows, single_rows = (
        [json.loads(line) for line in (tiny_root / folder / "results.jsonl").read_text().splitlines()]
        for folder in ("needle-split", "needle-single")
    )
    assert len(split_rows) == len(single_rows) == 2 * 3  # written once: 2 needles x (full + 2 pairs)
    report = (tiny_root / "needle-split" / "report.md").read_text()  # beside the heatmaps, as eval ruler's
    assert "| snapkv | 0.3 |" in report and "| critical-adakv | 0.3 |" in report
    for got, want in zip(split_rows, single_rows, strict=True):
        assert (got["method"], got["prediction"], got["kept_fraction"]) == (
            want["method"],
            want["prediction"],
            want["kept_fraction"],
        )


# --------------------------------------------------------------------------------------------------------------
# the imbalance cap


def _cap_reference(budgets, scores, valid, protected, ranks, max_imbalance):
    """One entry at a time: cut the over-full blocks' lowest kept entries, then add the best free entries."""
    out = budgets.clone()
    b, h, t = scores.shape
    per_rank = h // ranks
    for row in range(b):
        value = []  # value[head][k]: what a head with budget k + 1 keeps last (protected first, padding last)
        for head in range(h):
            entries = []
            for i in range(t):
                if not valid[row, i]:
                    entries.append(-math.inf)
                else:
                    entries.append(math.inf if protected[row, i] else float(scores[row, head, i]))
            value.append(sorted(entries, reverse=True))
        counts = out[row].tolist()
        total, length = sum(counts), int(valid[row].sum())
        mean = total / ranks
        cap = max(math.ceil(mean - 1e-9), math.floor((1 + max_imbalance) * mean + 1e-9))
        floor = [min(c, total // h) for c in counts]
        block_of = [head // per_rank for head in range(h)]
        moved = 0
        for r in range(ranks):
            mine = range(r * per_rank, (r + 1) * per_rank)
            while sum(counts[x] for x in mine) > cap:
                worst = min((x for x in mine if counts[x] > floor[x]), key=lambda x: value[x][counts[x] - 1])
                counts[worst] -= 1
                moved += 1
        for _ in range(moved):
            held = [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)]
            free = [x for x in range(h) if held[block_of[x]] < cap and counts[x] < length]
            best = max(free, key=lambda x: value[x][counts[x]])
            counts[best] += 1
        out[row] = torch.tensor(counts)
    return out


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 2),
    ranks=st.sampled_from([2, 3]),
    per_rank=st.integers(1, 3),
    t=st.integers(6, 40),
    window=st.integers(0, 4),
    share=st.floats(0.05, 0.9),
    max_imbalance=st.sampled_from([0.0, 0.1, 0.5, 3.0]),
)
def test_cap_matches_one_entry_at_a_time(seed, rows, ranks, per_rank, t, window, share, max_imbalance):
    gen = torch.Generator().manual_seed(seed)
    h = ranks * per_rank
    lengths = torch.randint(max(t // 2, 1), t + 1, (rows,), generator=gen)
    valid = torch.arange(t)[None, :] >= (t - lengths)[:, None]  # left padding
    protected = (torch.arange(t)[None, :] >= t - window) & valid
    scores = torch.rand(rows, h, t, generator=gen) ** 4  # distinct, concentrated in a few heads
    view = LayerView(
        None, torch.zeros(rows, h, t, 1), torch.zeros(rows, h, t, 1), torch.zeros(rows, h, t, 1), valid, 1.0
    )
    row_budgets = torch.clamp((lengths.double() * share).long(), min=window + 1)
    budgets = AdaKVAllocator().allocate(scores, row_budgets, view, protected)

    capped = cap_rank_imbalance(budgets, scores, valid, protected, ranks, max_imbalance)
    assert torch.equal(capped, _cap_reference(budgets, scores, valid, protected, ranks, max_imbalance))
    assert torch.equal(capped.sum(-1), budgets.sum(-1))  # the layer keeps as many entries as AdaKV decided
    totals = budgets.sum(-1, keepdim=True)
    assert bool((capped >= torch.minimum(budgets, totals // h)).all())  # no head cut below the mean head
    assert bool((capped <= lengths[:, None]).all())
    mean = totals.double() / ranks
    cap = torch.maximum(torch.ceil(mean - 1e-9), torch.floor((1 + max_imbalance) * mean + 1e-9))
    blocks = capped.view(rows, ranks, per_rank).sum(-1)
    assert bool((blocks <= cap).all())
    within = (budgets.view(rows, ranks, per_rank).sum(-1) <= cap).all(-1)
    assert torch.equal(capped[within], budgets[within])  # rows already within the cap are left alone


def test_cap_rejects_bad_arguments():
    scores, valid = torch.rand(1, 4, 8), torch.ones(1, 8, dtype=torch.bool)
    budgets = torch.full((1, 4), 3)
    with pytest.raises(ValueError, match="max_imbalance"):
        cap_rank_imbalance(budgets, scores, valid, None, 2, -0.1)
    with pytest.raises(ValueError, match="3 blocks"):
        cap_rank_imbalance(budgets, scores, valid, None, 3, 0.0)
    with pytest.raises(ValueError, match="max_rank_imbalance"):
        AdaKVAllocator(max_rank_imbalance=-1.0)


# --------------------------------------------------------------------------------------------------------------
# early errors and one-process behaviour


def test_uneven_heads_refused_before_loading(tmp_path, monkeypatch):
    folder = tmp_path / "uneven"
    _config(96, heads=6, kv_heads=3).save_pretrained(folder)  # 3 KV heads do not split over 2 ranks

    def never(*args, **kwargs):
        raise AssertionError("weights loaded before the heads were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    expected = r"3 KV heads \(6 query heads\), which do not split evenly over 2 tensor-parallel ranks.*\[1, 3\]"
    with pytest.raises(UnevenHeadsError, match=expected):
        loading.load_model(str(folder), distributed_config=DistributedConfig(tp_size=2))
    assert issubclass(UnevenHeadsError, UnsupportedModelError)
    check_even_heads(_config(96, heads=6, kv_heads=3), 3)  # 3 ranks: one KV head and two query heads each


def test_tensor_and_pipeline_parallelism_together_refused_before_loading(tmp_path, monkeypatch):
    """transformers 5.24 cannot load a model split both ways: its tensor-parallel plan names the modules that
    pipeline parallelism has just removed from the stage (``KeyError: 'model.embed_tokens.weight'``)."""
    folder = tmp_path / "tiny"
    _config(96).save_pretrained(folder)

    def never(*args, **kwargs):
        raise AssertionError("weights loaded before the split was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    both = DistributedConfig(tp_size=2, pp_size=2)
    with pytest.raises(UnsupportedModelError, match=r"2 tensor-parallel ranks x 2 pipeline stages.*--tp-size 4"):
        loading.load_model(str(folder), distributed_config=both)
    check_parallel_split(2, 1)  # one kind alone loads
    check_parallel_split(1, 2)


def test_uneven_heads_refused_before_the_first_forward():
    model = LlamaForCausalLM(_config(96, heads=6, kv_heads=3)).eval()
    check_model(model)  # one process: nothing to split
    model.config.distributed_config = DistributedConfig(tp_size=2)
    with pytest.raises(UnevenHeadsError, match="3 KV heads"):
        check_model(model)
    with pytest.raises(UnevenHeadsError), criticalkv.compress(model, "critical-snapkv", 0.2):
        pass


def test_bounded_cross_layer_refuses_a_split_model():
    model = LlamaForCausalLM(_config(96)).eval()
    model.config.distributed_config = DistributedConfig(pp_size=2)  # as transformers marks a split model
    refused = pytest.raises(UnsupportedModelError, match="preset layer-defensive")
    with refused, criticalkv.compress(model, "layer-defensive-bounded", 0.2):
        model(input_ids=torch.randint(3, 96, (1, 80)))


def test_parallel_sizes(monkeypatch):
    monkeypatch.setattr(launch, "_REQUESTED", {"tp_size": None, "pp_size": None})
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch.parallel_sizes() == (4, 1)
    assert launch.parallel_sizes(pp_size=2) == (2, 2)
    with pytest.raises(CriticalKVError, match="needs 3 processes, but 4 were launched"):
        launch.parallel_sizes(tp_size=3)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(CriticalKVError, match="torchrun --nproc_per_node 2"):
        launch.parallel_sizes(tp_size=2)


def test_one_process_sees_every_head():
    model = LlamaForCausalLM(_config(96)).eval()
    attention = model.model.layers[0].self_attn
    view = LayerView(attention, torch.zeros(1, 4, 5, 16), torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), None, 1.0)
    assert head_shard(view) is None
    assert output_projection(attention.o_proj.weight, 64) is attention.o_proj.weight
    assert view.o_proj_weight is attention.o_proj.weight


class _NegativeOnRankOne(Scorer):
    """Scores below zero on the heads rank 1 holds, not declared non-negative."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def score(self, view: LayerView) -> torch.Tensor:
        b, h, t, _ = view.keys.shape
        return torch.rand(b, h, t, generator=torch.Generator().manual_seed(0)) - (0.5 if self.rank == 1 else 0.0)

    def protected(self, view: LayerView) -> torch.Tensor:
        return torch.zeros_like(view.valid)


def _sign_check_on_two_ranks(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks holding 1 of 2 KV heads (head_shard patched) decides a layer whose scores are negative
    on rank 1's head alone; writes what each selector raised."""
    import datetime

    import torch.distributed as dist

    from criticalkv.budget import Budget
    from criticalkv.core.heads import HeadShard
    from criticalkv.runtime import method as method_module
    from criticalkv.selectors import CriticalSelector, DefensiveSelector
    from criticalkv.selectors import defensive as defensive_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    shard = HeadShard(dist.group.WORLD, rank, 2, 1)
    method_module.head_shard = defensive_module.head_shard = lambda view: shard
    defensive_module.share_every_head = lambda *args: None
    module = LlamaForCausalLM(_config(96)).model.layers[0].self_attn
    g = torch.Generator().manual_seed(rank)
    q, k, v = torch.randn(1, 2, 16, 16, generator=g), torch.randn(1, 1, 16, 16, generator=g), torch.randn(1, 1, 16, 16)
    raised = {}
    for selector in (CriticalSelector(window=4), DefensiveSelector(window=4)):
        view = LayerView(module, q, k, v, torch.ones(1, 16, dtype=torch.bool), 0.25)
        try:
            Method(_NegativeOnRankOne(rank), selector=selector).decide(view, Budget(0.5))
            raised[type(selector).__name__] = None
        except Exception as error:  # what each rank raised is the result
            raised[type(selector).__name__] = type(error).__name__
    Path(out, f"{rank}.json").write_text(json.dumps(raised))
    dist.barrier()  # neither rank tears gloo down while the other still talks to it (a teardown race aborted a run)
    dist.destroy_process_group()
    # gloo's threads may still be unwinding when the interpreter exits ("terminate called without an active
    # exception", SIGABRT, seen once more after the barrier): the result is written, leave without the destructors
    os._exit(0)


def test_negative_scores_on_one_rank_raise_on_every_rank(tmp_path):
    """Under tensor parallelism the sign check's verdict is gathered: every rank raises, not the one holding the
    negative scores alone while the others wait for it in the next collective."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    mp.spawn(_sign_check_on_two_ranks, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        raised = json.loads((tmp_path / f"{rank}.json").read_text())
        assert raised == {"CriticalSelector": "NegativeScoreError", "DefensiveSelector": "NegativeScoreError"}, rank


def test_the_torchrun_branch_of_load_model_passes_the_pre_load_hooks_on(monkeypatch):
    """Under torchrun the commands' pre-load refusals go through the distributed load too."""
    seen = {}

    def load(name_or_path, **kwargs):
        seen.update(kwargs)
        return "model", "tokenizer"

    monkeypatch.setattr(launch, "parallel_sizes", lambda tp, pp: (2, 1))
    monkeypatch.setattr(launch, "init_process_group", lambda: None)
    monkeypatch.setattr(launch, "barrier", lambda: None)
    monkeypatch.setattr(loading, "load_model", load)
    check, prepare = object(), object()
    assert launch.load_model("some/folder", check_config=check, with_tokenizer=prepare) == ("model", "tokenizer")
    assert seen["check_config"] is check and seen["with_tokenizer"] is prepare
    assert seen["distributed_config"].tp_size == 2


# --------------------------------------------------------------------------------------------------------------
# a pipeline stage's caches, in this process


class _SecondOfTwoStages:
    """What ``stage_layers`` reads of transformers' ``PipelineStage``: rank 1 of 2 runs layers 2 and 3 of 4."""

    pp_rank = 1

    def layer_range_for_rank(self, rank: int, num_layers: int) -> tuple[int, int]:
        return rank * num_layers // 2, (rank + 1) * num_layers // 2


def _second_stage_caches() -> list:
    """The full and the compressed cache of the second stage of a 4-layer model; layers 0 and 1 are ``DummyLayer``."""
    model = types.SimpleNamespace(config=_config(64), _pp_stage=_SecondOfTwoStages())
    full = full_cache(model)
    compressed = CompressedCache(model.config, types.SimpleNamespace(model=model))
    for cache in (full, compressed):
        assert [type(layer) is DummyLayer for layer in cache.layers] == [True, True, False, False]
    return [full, compressed]


@pytest.mark.parametrize("kind", [0, 1], ids=["full", "compressed"])
def test_a_later_stage_reads_its_cache_length_from_a_layer_it_holds(kind):
    """transformers (5.25 on) reads a cache's length from layer 0 itself, on a later stage another stage's
    ``DummyLayer``, which has no length: the stage's caches answer from the layers they fill, and a crop (a rewind)
    shows in that answer."""
    cache = _second_stage_caches()[kind]
    assert cache.get_seq_length() == 0
    states = torch.randn(ROWS, 2, 7, 16)  # (b, h_kv, t, d)
    for index in (2, 3):
        cache.layers[index].update(states, states)  # what the stage's own attention layers append
    assert [cache.get_seq_length(index) for index in range(4)] == [7, 7, 7, 7]
    cache.crop(-3)
    assert cache.get_seq_length() == 4
