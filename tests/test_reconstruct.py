"""The reconstruction scorer (KVzip): its inputs, its scores against a dense reference, its cache hygiene, and
its sharing of passes in a SharedPrefill sweep."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, Gemma2Config, Gemma3TextConfig, LlamaConfig

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache, CompressedLayer
from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.methods import build_method
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill
from criticalkv.scorers.reconstruct import (
    QUOTED_TOKENS,
    MaxAttentionProbe,
    ReconstructionScorer,
    RepeatPrompt,
    reconstruction_inputs,
)

VOCAB = 320  # above the tiny tokenizer's 300 ids
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _model(kind: str = "llama", attn: str = "sdpa"):
    torch.manual_seed(0)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        head_dim=16,
    )
    if kind == "gemma3":
        config = Gemma3TextConfig(
            num_hidden_layers=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"], **common
        )
    elif kind == "gemma2":  # every layer full attention: only its soft cap stands in the way
        config = Gemma2Config(num_hidden_layers=2, layer_types=["full_attention"] * 2, **common)
    else:
        config = LlamaConfig(num_hidden_layers=2, **common)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def templated_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask."""
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, t - len(row) :] = torch.tensor(row)
        mask[i, t - len(row) :] = 1
    return ids, mask


def _random_rows(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


# --- inputs --------------------------------------------------------------------------------------------------
def test_repeat_prompt_follows_the_chat_template(templated_tokenizer, tiny_tokenizer):
    prompt = RepeatPrompt.from_tokenizer(templated_tokenizer)
    assert list(prompt.template_start) == _ids(templated_tokenizer, "<s>user\n")
    assert list(prompt.turn_end) == _ids(templated_tokenizer, "</s>\n<s>assistant\n")
    assert list(prompt.first_request) == _ids(templated_tokenizer, "\n\nRepeat the previous context exactly.")
    plain = RepeatPrompt.from_tokenizer(tiny_tokenizer)
    assert plain.template_start == ()
    assert list(plain.turn_end) == _ids(tiny_tokenizer, "\n")


def test_inputs_chunk_each_row_after_its_template_start(templated_tokenizer):
    prompt = RepeatPrompt.from_tokenizer(templated_tokenizer)
    start = list(prompt.template_start)
    contexts = _random_rows([23, 9], seed=1)
    ids, mask = _batch([start + c for c in contexts])
    inputs = reconstruction_inputs(ids, mask, prompt, chunk_size=10, sinks=4)
    end = list(prompt.turn_end)
    assert len(inputs.chunks) == 3  # row 0: 10 + 10 + 3 tokens; row 1: one chunk
    expected = [
        [list(prompt.first_request) + end + contexts[0][:10], list(prompt.first_request) + end + contexts[1]],
        [list(prompt.next_request) + contexts[0][10 - QUOTED_TOKENS : 10] + end + contexts[0][10:20], []],
        [list(prompt.next_request) + contexts[0][20 - QUOTED_TOKENS : 20] + end + contexts[0][20:], []],
    ]
    for (chunk_ids, chunk_mask), rows in zip(inputs.chunks, expected, strict=True):
        assert chunk_ids.shape[1] == max(len(r) for r in rows)
        for r, row in enumerate(rows):  # right padding: each row's tokens first
            assert chunk_ids[r, : len(row)].tolist() == row
            assert chunk_mask[r].tolist() == [1] * len(row) + [0] * (chunk_ids.shape[1] - len(row))
    t = ids.shape[1]
    protected = torch.zeros(2, t, dtype=torch.bool)
    protected[0, : len(start)] = True
    protected[1, t - 9 - len(start) : t - 9] = True  # after the row's left padding
    assert torch.equal(inputs.protected, protected)
    for i, repeated in enumerate(inputs.slices):  # the prefill positions each chunk repeats
        expected = torch.zeros(2, t, dtype=torch.bool)
        expected[0, len(start) + 10 * i : len(start) + min(10 * i + 10, 23)] = True
        expected[1, t - 9 : t] = i == 0  # row 1's context fits its first chunk
        assert torch.equal(repeated, expected), i


def test_inputs_without_template_reconstruct_everything_and_keep_the_sinks(tiny_tokenizer):
    prompt = RepeatPrompt.from_tokenizer(tiny_tokenizer)
    row = _random_rows([12], seed=2)[0]
    ids, mask = _batch([row])
    inputs = reconstruction_inputs(ids, mask, prompt, chunk_size=64, sinks=4)
    ((chunk_ids, _),) = inputs.chunks
    assert chunk_ids[0].tolist() == list(prompt.first_request) + list(prompt.turn_end) + row
    assert inputs.protected[0].tolist() == [True] * 4 + [False] * 8


def test_inputs_of_a_row_with_part_of_the_template_start_reconstruct_the_whole_row(templated_tokenizer):
    prompt = RepeatPrompt.from_tokenizer(templated_tokenizer)
    row = list(prompt.template_start[:-1]) + _random_rows([12], seed=4)[0]  # the start less its last token
    assert row[len(prompt.template_start) - 1] != prompt.template_start[-1]
    ids, mask = _batch([row])
    inputs = reconstruction_inputs(ids, mask, prompt, chunk_size=64, sinks=1)
    ((chunk_ids, _),) = inputs.chunks
    assert chunk_ids[0].tolist() == list(prompt.first_request) + list(prompt.turn_end) + row
    assert inputs.protected[0].tolist() == [True] + [False] * (len(row) - 1)


# --- scores ----------------------------------------------------------------------------------------------------
def _captured_scores(monkeypatch, model, method, ids, mask) -> list[torch.Tensor]:
    captured = []
    real = ReconstructionScorer.score_after_prefill

    def spy(self, context):
        scores = real(self, context)
        captured.append([s.clone() for s in scores])
        return scores

    monkeypatch.setattr(ReconstructionScorer, "score_after_prefill", spy)
    ContextSession(model, method, 0.5).prefill(ids, mask)
    assert len(captured) == 1
    return captured[0]


def _reference_scores(
    model,
    row: list[int],
    prompt: RepeatPrompt,
    chunk_size: int,
    stride: int,
    sinks: int,
    group: str = "mean",
    softmax: str = "cache",
):
    """Dense eager attention of prefill + each reconstruction chunk, no cache: max over the scored reconstruction
    rows, max over chunks, mean (or max) over the GQA group; protected positions at the head's top. (L, h_kv, t).
    softmax="chunk": each row's weights renormalised over the protected entries, the chunk's slice and its own
    tokens (a softmax over a subset is the whole softmax renormalised on it)."""
    ids, mask = _batch([row])
    t = len(row)
    inputs = reconstruction_inputs(ids, mask, prompt, chunk_size, sinks)
    best = None
    base = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        for (chunk_ids, _), repeated in zip(inputs.chunks, inputs.slices, strict=True):
            full = torch.cat([ids, chunk_ids], dim=1)
            out = model(input_ids=full, output_attentions=True, use_cache=False)
            rows = torch.arange(t, full.shape[1])[::stride]
            weights = torch.stack([a[0][:, rows] for a in out.attentions])  # (L, h_q, r, n)
            if softmax == "chunk":
                spanned = torch.cat([inputs.protected[0] | repeated[0], torch.ones(full.shape[1] - t, dtype=bool)])
                weights = weights * spanned
                weights = weights / weights.sum(dim=-1, keepdim=True)
            attn = weights[..., :t].amax(dim=2)  # (L, h_q, t)
            best = attn if best is None else torch.maximum(best, attn)
    finally:
        model.set_attn_implementation(base)
    layers, h_q, _ = best.shape
    h_kv = model.config.num_key_value_heads
    grouped = best.view(layers, h_kv, h_q // h_kv, t)
    scores = grouped.mean(dim=2) if group == "mean" else grouped.amax(dim=2)
    protected = inputs.protected[0]
    top = scores[:, :, ~protected].amax(dim=-1, keepdim=True)
    return torch.where(protected, top, scores)


@pytest.mark.parametrize(
    ("attn", "stride", "group", "softmax"),
    [
        ("sdpa", 1, "mean", "cache"),
        ("sdpa", 3, "mean", "cache"),
        ("eager", 1, "mean", "cache"),
        ("sdpa", 1, "max", "cache"),
        ("sdpa", 1, "max", "chunk"),
        ("eager", 3, "mean", "chunk"),
    ],
)
def test_scores_equal_dense_reference_per_row_of_a_padded_batch(
    monkeypatch, templated_tokenizer, attn, stride, group, softmax
):
    model = _model(attn=attn)
    prompt = RepeatPrompt.from_tokenizer(templated_tokenizer)
    rows = [list(prompt.template_start) + c for c in _random_rows([70, 41], seed=3)]
    ids, mask = _batch(rows)
    options = dict(chunk_size=32, query_stride=stride, group=group, softmax=softmax)
    method = build_method("reconstruct", tokenizer=templated_tokenizer, **options)
    scores = torch.stack(_captured_scores(monkeypatch, model, method, ids, mask))  # (L, b, h_kv, t)
    t = ids.shape[1]
    for r, row in enumerate(rows):
        expected = _reference_scores(model, row, prompt, 32, stride, sinks=4, group=group, softmax=softmax)
        got = scores[:, r, :, t - len(row) :]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_probe_reads_a_missing_mask_as_causal():
    g = torch.Generator().manual_seed(12)
    b, h_q, h_kv, q, t, d = 2, 4, 2, 5, 7, 8
    query, keys = torch.randn(b, h_q, q, d, generator=g), torch.randn(b, h_kv, t + q, d, generator=g)
    causal = torch.arange(t + q)[None, :] <= (t + torch.arange(q))[:, None]  # (q, t + q)
    module = torch.nn.Module()
    module.layer_idx = 0
    probes = [MaxAttentionProbe(t, 2, torch.ones(b, q, dtype=torch.bool)) for _ in range(2)]
    probes[0](module, query, keys, None, 0.3)
    probes[1](module, query, keys, causal[None, None].expand(b, 1, q, t + q), 0.3)
    torch.testing.assert_close(probes[0].maxima[0], probes[1].maxima[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_cpu_probe_equals_the_softmax_over_the_whole_cache(dtype, masked):
    """attend under SDPA on CPU (the kernel's output and log-sum-exp, logits of the prefill columns only) gives the
    model's own output and the maxima of the probe that recomputes the softmax over every column."""
    g = torch.Generator().manual_seed(13)
    b, h_q, h_kv, q, t, d = 2, 4, 2, 6, 9, 8
    query = torch.randn(b, h_q, q, d, generator=g).to(dtype)
    keys, values = (torch.randn(b, h_kv, t + q, d, generator=g).to(dtype) for _ in range(2))
    allowed = torch.arange(t + q)[None, :] <= (t + torch.arange(q))[:, None]  # (q, t + q) causal over the chunk
    allowed = allowed[None].repeat(b, 1, 1)
    if masked:
        allowed[1, :, :3] = False  # row 1: three prefill padding positions
    mask = allowed[:, None] if masked else None
    valid = torch.ones(b, q, dtype=torch.bool)
    valid[1, :2] = False  # row 1: two padding queries cast no vote
    module = torch.nn.Module()
    module.layer_idx = 0
    repeated = [x.repeat_interleave(h_q // h_kv, dim=1) for x in (keys, values)]
    want = F.scaled_dot_product_attention(query, *repeated, attn_mask=allowed[:, None], scale=0.3).transpose(1, 2)
    fused, plain = (MaxAttentionProbe(t, 1, valid) for _ in range(2))
    out, weights = fused.attend(module, query, keys, values, mask, 0.3, base=lambda: pytest.fail("base ran"), sdpa=True)
    plain(module, query, keys, mask, 0.3)
    assert weights is None and out.shape == (b, q, h_q, d)
    exact = dtype in (torch.float32, torch.float64)
    torch.testing.assert_close(out, want.contiguous(), rtol=0, atol=1e-6 if exact else 1e-2)
    # half precision keeps the kernel's log-sum-exp about 1e-5 from the probe's own (weights in [0, 1]): float16
    # everywhere, bfloat16 on a CPU without bfloat16 instructions (AVX2 only: 7.8e-6), where the kernel converts
    half = dtype in (torch.float16, torch.bfloat16)
    torch.testing.assert_close(fused.maxima[0], plain.maxima[0], rtol=1e-5, atol=1e-4 if half else 1e-6)
    assert bool((fused.maxima[0] <= 1).all())
    # elsewhere (not SDPA, or not on CPU) the model's own function runs, then the probe of __call__
    other = MaxAttentionProbe(t, 1, valid)
    ran = other.attend(module, query, keys, values, mask, 0.3, base=lambda: ("base output", None), sdpa=False)
    assert ran == ("base output", None) and torch.equal(other.maxima[0], plain.maxima[0])


def test_group_scores_are_attention_weights(monkeypatch, tiny_tokenizer):
    model = _model()
    ids, mask = _batch(_random_rows([50], seed=4))
    method = build_method("critical-reconstruct", tokenizer=tiny_tokenizer, chunk_size=16)
    for scores in _captured_scores(monkeypatch, model, method, ids, mask):
        assert scores.dtype == torch.float32
        assert bool((scores >= 0).all()) and bool((scores <= 1).all())


# --- cache hygiene and exactness ------------------------------------------------------------------------------
def test_budget_one_reproduces_the_uncompressed_model(tiny_tokenizer):
    model = _model()
    ids, mask = _batch(_random_rows([60, 35], seed=5))
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    plain_run = model(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config), use_cache=True)
    method = build_method("critical-ada-reconstruct", tokenizer=tiny_tokenizer, chunk_size=16)
    with Compressor(model, method, Budget(1.0)) as compressor:  # installed although nothing is dropped
        compressor.record_keep = True
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, plain)
    assert len(compressor.records) == 2
    for record in compressor.records:
        assert bool(record.kept_whole.all())
        assert torch.equal(record.keep, mask.bool()[:, None, :].expand(-1, 2, -1))
    with Compressor(model, method, Budget(1.0)) as compressor:
        out = model(input_ids=ids, attention_mask=mask)
        logits, cache = out.logits, out.past_key_values
        assert isinstance(cache, CompressedCache) and compressor.active_cache is None  # nor a scorer's own cache
    assert torch.equal(logits, plain_run.logits)
    t = ids.shape[1]
    for layer, plain_layer in zip(cache.layers, plain_run.past_key_values.layers, strict=True):
        assert layer.tail == layer.seen == t and not layer.is_compressed  # the passes' tokens are gone
        assert torch.equal(layer.keys[:, :, :t], plain_layer.keys)  # and the prefill's entries are untouched
        assert torch.equal(layer.values[:, :, :t], plain_layer.values)


def test_cache_after_scoring_holds_no_reconstruction_tokens(monkeypatch, tiny_tokenizer):
    model = _model()
    rows = _random_rows([80, 64], seed=6)
    ids, mask = _batch(rows)
    forwards = []
    real_forward = type(model).forward

    def counting_forward(self, *args, **kwargs):
        forwards.append(kwargs["input_ids"].shape[1])
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting_forward)
    session = ContextSession(model, build_method("reconstruct", tokenizer=tiny_tokenizer, chunk_size=24), 0.25)
    session.prefill(ids, mask)
    assert len(forwards) == 1 + 4  # the prefill, then 4 chunks of row 0's 80 tokens
    t = ids.shape[1]
    for layer in session.cache.layers:
        assert isinstance(layer, CompressedLayer) and layer.is_compressed
        assert layer.seen == layer.context_seen == t and layer.tail == 0
        assert layer.lengths.tolist() == [[20, 20], [16, 16]]  # floor(0.25 * real length) per head
    question = torch.randint(0, 300, (2, 3), generator=torch.Generator().manual_seed(7))
    first = session.ask(question, max_new_tokens=4)
    again = session.ask(question, max_new_tokens=4)
    assert torch.equal(first.tokens, again.tokens)


# --- sweeps -----------------------------------------------------------------------------------------------------
def test_shared_prefill_shares_one_reconstruction_and_equals_separate_runs(monkeypatch, tiny_tokenizer):
    model = _model()
    ids, mask = _batch(_random_rows([90, 70], seed=8))
    question = torch.randint(0, 300, (2, 4), generator=torch.Generator().manual_seed(9))
    pairs = [
        ("full", "full", 1.0),
        ("reconstruct-0.3", build_method("reconstruct", tokenizer=tiny_tokenizer, chunk_size=32), 0.3),
        ("critical-0.3", build_method("critical-reconstruct", tokenizer=tiny_tokenizer, chunk_size=32), 0.3),
        ("ada-0.5", build_method("ada-reconstruct", tokenizer=tiny_tokenizer, chunk_size=32), 0.5),
        ("critical-ada-0.2", build_method("critical-ada-reconstruct", tokenizer=tiny_tokenizer, chunk_size=32), 0.2),
        ("stride-0.3", build_method("reconstruct", tokenizer=tiny_tokenizer, chunk_size=32, query_stride=2), 0.3),
        ("max-0.3", build_method("reconstruct", tokenizer=tiny_tokenizer, chunk_size=32, group="max"), 0.3),
        ("chunk-0.3", build_method("reconstruct", tokenizer=tiny_tokenizer, chunk_size=32, softmax="chunk"), 0.3),
        ("snapkv-0.3", "snapkv", 0.3),
    ]
    runs = []
    real = ReconstructionScorer._reconstruct

    def counting(self, context):
        runs.append(repr(self))
        return real(self, context)

    monkeypatch.setattr(ReconstructionScorer, "_reconstruct", counting)
    sessions = SharedPrefill(model, pairs).prefill(ids, mask)
    assert len(runs) == 3  # one set of passes per stride and softmax span; the group's reduction comes after them
    for label, method, budget in pairs:
        alone = ContextSession(model, method, budget)
        alone.prefill(ids, mask)
        expected = alone.ask(question, max_new_tokens=5)
        got = sessions[label].ask(question, max_new_tokens=5)
        assert torch.equal(got.tokens, expected.tokens), label
        assert sessions[label].kv_entries() == alone.kv_entries(), label


# --- errors -----------------------------------------------------------------------------------------------------
# each refused when the method is installed, before the prefill whose end the tokenizer is first needed at
def test_missing_tokenizer_is_a_clear_error():
    model = _model()  # built from a config: no name_or_path to load a tokenizer from
    with pytest.raises(CriticalKVError, match="no name_or_path"):
        ContextSession(model, "reconstruct", 0.3)


def test_a_tokenizer_that_does_not_load_is_a_clear_error(tmp_path):
    with pytest.raises(CriticalKVError, match="none loads from"):
        SharedPrefill(_model(), [("r", build_method("reconstruct", tokenizer=str(tmp_path)), 0.3)])


def test_another_models_tokenizer_is_a_clear_error(tiny_tokenizer):
    model = _model()
    model.resize_token_embeddings(64)  # the tiny tokenizer's repeat request writes ids beyond 64
    with pytest.raises(CriticalKVError, match="not this model's tokenizer"):
        ContextSession(model, build_method("reconstruct", tokenizer=tiny_tokenizer), 0.3)


@pytest.mark.parametrize("preset", ["reconstruct", "critical-layer-reconstruct"])
@pytest.mark.parametrize("budget", [0.3, 1.0])
def test_sliding_window_models_are_refused_before_any_forward(tiny_tokenizer, preset, budget):
    model = _model("gemma3")
    with pytest.raises(UnsupportedModelError, match=r"ReconstructionScorer does not support .* sliding-window layers"):
        ContextSession(model, build_method(preset, tokenizer=tiny_tokenizer), budget)


def test_soft_capped_logits_are_refused_before_any_forward(tiny_tokenizer):
    """The probe recomputes the softmax without Gemma 2's soft cap (or gpt-oss's sinks): refused, not approximated."""
    with pytest.raises(UnsupportedModelError, match="soft-capped logits"):
        ContextSession(_model("gemma2", "eager"), build_method("reconstruct", tokenizer=tiny_tokenizer), 0.3)


def test_scorer_refuses_per_layer_use_and_bad_options():
    with pytest.raises(CriticalKVError, match="after"):
        ReconstructionScorer().score(None)
    for option in ({"chunk_size": 0}, {"query_stride": 0}, {"sinks": -1}, {"group": "sum"}, {"softmax": "all"}):
        with pytest.raises(ValueError):
            ReconstructionScorer(**option)


def test_layer_reconstruct_ranks_every_layer_and_head_at_once(monkeypatch, tiny_tokenizer):
    """KVzip's own allocation: beyond each head's protected sinks, the best reconstruction scores of the whole model
    are kept, wherever they are (a brute-force ranking over every layer and head); budgets differ across layers."""
    model = _model()
    ids, mask = _batch(_random_rows([70], seed=8))
    method = build_method("layer-reconstruct", tokenizer=tiny_tokenizer, chunk_size=32)
    scores = _captured_scores(monkeypatch, model, method, ids, mask)  # per layer (1, h_kv, t)
    with Compressor(model, method, Budget(0.25)) as compressor:
        compressor.record_keep = True
        model(input_ids=ids, attention_mask=mask)
    keeps = [record.keep for record in sorted(compressor.records, key=lambda r: r.layer)]
    t = ids.shape[1]
    budget = int(0.25 * t)
    sinks = reconstruction_inputs(ids, mask, RepeatPrompt.from_tokenizer(tiny_tokenizer), 32, 4).protected[0]
    everything = torch.cat([s[0].flatten() for s in scores])  # (L h t)
    competing = ~sinks.expand(len(scores), scores[0].shape[1], -1).flatten()
    room = len(scores) * scores[0].shape[1] * (budget - int(sinks.sum()))
    best = everything.masked_fill(~competing, float("-inf")).topk(room).indices
    expected = (~competing).clone()
    expected[best] = True
    assert torch.equal(torch.cat([k[0].flatten() for k in keeps]), expected)
    assert sum(int(k.sum()) for k in keeps) == len(scores) * scores[0].shape[1] * budget
    assert len({int(k.sum()) for k in keeps}) > 1  # layers got different budgets
