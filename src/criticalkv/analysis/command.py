"""``criticalkv perturbation``: the paper's output-perturbation analysis, head by head, on real prompts.

Register it with ``app.command("perturbation")(perturbation)``; ``run_analysis`` is the same as a function.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import transformers
import typer
from rich.table import Table
from transformers import PretrainedConfig

from criticalkv.analysis.capture import capture, check_capturable
from criticalkv.analysis.exhaustive import MAX_ENTRIES as EXHAUSTIVE_MAX_ENTRIES
from criticalkv.analysis.exhaustive import exhaustive_check as run_exhaustive_check
from criticalkv.analysis.perturbation import (
    PromptResult,
    budget_label,
    log10_ratio,
    measure_prompt,
    nanmean,
    stack,
    summarise,
)
from criticalkv.analysis.plots import plot_hidden, plot_layers, plot_ratio_heatmap, plot_ratio_histogram
from criticalkv.budget import Budget
from criticalkv.errors import CriticalKVError
from criticalkv.eval.commands import split_items
from criticalkv.eval.report import file_stem
from criticalkv.files import write_json
from criticalkv.methods import build_method
from criticalkv.models.device_dtype import DEVICE_HELP, DTYPE_HELP
from criticalkv.models.families import check_length
from criticalkv.progress import output_console, print_error, step_progress

__all__ = [
    "Prompt",
    "essay_prompts",
    "essay_window_prompts",
    "load_results",
    "parse_pairs",
    "perturbation",
    "resummarise",
    "run_analysis",
    "text_prompts",
    "window_prompts",
]

console = output_console(stderr=True)
DEFAULT_OUT = Path("results/perturbation")
TEXT_QUESTION = "What is the text above about? Answer in one sentence."
MODES = {
    "agnostic": "question-agnostic: the context is compressed before the question is seen; the question follows",
    "aware": "question-aware: the question is compressed with the context; only generated tokens follow",
}


@dataclass
class Prompt:
    """Token ids of one prompt: the context (compressed) and the question that follows it."""

    index: int
    context_ids: list[int]
    question_ids: list[int]
    info: dict


def essay_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[Prompt]:
    """Needle prompts from RULER's essays: ``length`` context tokens, needle depths spread over [0, 1]."""
    from criticalkv.eval.needle import build_needle_sample
    from criticalkv.prompts import encode_prompt

    prompts = []
    for i in range(n):
        depth = i / (n - 1) if n > 1 else 0.5
        sample = build_needle_sample(tokenizer, length, depth=depth, seed=seed + i)
        context_ids, question_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        info = {"source": "essays", "depth": depth, "seed": seed + i, "answer": sample.answer, "key": sample.key}
        prompts.append(Prompt(i, context_ids, question_ids, info))
    return prompts


def text_prompts(tokenizer, path: Path, n: int, length: int) -> list[Prompt]:
    """``n`` windows of ``length`` tokens from a text file (or the .txt files of a folder), cycling through the text;
    each followed by a fixed question about it."""
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise CriticalKVError(f"no .txt file in {path}")
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    return window_prompts(tokenizer, text, str(path), n, length)


def essay_window_prompts(tokenizer, n: int, length: int) -> list[Prompt]:
    """``n`` consecutive ``length``-token windows of RULER's essays, each a different text (no needle), each followed
    by a fixed question about it. (``essay_prompts`` puts needles into one and the same stretch of the essays.)"""
    from criticalkv.eval.needle import load_haystack

    text = load_haystack()
    # about 4-5 characters per token: cut what the windows need (with room), not the ~700k tokens of the essays
    return window_prompts(tokenizer, text[: 8 * n * length + 1024], "essay windows", n, length)


