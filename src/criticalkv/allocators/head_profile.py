"""Head-importance profiles for HeadKV: which KV heads of a model retrieve from the context, measured once per
model on needle-in-a-haystack prompts and shipped (or cached) as JSON.

A profile is a (layers x kv_heads) matrix plus the model shape it was measured on, so it can refuse a model
of another shape. ``calibrate_head_profile`` measures one; ``load_profile`` finds one for a config.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import inspect
import json
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError
from criticalkv.files import write_json
from criticalkv.models.families import head_dim, text_config
from criticalkv.progress import step_progress

FORMAT = "criticalkv-head-profile/1"
#: Shape fields a profile must share with a model's config to be used on it.
SHAPE_FIELDS = ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")
USER_PROFILE_DIR = "head_profiles"  # under criticalkv's cache root: where calibrate-heads saves by default


class HeadProfileError(CriticalKVError):
    """No head profile for this model, or a profile measured on a model of another shape."""


class HeadProfileWarning(UserWarning):
    """A head profile found by the model's shape alone: measured on another model of that shape."""


def _calibrate_hint(config: PretrainedConfig | None = None) -> str:
    name = getattr(config, "name_or_path", "") or "M"
    return (
        f"Measure one with `criticalkv calibrate-heads --model {name}` (a few minutes on CPU) and pass it as "
        "HeadKVAllocator(profile=HeadProfile.load(path)), or save it where load_profile looks"
    )


def config_shape(config: PretrainedConfig) -> dict[str, Any]:
    """The shape facts of a model config a profile is matched on (text config of multimodal wrappers)."""
    text = text_config(config)
    return {
        "model_type": getattr(text, "model_type", None),
        "num_layers": int(text.num_hidden_layers),
        "num_heads": int(text.num_attention_heads),
        "num_kv_heads": int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
        "head_dim": int(head_dim(text)),
        "hidden_size": int(text.hidden_size),
    }


def _describe(shape: dict[str, Any]) -> str:
    return (
        f"{shape['model_type']} with {shape['num_layers']} layers, {shape['num_heads']} query / "
        f"{shape['num_kv_heads']} KV heads, head size {shape['head_dim']}, hidden size {shape['hidden_size']}"
    )


def _rounded(rows: Sequence[Sequence[float]]) -> list[list[float]]:
    """Six significant digits: readable JSON, and a positive importance never rounds to zero."""
    return [[float(f"{float(x):.6g}") for x in row] for row in rows]


