"""Calibrating HeadKV's head-importance profiles: which KV heads of a model retrieve from the context, measured on
needle-in-a-haystack prompts (what ``criticalkv calibrate-heads`` runs). The allocator only reads the profiles
(``criticalkv.allocators.head_profile``); measuring them needs a model, a tokenizer and the needle data.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import inspect
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.allocators import head_profile
from criticalkv.allocators.head_profile import (
    HeadProfile,
    HeadProfileError,
    config_shape,
    model_label,
    model_source,
    rounded,
)
from criticalkv.errors import CriticalKVError
from criticalkv.eval.needle import build_needle_sample
from criticalkv.models import loading  # read at call time: a test that patches loading.load_model patches this
from criticalkv.models.families import check_length
from criticalkv.progress import step_progress
from criticalkv.prompts import chat_prompt_parts, encode_prompt_parts, text_token_span


@torch.no_grad()
def _sample_hits(
    model: PreTrainedModel, prompt: list[int], answer: list[int], span: tuple[int, int], copy: list[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hit rates (layers, q_heads) of one sample: top-k (k = needle length) and top-1 (Wu et al.).

    The prompt is prefilled with the model's own attention; the answer is then teacher-forced with eager
    attention so that only the (answer x context) attention rows are materialised. A sliding-window layer's
    keys are the last positions only (its window), so each layer's keys are matched to the positions they hold.
    """
    device = model.device
    out = model(input_ids=torch.tensor([prompt[:-1]], device=device), use_cache=True, logits_to_keep=1)
    # transformers renamed past_key_values to cache (5.x); accept either
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    forced = torch.tensor([[prompt[-1], *answer[:-1]]], device=device)  # query s produces answer[s]
    base = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=forced, output_attentions=True, logits_to_keep=1, **{name: cache})
    finally:
        model.set_attn_implementation(base)
    ids = torch.tensor(prompt + answer[:-1], device=device)  # token at every position: (n,)
    in_needle = torch.zeros(len(ids), dtype=torch.bool, device=device)
    in_needle[span[0] : span[1]] = True
    steps = torch.tensor(copy, device=device)  # (n_answer,) which answer tokens are copied from the needle
    target = torch.tensor(answer, device=device)
    # match[s, j]: position j is a needle token equal to the token answer step s produces (Wu et al.'s copy test)
    match = in_needle[None, :] & (ids[None, :] == target[:, None])  # (n_answer, n)
    rates: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for layer in out.attentions:
        attn = layer[0].float()  # (h_q, n_answer, keys): the layer's keys are the last ``keys`` positions
        seen = match[:, -attn.shape[-1] :].to(attn.device)  # (n_answer, keys)
        for found, kk in zip(rates, (min(span[1] - span[0], attn.shape[-1]), 1), strict=True):
            top = attn.topk(kk, dim=-1).indices  # (h_q, n_answer, kk)
            hit = seen[None].expand(attn.shape[0], -1, -1).gather(-1, top).any(-1)  # (h_q, n_answer)
            found.append(hit[:, steps.to(attn.device)].float().mean(-1).cpu())
    return torch.stack(rates[0]), torch.stack(rates[1])


CALIBRATION_LENGTHS = (1024, 2048)  # calibrate_head_profile's context lengths by default


