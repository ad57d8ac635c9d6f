"""Devices: choosing one, and the CUDA path checked with the invariants of the CPU tests. The CUDA tests are
skipped where torch sees no GPU (CI has none); on a GPU machine run ``pytest tests/test_cuda.py``.

On CUDA: compressed attention equals masked dense attention on every path, compressed generation equals the dense
model with the evicted entries masked out and equals the same run on the CPU, batches equal their rows alone, one
prefill serves many pairs as separate runs would, the memory the cache gives back is really given back to CUDA's
allocator, and the commands run end to end with ``--device cuda`` (and ``--device cpu`` everywhere).
"""

from __future__ import annotations

import copy
import json
from importlib.util import find_spec

import pytest
import torch
from test_fused_attention import make_case, run_path
from test_runtime import NEW, _generate, _ids, _keep_by_layer, _left_padded, _masked_reference, _model
from test_shared_prefill import PAIRS
from test_shared_prefill import _model as _shared_model
from test_sweep import _tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

import criticalkv
from criticalkv.cache.fused_attention import choose_path
from criticalkv.errors import CriticalKVError
from criticalkv.models.device_dtype import resolve_device
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
CUDA = torch.device("cuda")
HAS_FLASH = find_spec("flash_attn") is not None


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    for bad in ("gpu0", "mps", "cuda:99"):
        with pytest.raises(CriticalKVError):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(CriticalKVError, match="sees no CUDA GPU"):
            resolve_device("cuda")


def _on_cuda(family: str, dtype: torch.dtype = torch.float32):
    return copy.deepcopy(_model(family)).to(CUDA, dtype)


def _layer_to_cuda(layer):
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            setattr(layer, name, value.to(CUDA))
    return layer


# ----------------------------------------------------------------------------------------------------------------
# attention over a compressed layer


@needs_cuda
@pytest.mark.parametrize("path", ["padded", "segments", "uniform"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 7])
@pytest.mark.parametrize("q", [1, 4])
def test_paths_on_cuda_equal_masked_dense(path, dtype, groups, q):
    gen = torch.Generator().manual_seed(7 * groups + q)
    b, h_kv, t, d = 3, 2, 96, 64
    lengths = torch.full((b, h_kv), 17) if path == "uniform" else torch.randint(1, 60, (b, h_kv), generator=gen)
    layer, query, tail_keys, tail_values, tail_mask, want = make_case(
        b, h_kv, groups, t, d, q, previous=5, gen=gen, lengths=lengths, padded_tail=q > 1, dtype=dtype
    )
    _layer_to_cuda(layer)
    query, tail_keys, tail_values, tail_mask = (x.to(CUDA) for x in (query, tail_keys, tail_values, tail_mask))
    out = run_path(path, layer, query, tail_keys, tail_values, tail_mask)
    assert out.device.type == "cuda" and out.dtype == dtype
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5  # a wrong entry read is off by O(1)
    assert (out.double().cpu() - want).abs().max().item() <= tolerance
    expected = "uniform" if path == "uniform" else "padded"  # without flash-attn a GPU always pads
    if not HAS_FLASH:
        assert choose_path(query, layer, tail_mask, tail_keys.shape[2]) == expected


# ----------------------------------------------------------------------------------------------------------------
# generation


@needs_cuda
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_whole_is_bit_identical_on_cuda(family, dtype):
    model = _on_cuda(family, dtype)
    ids = _ids(30, seed=1).to(CUDA)
    ref_tokens, ref_logits = _generate(model, ids)
    with criticalkv.compress(model, "critical-adakv", budget=1.0):
        tokens, logits = _generate(model, ids)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)


@needs_cuda
@pytest.mark.parametrize(
    ("family", "method"),
    [
        ("llama", "critical-snapkv"),
        ("qwen2", "critical-adakv"),
        ("gemma3", "critical-snapkv"),
        ("llama", "snapkv"),
        ("gemma2", "critical-snapkv"),  # soft-capped logits, eager attention
        ("gpt_oss", "critical-adakv"),  # attention sinks, eager attention
    ],
)
def test_compression_on_cuda_equals_masked_reference_and_the_cpu(family, method, capture_decisions):
    t, options = 48, {"window": 8}
    ids = _ids(t, seed=4)
    model = _on_cuda(family)
    with criticalkv.compress(model, method, budget=0.3, **options):
        tokens, logits = _generate(model, ids.to(CUDA))
    keep = _keep_by_layer(capture_decisions)
    assert all(k.device.type == "cuda" for k in keep.values())
    ref_tokens, ref_logits = _masked_reference(model, ids.to(CUDA), None, keep, t)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    capture_decisions.clear()
    with criticalkv.compress(_model(family), method, budget=0.3, **options):
        cpu_tokens, cpu_logits = _generate(_model(family), ids)
    cpu_keep = _keep_by_layer(capture_decisions)
    assert all(torch.equal(keep[layer].cpu(), cpu_keep[layer]) for layer in keep)  # the same entries kept
    assert torch.equal(tokens.cpu(), cpu_tokens)
    assert (logits.cpu() - cpu_logits).abs().max().item() <= 1e-3


@needs_cuda
@pytest.mark.parametrize("method", ["critical-snapkv", "critical-adakv"])
def test_left_padded_batch_on_cuda_equals_rows_alone(method):
    model = _on_cuda("llama")
    rows = [_ids(n, seed=10 + i)[0] for i, n in enumerate([44, 31, 23])]
    ids, mask = _left_padded(rows)
    with criticalkv.compress(model, method, budget=0.4, window=8):
        tokens, logits = _generate(model, ids.to(CUDA), mask.to(CUDA))
    for i, row in enumerate(rows):
        with criticalkv.compress(model, method, budget=0.4, window=8):
            alone_tokens, alone_logits = _generate(model, row[None].to(CUDA))
        assert torch.equal(tokens[i], alone_tokens[0]), i
        assert (logits[i] - alone_logits[0]).abs().max().item() <= 1e-4, i