@dataclass(repr=False)
class HeadProfile:
    """Importance of every KV head of a model: a (num_layers, num_kv_heads) matrix, higher = more budget.

    Parameters
    ----------
    importance
        ``importance[layer][kv_head]`` > 0.
    model_type, num_layers, num_heads, num_kv_heads, head_dim, hidden_size
        The shape of the model it was measured on (``num_heads`` are query heads).
    name
        A label, e.g. the model preset (``"smollm2-135m"``).
    measurement
        How it was measured: method, samples, lengths, depths, seed, date, wall time, versions, ...
    query_scores
        Optional per-query-head scores (num_layers, num_heads) the importance was reduced from.
    """

    importance: list[list[float]]
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    name: str = ""
    measurement: dict[str, Any] = field(default_factory=dict)
    query_scores: list[list[float]] | None = None

    def __post_init__(self) -> None:
        matrix = self.matrix
        if tuple(matrix.shape) != (self.num_layers, self.num_kv_heads):
            raise HeadProfileError(
                f"head profile {self.name!r}: importance is {tuple(matrix.shape)}, expected "
                f"(num_layers, num_kv_heads) = ({self.num_layers}, {self.num_kv_heads})"
            )
        if not bool(torch.isfinite(matrix).all()) or bool((matrix <= 0).any()):
            raise HeadProfileError(f"head profile {self.name!r}: importances must be finite and > 0")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise HeadProfileError(
                f"head profile {self.name!r}: {self.num_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )

    def __repr__(self) -> str:
        samples = self.measurement.get("samples", "?")
        return (
            f"HeadProfile(name={self.name!r}, {self.model_type} {self.num_layers} layers x {self.num_kv_heads} KV "
            f"heads, samples={samples})"
        )

    @property
    def matrix(self) -> torch.Tensor:
        """The importance matrix (num_layers, num_kv_heads), float64."""
        return torch.tensor(self.importance, dtype=torch.float64).reshape(len(self.importance), -1)

    @property
    def shape(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
        }

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, importance: torch.Tensor | Sequence[Sequence[float]], **kwargs: Any
    ) -> HeadProfile:
        """A profile for ``config``'s shape with the given (num_layers, num_kv_heads) importances."""
        rows = torch.as_tensor(importance, dtype=torch.float64).tolist()
        return cls(importance=rows, **config_shape(config), **kwargs)

    def mismatches(self, config: PretrainedConfig) -> list[str]:
        """The shape fields on which this profile and ``config`` differ, as ``"field: profile vs model"``."""
        model = config_shape(config)
        return [f"{k}: {self.shape[k]} vs {model[k]}" for k in SHAPE_FIELDS if self.shape[k] != model[k]]

    def check(self, config: PretrainedConfig) -> None:
        """Raise ``HeadProfileError`` unless this profile was measured on a model of ``config``'s shape."""
        wrong = self.mismatches(config)
        if wrong:
            raise HeadProfileError(
                f"head profile {self.name or '<unnamed>'!r} is for another model: it was measured on "
                f"{_describe(self.shape)}, this model is {_describe(config_shape(config))} "
                f"({'; '.join(wrong)}). {_calibrate_hint(config)}."
            )

    # --- JSON ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "name": self.name, "model": self.shape}
        out["measurement"] = self.measurement
        out["importance"] = _rounded(self.importance)
        if self.query_scores is not None:
            out["query_scores"] = _rounded(self.query_scores)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadProfile:
        if data.get("format") != FORMAT:
            raise HeadProfileError(f"not a criticalkv head profile (format {data.get('format')!r}, want {FORMAT!r})")
        try:
            return cls(
                importance=data["importance"],
                name=data.get("name", ""),
                measurement=data.get("measurement", {}),
                query_scores=data.get("query_scores"),
                **{k: data["model"][k] for k in SHAPE_FIELDS},
            )
        except (KeyError, TypeError, ValueError) as exc:  # ValueError: rows of unequal length
            raise HeadProfileError(f"malformed head profile: missing or bad field {exc}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.to_dict(), indent=1)
        return path

    @classmethod
    def load(cls, path: str | Path) -> HeadProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise HeadProfileError(f"cannot read head profile {path}: {exc}") from None
        return cls.from_dict(data)


# --- finding a profile -----------------------------------------------------------------------------------------


def user_profile_dir() -> Path:
    """Where ``criticalkv calibrate-heads`` saves profiles by default: ``<cache root>/head_profiles``."""
    from criticalkv.models.presets import cache_root

    return cache_root() / USER_PROFILE_DIR


def _candidate_files() -> Iterable[tuple[str, Any]]:
    """(label, readable path) of every profile JSON: the user's own first, then the shipped ones."""
    user = user_profile_dir()
    if user.is_dir():
        for path in sorted(user.glob("*.json")):
            yield str(path), path
    shipped = files("criticalkv.allocators").joinpath("profiles")
    if shipped.is_dir():
        for entry in sorted(shipped.iterdir(), key=lambda p: p.name):
            if entry.name.endswith(".json"):
                yield f"criticalkv/allocators/profiles/{entry.name}", entry


def available_profiles() -> list[tuple[str, HeadProfile]]:
    """Every readable profile (user cache dir, then shipped), with where it came from."""
    found = []
    for label, entry in _candidate_files():
        try:
            found.append((label, HeadProfile.from_dict(json.loads(entry.read_text(encoding="utf-8")))))
        except (OSError, json.JSONDecodeError, HeadProfileError):
            continue  # a broken file must not hide the others
    return found


def model_label(config: PretrainedConfig) -> str:
    """The name profiles are saved under for this model: its folder's name (a preset's converted folder is named
    after the preset), as ``calibrate-heads`` labels what it measures; empty when the config has no path."""
    return Path(getattr(config, "name_or_path", "") or "").name


def model_source(config: PretrainedConfig) -> str:
    """Where the model was loaded from: a local folder's absolute path, else ``name_or_path`` as given (a hub id);
    recorded in a calibrated profile, so that two folders of one name (``run1/final``, ``run2/final``) are told
    apart."""
    where = getattr(config, "name_or_path", "") or ""
    return str(Path(where).resolve()) if where and Path(where).is_dir() else where


def load_profile(config: PretrainedConfig) -> HeadProfile:
    """The head profile for a model config: the one named after the model (``model_label``) among those of its
    shape, else the first of its shape (user cache dir, then shipped) with a ``HeadProfileWarning``: its heads were
    measured on another model of the same shape (a fine-tune's may differ).

    Raises
    ------
    HeadProfileError
        None matches: the message lists the profiles there are, what differs, and how to measure one.
    """
    found = available_profiles()
    same_shape = [profile for _, profile in found if not profile.mismatches(config)]
    label, source = model_label(config), model_source(config)
    named = [profile for profile in same_shape if profile.name == label]
    own = [profile for profile in named if profile.measurement.get("source") in (None, source)]
    if own:
        return own[0]
    if named:  # a folder of the same name elsewhere
        profile = named[0]
        warnings.warn(
            f"HeadKV: the head profile {label!r} was measured on {profile.measurement['source']}, not on this model "
            f"({source}), a model of the same name and shape; using it. {_calibrate_hint(config)}.",
            HeadProfileWarning,
            stacklevel=2,
        )
        return profile
    if same_shape:
        profile = same_shape[0]
        model = repr(label) if label else "this model"
        warnings.warn(
            f"HeadKV: no head profile measured on {model}; using {profile.name or '<unnamed>'!r}, measured on "
            f"another model of the same shape. {_calibrate_hint(config)}.",
            HeadProfileWarning,
            stacklevel=2,
        )
        return profile
    shape = config_shape(config)
    if found:
        others = "; ".join(f"{p.name or where} ({_describe(p.shape)})" for where, p in found)
        listing = f"the installed profiles are for other models: {others}"
    else:
        listing = "no head profile is installed"
    raise HeadProfileError(
        f"no HeadKV head profile for this model ({_describe(shape)}): {listing}. {_calibrate_hint(config)}"
        f" ({user_profile_dir()})."
    )


# --- calibration -----------------------------------------------------------------------------------------------


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
    from criticalkv.eval.needle import build_needle_sample, chat_prompt_parts, encode_prompt_parts, text_token_span

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
    import transformers

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
        "retrieval_top1": _rounded((top1_sum / len(jobs)).tolist()),
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
    from criticalkv.models.families import check_length
    from criticalkv.models.presets import load_model

    longest = max(options.get("lengths", CALIBRATION_LENGTHS), default=0)
    loaded, tokenizer = load_model(  # a length beyond the model's positions is refused before its weights load
        model, dtype=dtype, device=device, check_config=lambda config: check_length(config, longest, "--lengths")
    )
    label = model_label(loaded.config)  # the name load_profile looks for on this model
    profile = calibrate_head_profile(loaded, tokenizer, name=label, **options)
    path = Path(out) if out is not None else _own_file(label, model_source(loaded.config))
    return profile, profile.save(path)


def _own_file(label: str, source: str) -> Path:
    """``<user profile dir>/<label>.json``, unless it holds the profile of a model from elsewhere (another folder of
    the same name): then ``<label>-<hash of source>.json``, leaving that one as it is."""
    path = user_profile_dir() / f"{label}.json"
    try:
        recorded = HeadProfile.load(path).measurement.get("source") if path.exists() else None
    except HeadProfileError:  # unreadable: overwritten as before
        recorded = None
    if recorded in (None, source):
        return path
    return path.with_name(f"{label}-{hashlib.sha256(source.encode()).hexdigest()[:8]}.json")