def calibrate_head_profile(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: int = 8,
    lengths: Sequence[int] = CALIBRATION_LENGTHS,
    seed: int = 0,
    progress: bool = True,
    floor: float = 0.01,
    name: str = "",
) -> HeadProfile:
    """Measure a model's head-importance profile on needle-in-a-haystack prompts (HeadKV's calibration).

    For every length and ``samples`` needle depths spread over (0, 1), the prompt (context with the needle,
    question, answer prefix) is prefilled and the needle's value is teacher-forced as the answer. For each answer
    token copied from the needle, a query head scores a hit when one of its ``k`` most attended positions is a
    needle token equal to that answer token, with ``k`` = the needle's length in tokens: Wu et al.'s retrieval
    score (top-1) widened to the top-k as HeadKV's retrieval-reasoning score does, which also credits heads that
    read the needle without putting their single largest weight on the copied token. A query head's score is its
    hit rate averaged over samples; a KV head's importance is the mean over its GQA group plus ``floor``, so no
    head is starved of budget. The top-1 (Wu et al.) rates are kept in the profile's measurement for reference.

    Parameters
    ----------
    model, tokenizer
        A supported causal LM and its tokenizer; the model's attention implementation is switched to eager for
        the teacher-forced forward and restored.
    samples
        Needle depths per length (``samples * len(lengths)`` prompts in all).
    lengths
        Context lengths in tokens.
    seed
        Seeds the needles (keys and values).
    progress
        Show a progress bar.
    floor
        Added to every KV head's importance (hit rates are in [0, 1]).
    name
        Label stored in the profile (e.g. the model preset).
    """
    if samples < 1 or not lengths:
        raise CriticalKVError("calibration needs samples >= 1 and at least one length")
    shape = config_shape(model.config)
    layers, h_q, h_kv = shape["num_layers"], shape["num_heads"], shape["num_kv_heads"]
    depths = [(i + 0.5) / samples for i in range(samples)]
    jobs = [(n, d, seed * 100_003 + j * samples + i) for j, n in enumerate(lengths) for i, d in enumerate(depths)]
    topk_sum = torch.zeros(layers, h_q, dtype=torch.float64)
    top1_sum = torch.zeros(layers, h_q, dtype=torch.float64)
    start = time.perf_counter()

    with step_progress("calibrating heads", len(jobs), enabled=progress) as advance:
        for n, depth, sample_seed in jobs:
            sample = build_needle_sample(tokenizer, n, depth, seed=sample_seed)
            prefix, suffix = chat_prompt_parts(tokenizer, sample.context, sample.question, sample.answer_prefix)
            prefix_ids, suffix_ids = encode_prompt_parts(tokenizer, prefix, suffix)
            span = text_token_span(tokenizer, prefix, sample.needle, len(prefix_ids))
            answer = tokenizer(" " + sample.answer, add_special_tokens=False)["input_ids"]
            value_tokens = set(prefix_ids[span[0] : span[1]])
            copy = [tok in value_tokens and any(c.isdigit() for c in tokenizer.decode([tok])) for tok in answer]
            if not any(copy):
                raise CriticalKVError(f"the answer {sample.answer!r} shares no token with its needle")
            top_k, top_1 = _sample_hits(model, prefix_ids + suffix_ids, answer, span, copy)
            topk_sum += top_k.double().cpu()
            top1_sum += top_1.double().cpu()
            advance(f"{n} tokens, depth {depth:.2f}")

    query_scores = topk_sum / len(jobs)  # (layers, h_q)
    importance = query_scores.view(layers, h_kv, h_q // h_kv).mean(-1) + floor  # (layers, h_kv)
    wall = time.perf_counter() - start
    measurement = {
        "method": "needle retrieval: hit when a needle token equal to the copied answer token is among the head's "
        "top-k attended positions, k = needle length in tokens (HeadKV's top-k widening of Wu et al.'s "
        "retrieval score); query-head hit rates averaged over samples, mean over the GQA group, + floor",
        "samples": len(jobs),
        "samples_per_length": samples,
        "lengths": list(lengths),
        "depths": depths,
        "seed": seed,
        "floor": floor,
        "teacher_forced": True,
        "source": model_source(model.config),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "date": _dt.date.today().isoformat(),
        "wall_seconds": round(wall, 1),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "retrieval_top1": rounded((top1_sum / len(jobs)).tolist()),
    }
    return HeadProfile(
        importance=importance.tolist(),
        name=name,
        measurement=measurement,
        query_scores=query_scores.tolist(),
        **shape,
    )


def calibrate_preset(
    model: str = "smollm2-135m",
    out: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    **options: Any,
) -> tuple[HeadProfile, Path]:
    """Load a model (preset name or folder), calibrate it and save the profile; what ``calibrate-heads`` runs.

    ``out`` defaults to ``<cache root>/head_profiles/<name>.json``, where ``load_profile`` finds it, or
    ``<name>-<8 hex digits>.json`` when that file holds the profile of another model of the same name.
    """
    longest = max(options.get("lengths", CALIBRATION_LENGTHS), default=0)
    loaded, tokenizer = loading.load_model(  # a length beyond the model's positions is refused before its weights load
        model, dtype=dtype, device=device, check_config=lambda config: check_length(config, longest, "--lengths")
    )
    label = model_label(loaded.config)  # the name load_profile looks for on this model
    profile = calibrate_head_profile(loaded, tokenizer, name=label, **options)
    path = Path(out) if out is not None else _own_file(label, model_source(loaded.config))
    return profile, profile.save(path)


def _own_file(label: str, source: str) -> Path:
    """``<user profile dir>/<label>.json``, unless it holds the profile of a model from elsewhere (another folder of
    the same name): then ``<label>-<hash of source>.json``, leaving that one as it is."""
    # the module's attribute, read at call time: where load_profile looks, wherever that is pointed
    path = head_profile.user_profile_dir() / f"{label}.json"
    try:
        recorded = HeadProfile.load(path).measurement.get("source") if path.exists() else None
    except HeadProfileError:  # unreadable: overwritten as before
        recorded = None
    if recorded in (None, source):
        return path
    return path.with_name(f"{label}-{hashlib.sha256(source.encode()).hexdigest()[:8]}.json")