@needs_cuda
def test_shared_prefill_on_cuda_equals_separate_runs():
    model = _shared_model("llama").to(CUDA)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 120), generator=g).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    question = torch.randint(0, 256, (2, 5), generator=g).to(CUDA)
    sessions = SharedPrefill(model, PAIRS).prefill(ids, mask)
    for label, method, budget in PAIRS:
        alone = ContextSession(model, method, budget)
        alone.prefill(ids, mask)
        assert torch.equal(sessions[label].ask(question, NEW).tokens, alone.ask(question, NEW).tokens), label


# ----------------------------------------------------------------------------------------------------------------
# memory really given back


def _allocated_by_a_session(model, method: str, ids: torch.Tensor) -> tuple[int, int]:
    """(bytes CUDA's allocator holds for the session after its prefill, the cache's own count of KV bytes)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    session = ContextSession(model, method, 0.2)
    session.prefill(ids)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    kv = session.kv_bytes()
    del session
    return held, kv


@needs_cuda
def test_compressed_cache_gives_its_memory_back_to_cuda():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).to(CUDA).eval()
    ids = torch.randint(0, 64, (2, 4096), device=CUDA)
    full_held, full_kv = _allocated_by_a_session(model, "full", ids)
    assert full_kv == 4 * 2 * 2 * 4 * 4096 * 64 * 2  # layers x (K, V) x batch x heads x tokens x d x bf16
    for method in ("snapkv", "critical-snapkv", "critical-adakv"):
        held, kv = _allocated_by_a_session(model, method, ids)
        assert kv <= 0.2 * full_kv * 1.01, method
        # what the allocator holds after the prefill: the kept entries and the last logits, not the full cache
        assert held <= kv + (full_held - full_kv) + 2**20, (method, held, kv)
        assert held <= 0.25 * full_held, (method, held, full_held)


# ----------------------------------------------------------------------------------------------------------------
# the commands with --device


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer):
    """test_sweep's 2-layer Llama over the tiny tokenizer, long enough for RULER's variable tracking at 2,400
    tokens."""
    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp("tiny-llama")
    _tiny_model(LlamaConfig, tiny_tokenizer, max_position_embeddings=4096).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("device", DEVICES)
def test_run_command_on_a_device(tiny_folder, tmp_path, device):
    from typer.testing import CliRunner

    from criticalkv.cli import app

    out = tmp_path / "run.json"
    args = ["run", "--model", str(tiny_folder), "--method", "critical-snapkv,critical-adakv", "--device", device]
    args += ["--context-tokens", "200", "--max-new-tokens", "4", "--json", str(out), "--option", "window=8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["device"] == ("cuda:0" if device == "cuda" else "cpu")
    kept = {r["method"]: r["kv_bytes_after_compression"] / r["kv_bytes_full"] for r in report["results"]}
    assert kept["full"] == 1.0 and kept["critical-snapkv"] <= 0.21 and kept["critical-adakv"] <= 0.21


@pytest.mark.parametrize("device", DEVICES)
def test_perturbation_command_on_a_device(tiny_folder, tmp_path, device):
    from typer.testing import CliRunner

    from criticalkv.cli import app

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. What is the special magic number? " * 30)
    out = tmp_path / "out"
    args = ["perturbation", "--model", str(tiny_folder), "--methods", "snapkv,critical-snapkv,measured-snapkv"]
    args += ["--budgets", "0.5", "--prompts", str(text), "--n", "1", "--length", "96", "--generate", "3"]
    args += ["--out", str(out), "--device", device, "--no-plots"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "perturbation.json").read_text())
    assert data["meta"]["device"] == ("cuda:0" if device == "cuda" else "cpu")
    assert len(data["results"]["critical-snapkv"]["0.5"]["heads"]["perturbation"]["all"][0]) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_ruler_command_on_a_device(tiny_folder, tmp_path, device):
    from typer.testing import CliRunner

    from criticalkv.cli import app

    out = tmp_path / "ruler"
    args = ["eval", "ruler", "--model", str(tiny_folder), "--methods", "snapkv,critical-adakv", "--tasks", "vt"]
    args += ["--length", "2400", "--samples", "2", "--out", str(out), "--device", device, "--max-new-tokens", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} >= {"full", "snapkv", "critical-adakv"} and len(rows) >= 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no GPU")
def test_commands_refuse_a_gpu_torch_does_not_see(tiny_folder):
    from typer.testing import CliRunner

    from criticalkv.cli import app

    for args in (["run"], ["eval", "ruler", "--tasks", "vt"], ["perturbation", "--n", "1"], ["calibrate-heads"]):
        result = CliRunner().invoke(app, [*args, "--model", str(tiny_folder), "--device", "cuda"])
        assert result.exit_code == 2, (args, result.output)
        assert "sees no CUDA GPU" in result.output, args


@pytest.mark.parametrize("device", DEVICES)
def test_calibrate_heads_command_on_a_device(tiny_folder, tmp_path, device):
    from typer.testing import CliRunner

    from criticalkv.cli import app

    out = tmp_path / "profile.json"
    args = ["calibrate-heads", "--model", str(tiny_folder), "--samples", "2", "--lengths", "96", "--device", device]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = json.loads(out.read_text())
    assert len(profile["importance"]) == 2 and len(profile["importance"][0]) == 2  # layers x KV heads