def window_prompts(tokenizer, text: str, source: str, n: int, length: int) -> list[Prompt]:
    """``n`` consecutive windows of ``length`` tokens of ``text``, cycling through it, each followed by
    ``TEXT_QUESTION``; ``source`` names the text in each prompt's info."""
    from criticalkv.prompts import encode_prompt

    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not tokens:
        raise CriticalKVError(f"{source} holds no text")
    repeated = tokens * (length * n // len(tokens) + 2)
    prompts = []
    for i in range(n):
        start = (i * length) % len(tokens)
        window = tokenizer.decode(repeated[start : start + length])
        context_ids, question_ids = encode_prompt(tokenizer, window, TEXT_QUESTION, answer_prefix="")
        prompts.append(Prompt(i, context_ids, question_ids, {"source": source, "start_token": start}))
    return prompts


def parse_pairs(spec: str | None, methods: list[str]) -> list[tuple[str, str]]:
    """``"a:b,c:d"`` -> [(a, b), (c, d)] (B is compared with A); None: each method against the first.

    A and B may be method specs with options (``snapkv:critical-snapkv:alpha=0.25``): the item splits at the
    ``:`` that leaves a method of ``methods`` on both sides.
    """
    if not spec:
        return [(methods[0], m) for m in methods[1:]]
    pairs = []
    for item in spec.split(","):
        item = item.strip()
        cuts = [i for i, char in enumerate(item) if char == ":"]
        splits = [(item[:i].strip(), item[i + 1 :].strip()) for i in cuts]
        if not splits or not all(splits[0]):
            raise CriticalKVError(f"pair {item!r} is not of the form A:B")
        known = [(a, b) for a, b in splits if a in methods and b in methods]
        if len(known) != 1:
            raise CriticalKVError(f"pair {item!r} does not name two of --methods {methods} (A:B)")
        pairs.append(known[0])
    return pairs


def _clean(x):
    """JSON-ready: numpy to lists, floats to 6 significant digits, NaN/inf to None."""
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float | np.floating):
        x = float(x)
        return None if not math.isfinite(x) else float(f"{x:.6g}")
    if isinstance(x, np.integer):
        return int(x)
    return x


def _payload(meta, results: list[PromptResult], methods, budgets, pairs, h_kv, exhaustive) -> dict:
    data: dict = {"meta": meta}
    if results:
        data["summary"] = summarise(results, methods, budgets, pairs, h_kv)
        data["layers"] = results[0].layers
        data["prompts"] = [{"index": r.index, **r.info, "seconds": r.seconds} for r in results]
        data["results"] = {
            name: {
                budget: {
                    "heads": {
                        q: {s: [r.heads[(name, budget)][q][s] for r in results] for s in r0}
                        for q, r0 in results[0].heads[(name, budget)].items()
                    },
                    "per_prompt": [r.scalars[(name, budget)] for r in results],
                    "layer_output": {
                        s: [r.layer_output[(name, budget)][s] for r in results]
                        for s in results[0].layer_output.get((name, budget), {})
                    },
                }
                for budget in budgets
            }
            for name in methods
        }
    if exhaustive is not None:
        data["exhaustive"] = exhaustive
    return _clean(data)


