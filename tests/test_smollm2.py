"""Integration on the real default model (SmolLM2-135M): eviction frees what it says, decoding over the
variable-length cache equals a dense cache with the same entries masked, and the main command works."""

import json

import pytest
import torch
from test_runtime import _generate_with_cache, _keep_by_layer, _masked_reference
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import criticalkv
from criticalkv.cache import CompressedLayer
from criticalkv.cli import app
from criticalkv.eval.needle import build_needle_sample
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.session import ContextSession

pytestmark = pytest.mark.model


def _prompt(tokenizer, tokens: int) -> tuple[torch.Tensor, str]:
    sample = build_needle_sample(tokenizer, tokens, seed=0)
    prefix_ids, suffix_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    return torch.tensor([prefix_ids + suffix_ids]), sample.answer


def _load(folder, dtype):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()


def test_kv_bytes_are_kept_entries_at_4k(smollm2_folder, smollm2_tokenizer):
    model = _load(smollm2_folder, torch.float32)  # float32: about 3x faster than bfloat16 on CPUs that emulate it
    ids, _ = _prompt(smollm2_tokenizer, 4096)
    session = ContextSession(model, "critical-snapkv", 0.2)
    session.prefill(ids)
    kept = sum(int(r.kept.sum()) for r in session.compressor.records)
    assert kept == 30 * 3 * int(0.2 * ids.shape[1] + 1e-9)  # 30 layers x 3 KV heads x floor(0.2 t)
    entry_bytes = kept * 2 * 64 * 4  # keys and values, head_dim 64, float32
    assert session.kv_entries() == kept
    assert entry_bytes <= session.kv_bytes() <= 1.01 * entry_bytes
    assert session.kv_bytes() < 0.21 * ids.shape[1] * 30 * 3 * 2 * 64 * 4  # against the full cache


def test_adakv_decoding_equals_masked_dense_cache(smollm2_folder, smollm2_tokenizer, capture_decisions):
    model = _load(smollm2_folder, torch.float32)
    ids, _ = _prompt(smollm2_tokenizer, 1024)
    with criticalkv.compress(model, "critical-adakv", budget=0.2):
        tokens, logits, cache = _generate_with_cache(model, ids, n=8)
    keep = _keep_by_layer(capture_decisions)
    assert len(keep) == 30 and any(len(set(k[0].sum(-1).tolist())) > 1 for k in keep.values())  # head-wise budgets
    ref_tokens, ref_logits = _masked_reference(model, ids, None, keep, ids.shape[1], n=8)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    layers = [layer for layer in cache.layers if isinstance(layer, CompressedLayer)]
    assert all(layer.context_keys.shape[0] == int(k.sum()) for layer, k in zip(layers, keep.values(), strict=True))


def test_run_command_finds_the_needle_with_the_full_cache(tmp_path):
    report = tmp_path / "run.json"
    args = ["run", "--method", "critical-snapkv", "--mode", "aware", "--depths", "0.5", "--context-tokens", "1024"]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", "12", "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    by_method = {r["method"]: r for r in data["results"]}
    assert by_method["full"]["found"] is True
    assert by_method["critical-snapkv"]["kept_fraction"] == pytest.approx(0.2, abs=0.005)
    assert by_method["critical-snapkv"]["kv_bytes_after_compression"] < 0.21 * by_method["full"]["kv_bytes_full"]
    assert data["mode"] == "question-aware"


def test_the_main_job_asks_three_questions_of_one_question_agnostic_cache(tmp_path):
    """``./ckv run``'s defaults: the context is compressed once per method by critical-layer-reconstruct before any
    question, and the three needles' questions are asked of that one cache (the same bytes and prefill for each)."""
    report = tmp_path / "run.json"
    args = ["run", "--context-tokens", "1024", "--max-new-tokens", "12", "--json", str(report)]
    result = CliRunner().invoke(app, [*args, "--dtype", "float32"])  # float32: faster where bfloat16 is emulated
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["mode"] == "question-agnostic"
    rows = data["results"]
    assert [r["method"] for r in rows] == ["full"] * 3 + ["critical-layer-reconstruct"] * 3
    assert len({r["question"] for r in rows}) == 3 and all(r["expected"] for r in rows)
    compressed = rows[3:]
    assert len({(r["kv_bytes_after_compression"], r["prefill_seconds"]) for r in compressed}) == 1  # one prefill
    assert compressed[0]["kept_fraction"] == pytest.approx(0.2, abs=0.005)
    assert all(r["context_tokens"] == rows[0]["context_tokens"] for r in rows)  # one context for every question