def load_results(path: Path) -> tuple[dict, list[PromptResult]]:
    """Read a ``perturbation.json`` back into its payload and one ``PromptResult`` per prompt."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CriticalKVError(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict) or not {"results", "prompts", "layers", "meta"} <= data.keys():
        raise CriticalKVError(f"{path} is not a perturbation.json (criticalkv perturbation's output)")
    results = []
    for i, info in enumerate(data["prompts"]):
        rest = {k: v for k, v in info.items() if k not in ("index", "seconds")}
        result = PromptResult(info["index"], rest, data["layers"], seconds=info.get("seconds", {}))
        for name, by_budget in data["results"].items():
            for budget, entry in by_budget.items():
                result.heads[(name, budget)] = {
                    q: {s: np.array(v[i], dtype=np.float64) for s, v in per.items()}  # null -> NaN
                    for q, per in entry["heads"].items()
                }
                result.scalars[(name, budget)] = {
                    k: math.nan if v is None else v for k, v in entry["per_prompt"][i].items()
                }
                if entry.get("layer_output"):  # runs before it was measured have none
                    result.layer_output[(name, budget)] = {
                        s: np.array(v[i], dtype=np.float64) for s, v in entry["layer_output"].items()
                    }
        results.append(result)
    return data, results


def resummarise(path: Path, pairs: str | None = None, plots: bool = True, out: Path | None = None) -> dict:
    """Recompute the summary (and the figures) of an earlier run from its ``perturbation.json``; ``pairs`` may
    differ from the run's. Rewrites the file's summary; figures go to ``out`` (default: the file's folder)."""
    data, results = load_results(path)
    meta = data["meta"]
    names, labels = meta["methods"], meta["budgets"]
    pair_list = parse_pairs(pairs, names) if pairs else [tuple(p) for p in meta["pairs"]]
    meta["pairs"] = pair_list
    data["summary"] = _clean(summarise(results, names, labels, pair_list, meta["kv_heads"]))
    write_json(Path(path), data)
    out = Path(path).parent if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        _plots(out, results, data["summary"], names, labels, pair_list)
    _print_summary(data["summary"], names, labels)
    return data


def _plots(out: Path, results: list[PromptResult], summary: dict, methods, budgets, pairs) -> list[Path]:
    written = []
    layers = results[0].layers
    for a, b in pairs:
        per_prompt, heads, headline = {}, {}, {}
        for budget in budgets:
            pa = stack(results, (a, budget), "perturbation", "all")
            pb = stack(results, (b, budget), "perturbation", "all")
            per_prompt[budget] = log10_ratio(pa, pb)
            heads[budget] = log10_ratio(nanmean(pa, 0), nanmean(pb, 0))
            wanted = (a, b, budget, "all")
            row = next((p for p in summary["pairs"] if (p["a"], p["b"], p["budget"], p["subset"]) == wanted), None)
            if row is not None:
                headline[budget] = row["heads_per_prompt"]
        stem = file_stem(a, b)
        written.append(plot_ratio_histogram(per_prompt, a, b, out / f"hist_{stem}.png", headline))
        written.append(plot_ratio_heatmap(heads, layers, a, b, out / f"heatmap_{stem}.png"))
    per_layer = {m: {bud: summary["per_layer"][m][bud]["all"] for bud in budgets} for m in methods}
    written.append(plot_layers(per_layer, layers, out / "layers.png"))
    if "per_layer_output" in summary:  # runs measured before the layer output have none
        per_output = {m: {bud: summary["per_layer_output"][m][bud]["all"] for bud in budgets} for m in methods}
        ylabel, title = "mean ||sum_h (o_h - ô_h) W_O^h||_1", "the attention block's output change per layer"
        written.append(plot_layers(per_output, layers, out / "layer_output.png", title, ylabel))
    hidden = {m: {bud: summary["hidden"][m][bud].get("hidden_l1_all", math.nan) for bud in budgets} for m in methods}
    if all(any(math.isfinite(v) for v in by.values()) for by in hidden.values()):
        written.append(plot_hidden(hidden, out / "hidden.png"))
    return written


def _print_summary(summary: dict, methods, budgets) -> None:
    columns = ["A", "B", "budget", "heads B<A", "median log10 B/A", "mean B / mean A", "(prompt,layer,head) B<A"]
    table = Table(*columns, "layer outputs B<A", "hidden B<A")
    for row in summary["pairs"]:
        if row["subset"] != "all":
            continue
        h, hp, hs, lo = row["heads"], row["heads_per_prompt"], row.get("hidden_state"), row.get("layer_output")
        table.add_row(
            row["a"],
            row["b"],
            row["budget"],
            f"{100 * h['fraction_b_lower']:.1f}%",
            f"{h['median_log10_ratio']:+.3f}",
            f"{h['ratio_of_means']:.3f}",
            f"{100 * hp['fraction_b_lower']:.1f}%",
            f"{lo['fraction_b_lower'] * lo['n']:.0f}/{lo['n']}" if lo else "-",
            f"{hs['fraction_b_lower'] * hs['n']:.0f}/{hs['n']}" if hs else "-",
        )
    if summary["pairs"]:
        console.print(table)
    table = Table("method", "budget", "mean L1 / head", "bound (paper)", "bound (tight)", "σ<1/2", "hidden L1", "rel.")
    for m in methods:
        for b in budgets:
            bd, hd = summary["bounds"][m][b], summary["hidden"][m][b]
            table.add_row(
                m,
                b,
                f"{bd['mean_perturbation']:.4g}",
                f"{bd['mean_bound_paper']:.4g}",
                f"{bd['mean_bound_tight']:.4g}",
                f"{100 * bd['kept_mass_below_half']:.1f}%",
                _figure(hd.get("hidden_l1_all"), ".4g"),
                _figure(hd.get("hidden_l1_relative_all"), ".4f"),
            )
    console.print(table)


def _figure(value: float | None, spec: str) -> str:
    """A summary figure for the table; "-" where it was not measured (``--no-hidden``: missing or NaN)."""
    return "-" if value is None or math.isnan(value) else format(value, spec)


def run_analysis(
    model: str = "smollm2-135m",
    methods: str = "snapkv,critical-snapkv",
    budgets: str = "0.1,0.2,0.4",
    prompts: str = "essays",
    n: int = 20,
    length: int = 4096,
    out: Path | None = None,
    pairs: str | None = None,
    mode: str = "agnostic",
    generate: int = 16,
    seed: int = 0,
    dtype: str = "auto",
    device: str = "cpu",
    hidden: bool = True,
    stepwise: bool = False,
    window_queries: int = 32,
    plots: bool = True,
    exhaustive_check: bool = False,
    exhaustive_trials: int = 200,
    exhaustive_entries: int = 12,
    exhaustive_budget: int = 4,
    progress: bool = True,
    from_json: Path | None = None,
) -> dict:
    """Run the analysis; write ``perturbation.json`` (and PNGs) under ``out`` (default ``results/perturbation``);
    return the JSON payload.

    ``from_json``: measure nothing; recompute the summary and the figures of that earlier ``perturbation.json``
    (figures in ``out``, default the file's folder).
    """
    if from_json is not None:
        return resummarise(from_json, pairs, plots, out)
    out = DEFAULT_OUT if out is None else out
    started = time.perf_counter()
    names = split_items(methods, "--methods")
    if not names:
        raise CriticalKVError("--methods needs at least one method")
    if "full" in names:
        raise CriticalKVError("'full' is the reference every method is measured against; leave it out of --methods")
    built = {name: build_method(name) for name in names}  # unknown names fail before any work
    for name, method in built.items():  # the analysis decides each layer from its own prefill view
        if not method.per_layer:
            raise CriticalKVError(
                f"{name} decides layers together (a cross-layer budget or a reconstruction after the prefill); "
                "the perturbation analysis takes per-layer methods only"
            )
    parsed = [Budget.parse(b) for b in budgets.split(",") if b.strip()]
    if not parsed:
        raise CriticalKVError("--budgets needs at least one budget")
    labels = [budget_label(b) for b in parsed]
    pair_list = parse_pairs(pairs, names)
    if mode not in MODES:
        raise CriticalKVError(f"--mode must be one of {list(MODES)}, got {mode!r}")
    if n < 0 or length < 1 or generate < 0:
        raise CriticalKVError("--samples, --length and --generate must be >= 0, >= 1 and >= 0")
    if n == 0 and not exhaustive_check:
        raise CriticalKVError("--samples 0 measures nothing without --exhaustive-check (it would only overwrite --out)")
    if exhaustive_check and not (
        exhaustive_trials >= 1 and 1 <= exhaustive_budget <= exhaustive_entries <= EXHAUSTIVE_MAX_ENTRIES
    ):
        raise CriticalKVError(
            f"--exhaustive-trials must be >= 1 and 1 <= --exhaustive-budget <= --exhaustive-entries <= "
            f"{EXHAUSTIVE_MAX_ENTRIES}, got {exhaustive_trials}, {exhaustive_budget}, {exhaustive_entries}"
        )
    if mode == "aware" and generate == 0:
        raise CriticalKVError("--mode aware with --generate 0 leaves no query after the compressed prompt")
    if window_queries < 0:
        raise CriticalKVError(f"--window-queries must be >= 0 (0: off), got {window_queries}")
    if prompts not in ("essays", "essay-windows") and not Path(prompts).expanduser().exists():
        raise CriticalKVError(f"--prompts must be 'essays', 'essay-windows' or a text file / folder, got {prompts!r}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, no permission
        raise CriticalKVError(f"cannot create --out {out}: {error}") from None
    meta: dict = {
        "command": " ".join(sys.argv),
        "methods": names,
        "budgets": labels,
        "pairs": pair_list,
        "regime": MODES[mode],
        "mode": mode,
        "prompts": prompts,
        "n": n,
        "length": length,
        "generate": generate,
        "hidden_state_decode": "one forward per prompt over all following tokens (teacher forcing)"
        if not stepwise
        else "the question in one forward, then one forward per generated token (teacher forcing)",
        "window_queries": window_queries,
        "seed": seed,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "log_base": 10,
    }
    if n > 0:  # before the exhaustive check: a model refused costs nothing of it, a family refused no load
        from criticalkv.models.loading import load_model, load_notes
        from criticalkv.models.presets import PRESETS as MODEL_PRESETS

        def check_config(config: PretrainedConfig) -> None:
            check_capturable(config)
            check_length(config, length, "--length")

        with console.status(f"loading {model}"):
            lm, tokenizer = load_model(model, dtype=dtype, device=device, check_config=check_config)
        for note in load_notes(lm, tokenizer):
            console.print(note, style="dim", markup=False)
    exhaustive = None
    if exhaustive_check:
        with console.status("exhaustive check: brute-force optimum on random heads"):
            tick = time.perf_counter()
            exhaustive = run_exhaustive_check(
                trials=exhaustive_trials, entries=exhaustive_entries, budget=exhaustive_budget, seed=seed
            )
            exhaustive["seconds"] = time.perf_counter() - tick
        s = exhaustive["selectors"]
        console.print(
            f"exhaustive check ({exhaustive_trials} random heads, n={exhaustive_entries}, b={exhaustive_budget}): "
            f"ratio to optimum, mean/median: top-k {s['topk']['mean_ratio']:.3f}/{s['topk']['median_ratio']:.3f}, "
            f"critical {s['critical']['mean_ratio']:.3f}/{s['critical']['median_ratio']:.3f}, "
            f"measured {s['measured']['mean_ratio']:.3f}/{s['measured']['median_ratio']:.3f}; "
            f"critical better than top-k in {100 * exhaustive['fraction_critical_better']:.0f}% of trials",
            markup=False,
        )
    results: list[PromptResult] = []
    h_kv = 0
    path = out / "perturbation.json"
    if n > 0:
        config = lm.config.get_text_config()
        h_kv = config.num_key_value_heads
        meta.update(
            model=model,
            model_type=config.model_type,
            dtype=str(lm.dtype).removeprefix("torch."),
            device=str(lm.device),
            attention=lm.config._attn_implementation,
            tokenizer=type(tokenizer).__name__,  # the class: its folder is this machine's path
            weights=MODEL_PRESETS[model].description if model in MODEL_PRESETS else "as stored in the model folder",
            layers=config.num_hidden_layers,
            query_heads=config.num_attention_heads,
            kv_heads=h_kv,
        )
        if prompts == "essays":
            prompt_list = essay_prompts(tokenizer, n, length, seed)
        elif prompts == "essay-windows":
            prompt_list = essay_window_prompts(tokenizer, n, length)
        else:
            prompt_list = text_prompts(tokenizer, Path(prompts).expanduser(), n, length)
        eos = tokenizer.eos_token_id
        total = len(prompt_list) * len(names) * len(parsed)
        with step_progress("perturbation", total, enabled=progress, console=console) as advance:
            for prompt in prompt_list:
                context = prompt.context_ids + (prompt.question_ids if mode == "aware" else [])
                question = None if mode == "aware" else torch.tensor([prompt.question_ids], device=lm.device)
                ids = torch.tensor([context], device=lm.device)
                captured = capture(lm, ids, question, generate=generate, eos_token_id=eos)
                info = {
                    **prompt.info,
                    "context_tokens": len(context),
                    "question_tokens": captured.labels.count("question"),
                    "generated_tokens": captured.labels.count("generated"),
                    "generated_text": tokenizer.decode(captured.follow_ids[0, captured.labels.count("question") :]),
                    "capture_seconds": captured.seconds,
                }
                result = measure_prompt(
                    lm,
                    captured,
                    built,
                    parsed,
                    prompt.index,
                    info,
                    hidden=hidden,
                    advance=advance,
                    one_forward=not stepwise,
                    window=window_queries,
                )
                results.append(result)
                del captured
                meta["seconds"] = time.perf_counter() - started
                write_json(path, _payload(meta, results, names, labels, pair_list, h_kv, exhaustive))
    meta["seconds"] = time.perf_counter() - started
    payload = _payload(meta, results, names, labels, pair_list, h_kv, exhaustive)
    write_json(path, payload)
    if results:
        if plots:
            _plots(out, results, payload["summary"], names, labels, pair_list)
        _print_summary(payload["summary"], names, labels)
    console.print(f"wrote {path} ({meta['seconds']:.0f} s)", markup=False)
    return payload


# the options that still apply with --from-json; every other option measures, and is refused there if given
_REDRAWING_OPTIONS = ("out", "pairs", "plots", "from_json")


def _measuring_options_given(ctx: typer.Context) -> list[str]:
    """The measuring options set on the command line, as their first flag (``--samples`` for ``--n``)."""
    return [
        param.opts[0]
        for param in ctx.command.params
        if param.name not in _REDRAWING_OPTIONS and ctx.get_parameter_source(param.name).name != "DEFAULT"
    ]  # by name: typer carries its own copy of click, whose ParameterSource is not click's


def perturbation(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Preset name (smollm2-135m, ...) or a local model folder.")] = (
        "smollm2-135m"
    ),
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated per-layer method presets (not the cross-layer or reconstruction ones). "
            "The first is the baseline."
        ),
    ] = "snapkv,critical-snapkv",
    budgets: Annotated[
        str, typer.Option(help="Comma-separated budgets: fractions (0.2) or entries per head (512).")
    ] = "0.1,0.2,0.4",
    prompts: Annotated[
        str,
        typer.Option(
            help="'essays' (needle prompts in one stretch of RULER's essays), 'essay-windows' (a different window of"
            " the essays per prompt, no needle, a fixed question) or a .txt file / folder of .txt files."
        ),
    ] = "essays",
    n: Annotated[
        int, typer.Option("--samples", "--n", help="Number of prompts (0: only the --exhaustive-check), as eval's.")
    ] = 20,
    length: Annotated[int, typer.Option(help="Context length in tokens of each prompt.")] = 4096,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Output folder of perturbation.json and the PNGs (default: results/perturbation; with --from-json, "
            "that file's folder)."
        ),
    ] = None,
    pairs: Annotated[
        str | None, typer.Option(help="Pairs A:B to compare (B vs A), comma-separated; default each vs the first.")
    ] = None,
    mode: Annotated[
        str, typer.Option(help="agnostic: compress the context, the question follows; aware: compress both.")
    ] = "agnostic",
    generate: Annotated[int, typer.Option(help="Greedy tokens of the full model whose queries are measured too.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of the prompts and of the exhaustive check.")] = 0,
    dtype: Annotated[str, typer.Option(help=DTYPE_HELP)] = "auto",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "auto",
    hidden: Annotated[
        bool, typer.Option(help="Also decode over each compressed cache and compare the last hidden state.")
    ] = True,
    stepwise: Annotated[
        bool,
        typer.Option(help="Feed the following tokens over each compressed cache one by one, as a decode (slower)."),
    ] = False,
    window_queries: Annotated[
        int,
        typer.Option(help="Also measure the last N prompt tokens as queries (the 'window' subset; 0: off)."),
    ] = 32,
    plots: Annotated[bool, typer.Option(help="Write the PNG figures.")] = True,
    exhaustive_check: Annotated[
        bool, typer.Option(help="Also compare the selectors with the brute-force optimum on random tiny heads.")
    ] = False,
    exhaustive_trials: Annotated[int, typer.Option(help="Random heads of the exhaustive check.")] = 200,
    exhaustive_entries: Annotated[int, typer.Option(help="Entries per random head (<= 16).")] = 12,
    exhaustive_budget: Annotated[int, typer.Option(help="Entries kept per random head.")] = 4,
    from_json: Annotated[
        Path | None,
        typer.Option(
            help="Measure nothing: recompute the summary and figures of an earlier perturbation.json (--pairs, "
            "--plots and --out apply; the measuring options, --methods included, are the file's and refused here)."
        ),
    ] = None,
) -> None:
    """Output perturbation per head of each method's kept set, against the full cache (CriticalKV's analysis)."""
    try:
        if from_json is not None and (given := _measuring_options_given(ctx)):
            raise CriticalKVError(
                f"--from-json measures nothing: {', '.join(given)} would be ignored (the measuring options are those "
                "of the file; only --pairs, --plots and --out apply)"
            )
        run_analysis(
            model=model,
            methods=methods,
            budgets=budgets,
            prompts=prompts,
            n=n,
            length=length,
            out=out,
            pairs=pairs,
            mode=mode,
            generate=generate,
            seed=seed,
            dtype=dtype,
            device=device,
            hidden=hidden,
            stepwise=stepwise,
            window_queries=window_queries,
            plots=plots,
            exhaustive_check=exhaustive_check,
            exhaustive_trials=exhaustive_trials,
            exhaustive_entries=exhaustive_entries,
            exhaustive_budget=exhaustive_budget,
            from_json=from_json,
        )
    except CriticalKVError as error:
        print_error(console, error)
        raise typer.Exit(2) from None
