"""Answers of criticalkv and NVIDIA kvpress 0.5.5 on the same RULER samples, compared one by one.

Samples come from criticalkv's RULER generator (``criticalkv.eval.ruler.generate``, the one ``criticalkv eval
ruler`` uses, same seed), taken round-robin over the 13 tasks: sample i is task ``TASKS[i % 13]``, index
``i // 13``. Question-agnostic, as in ``eval ruler``: the context is compressed, then the question is asked on the
compressed cache. Both systems read the same model folder in the same dtype (float32 by default: kvpress's
bfloat16 scores tie at the cut) and answer the same token ids greedily with RULER's generation lengths. kvpress
runs in its own virtual environment and process (benchmarks/kvpress/answer_kvpress.py) and keeps as many entries
per head as criticalkv's budget (ratio 1 - (kept + 0.5) / T, see KVPRESS_FACTS.md).

For every method: exact agreement of the answers (token for token), each system's RULER score, and every
disagreement with the first differing token and, with ``--explain``, where the kept sets first differ (layer,
heads, entries only one system keeps; benchmarks/kvpress/compare_kept.py). ``full`` against kvpress's "no press"
is the control: it shows what the two transformers versions' numerics alone change.

    OMP_NUM_THREADS=1 python benchmarks/quality_vs_kvpress.py --model smollm2-135m --samples 100 --threads 1 \
        --out results/quality_vs_kvpress_smollm2

The stages resume, and run side by side in separate processes (``--stages ours``, ``--stages kvpress``); a third
process can take the end of the samples (``--stages kvpress --samples-from 41``). ``--stages report`` compares the
samples that both systems have answered with every method, and says how many of the requested ones those are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from speed_memory import PRESS_OF, VENV, git_state, kvpress_ratio, machine
from transformers import AutoConfig, AutoTokenizer

from criticalkv.eval import ruler
from criticalkv.methods import build_method
from criticalkv.models import PRESETS, load_model, resolve_model_folder
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.shared_prefill import SharedPrefill

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "kvpress"))
import compare_kept  # noqa: E402  (benchmarks/kvpress/compare_kept.py: kept sets of both systems)


def round_robin_samples(tokenizer, n: int, length: int, seed: int, max_length: int | None) -> list[ruler.RulerSample]:
    """n samples, task ``TASKS[i % 13]`` and index ``i // 13`` for sample i (the samples ``eval ruler`` draws)."""
    tasks = ruler.TASKS
    per_task = {task: len(range(i, n, len(tasks))) for i, task in enumerate(tasks)}
    drawn = {
        task: ruler.generate(task, tokenizer, length, count, seed=seed, max_length=max_length)
        for task, count in per_task.items()
        if count
    }
    return [drawn[tasks[i % len(tasks)]][i // len(tasks)] for i in range(n)]


def prepared_items(args: argparse.Namespace, folder: Path, tokenizer) -> tuple[list[dict], list[ruler.RulerSample]]:
    """The samples and their token ids, generated once per output folder and settings (samples.jsonl)."""
    settings = {k: str(getattr(args, k)) for k in ("model", "samples", "length", "budget", "max_new_tokens", "seed")}
    path, settings_path = args.out / "samples.jsonl", args.out / "settings.json"
    stored = json.loads(settings_path.read_text()) if settings_path.exists() else None
    if path.exists() and stored == settings:
        items = _read_jsonl(path)
        return items, [ruler.RulerSample(**item["sample"]) for item in items]
    answers = sorted(p.name for p in (*args.out.glob("ours*.jsonl"), *args.out.glob("kvpress*.jsonl")))
    if answers:  # answers are keyed by sample name: new samples would be matched with the old answers
        raise SystemExit(
            f"{args.out} holds answers ({', '.join(answers)}) to the samples of other settings ({stored}, now "
            f"{settings}): use another --out"
        )
    max_length = getattr(AutoConfig.from_pretrained(folder, trust_remote_code=False), "max_position_embeddings", None)
    samples = round_robin_samples(tokenizer, args.samples, args.length, args.seed, max_length)
    items = []
    for sample in samples:
        context_ids, question_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        cap = ruler.TOKENS_TO_GENERATE[sample.task]
        items.append(
            {
                "key": f"{sample.task}/{sample.index}",
                "context_ids": context_ids,
                "question_ids": question_ids,
                "max_new_tokens": min(cap, args.max_new_tokens) if args.max_new_tokens else cap,
                "compression_ratio": kvpress_ratio(args.budget, len(context_ids)),
                "sample": asdict(sample),
            }
        )
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    settings_path.write_text(json.dumps(settings))
    return items, samples


def trim_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def check_answer_settings(args: argparse.Namespace) -> None:
    """Refuse to add answers of another dtype or window to a folder's answers (answers.json records them)."""
    settings = {"dtype": args.dtype, "window": args.window}
    path = args.out / "answers.json"
    if path.exists() and json.loads(path.read_text()) != settings:
        raise SystemExit(f"{args.out} holds answers of {path.read_text()}, not {settings}: use another --out")
    path.write_text(json.dumps(settings))


#: presets with a SnapKV observation window, the one kvpress's presses take as window_size
WINDOWED = ("snapkv", "critical-snapkv", "adakv", "critical-adakv")


def our_answers(
    model, items: list[dict], methods: list[str], budget: str, window: int, eos: set[int], path: Path
) -> None:
    """Append criticalkv's answers per sample to ``path``, one prefill per sample; samples every method has
    answered there already are skipped (the last complete line of a sample wins when results are read)."""
    done = {row["key"] for row in _read_jsonl(path) if set(methods) <= set(row["tokens"])}
    with path.open("a") as sink:
        for number, item in enumerate(items, 1):
            if item["key"] in done:
                continue
            targets = [
                (m, build_method(m, window=window) if m in WINDOWED else m, 1.0 if m == "full" else budget)
                for m in methods
            ]
            sessions = SharedPrefill(model, targets).prefill(torch.tensor([item["context_ids"]]))
            tokens = {}
            for method in methods:
                generation = sessions[method].ask(
                    torch.tensor([item["question_ids"]]), max_new_tokens=item["max_new_tokens"], eos_token_id=list(eos)
                )
                tokens[method] = trim_at_eos(generation.tokens[0].tolist(), eos)
            sink.write(json.dumps({"key": item["key"], "tokens": tokens}) + "\n")
            sink.flush()
            print(f"[ours] {number}/{len(items)} {item['key']}", file=sys.stderr, flush=True)


def kvpress_answers(args, folder: Path, samples_file: Path, methods: list[str], eos: set[int], path: Path) -> None:
    """kvpress's answers to every sample, appended to ``path`` by its own process."""
    command = [str(VENV / "bin/python"), str(HERE / "kvpress/answer_kvpress.py"), "--model", str(folder)]
    command += ["--input", str(samples_file), "--presses", ",".join(PRESS_OF[m] for m in methods)]
    command += ["--eos", ",".join(map(str, sorted(eos))), "--dtype", args.dtype, "--out", str(path)]
    command += ["--threads", str(args.threads), "--window-size", str(args.window)]
    subprocess.run(command, check=True)


def kept_difference(model, folder: Path, context_ids: list[int], method: str, budget: float, window: int) -> dict:
    """Where the two systems' kept sets of one context first differ: layer, heads, entries only one keeps."""
    ids = torch.tensor([context_ids])
    ours = compare_kept.ours(model, ids, method, budget, window)  # per layer (h_kv, t) bool
    row_budget = int(ours[0].sum()) // ours[0].shape[0]
    with tempfile.TemporaryDirectory() as tmp:
        theirs = compare_kept.theirs(folder, ids, method, row_budget, window, Path(tmp))
    differing = [
        (layer, head)
        for layer, (a, b) in enumerate(zip(ours, theirs, strict=True))
        for head in range(a.shape[0])
        if not torch.equal(a[head], b[head])
    ]
    if not differing:
        return {"heads_identical": f"{sum(a.shape[0] for a in ours)}/{sum(a.shape[0] for a in ours)}"}
    first = differing[0][0]
    a, b = ours[first], theirs[first]
    return {
        "heads_identical": f"{sum(a.shape[0] for a in ours) - len(differing)}/{sum(a.shape[0] for a in ours)}",
        "layers_differing": sorted({layer for layer, _ in differing}),
        "first_layer": first,
        "first_layer_heads": [
            {
                "head": head,
                "ours_only": torch.nonzero(a[head] & ~b[head]).flatten().tolist(),
                "kvpress_only": torch.nonzero(b[head] & ~a[head]).flatten().tolist(),
            }
            for layer, head in differing
            if layer == first
        ],
    }


def answer_tables(
    ours_rows: list[dict], theirs_rows: list[dict], methods: list[str]
) -> tuple[dict[str, dict], dict[tuple[str, str], list[int]]]:
    """Each system's answers as read by the report: ours, sample -> {method: tokens} from its last line that
    answers every method; kvpress's, (sample, press) -> tokens from its last line."""
    ours = {row["key"]: row["tokens"] for row in ours_rows if set(methods) <= set(row["tokens"])}
    theirs = {(row["key"], row["press"]): row["tokens"] for row in theirs_rows}
    return ours, theirs


def both_answered(ours: dict[str, dict], theirs: dict[tuple[str, str], list[int]], methods: list[str]) -> set[str]:
    """Samples every method of ours and every matching press of kvpress's have answered (``answer_tables``)."""
    return {key for key in ours if all((key, PRESS_OF[m]) in theirs for m in methods)}


def compare(items, ours, theirs, samples, tokenizer, methods) -> dict:
    """Agreement and scores per method, and the disagreements; ``ours`` and ``theirs`` from ``answer_tables``."""
    by_key = {item["key"]: (item, sample) for item, sample in zip(items, samples, strict=True)}
    report = {}
    for method in methods:
        rows = []
        for key, (item, sample) in by_key.items():
            a, b = ours[key][method], theirs[(key, PRESS_OF[method])]
            text_a = tokenizer.decode(a, skip_special_tokens=True).strip()
            text_b = tokenizer.decode(b, skip_special_tokens=True).strip()
            first = next(
                (i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b))
            )
            rows.append(
                {
                    "key": key,
                    "task": sample.task,
                    "agree": a == b,
                    "ours_score": ruler.score(sample, text_a),
                    "kvpress_score": ruler.score(sample, text_b),
                    "ours": text_a,
                    "kvpress": text_b,
                    "first_differing_token": first,
                    "context_tokens": len(item["context_ids"]),
                }
            )
        report[method] = {
            "kvpress_press": PRESS_OF[method],
            "samples": len(rows),
            "exact_agreement": sum(r["agree"] for r in rows) / len(rows),
            "score_agreement": sum(r["ours_score"] == r["kvpress_score"] for r in rows) / len(rows),
            "ours_mean_score": statistics.mean(r["ours_score"] for r in rows),
            "kvpress_mean_score": statistics.mean(r["kvpress_score"] for r in rows),
            "disagreements": [r for r in rows if not r["agree"]],
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="preset name or local model folder")
    parser.add_argument("--samples", type=int, default=100, help="RULER samples, round-robin over the 13 tasks")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--methods", default="full,snapkv,critical-snapkv,critical-adakv")
    parser.add_argument("--window", type=int, default=32, help="SnapKV window, both systems")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="cap on answer tokens (0: RULER's per task)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--explain", action=argparse.BooleanOptionalAction, default=True, help="kept-set diffs")
    parser.add_argument(
        "--stages",
        default="ours,kvpress,report",
        help="what to run: ours, kvpress, report (separate processes can run ours and kvpress side by side)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/quality_vs_kvpress"), help="folder (resumes)")
    parser.add_argument(
        "--samples-from",
        type=int,
        default=1,
        help="answer only the samples from this one on (1-based), into ours_from_<n>.jsonl / kvpress_from_<n>.jsonl:"
        " a second process can take the end of a long run; the report reads every such file",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        build_method(method)
        if method not in PRESS_OF:
            raise SystemExit(f"{method} has no kvpress counterpart; methods with one: {', '.join(PRESS_OF)}")
    if not (VENV / "bin/python").exists():
        raise SystemExit(f"no kvpress environment at {VENV}: run benchmarks/kvpress/setup_kvpress_env.sh")

    folder = resolve_model_folder(args.model) if args.model in PRESETS else Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    args.out.mkdir(parents=True, exist_ok=True)
    items, samples = prepared_items(args, folder, tokenizer)
    eos = {tokenizer.eos_token_id}
    stages = {s.strip() for s in args.stages.split(",")}
    model = load_model(str(folder), dtype=args.dtype)[0] if stages & {"ours", "report"} else None
    suffix = "" if args.samples_from == 1 else f"_from_{args.samples_from}"
    if not 1 <= args.samples_from <= len(items):
        raise SystemExit(f"--samples-from must be within 1..{len(items)}")
    if stages & {"ours", "kvpress"}:
        check_answer_settings(args)
    if "ours" in stages:
        ours_path = args.out / f"ours{suffix}.jsonl"
        our_answers(model, items[args.samples_from - 1 :], methods, args.budget, args.window, eos, ours_path)
    if "kvpress" in stages:
        samples_file = args.out / f"samples{suffix}.jsonl"
        if suffix:
            samples_file.write_text("".join(json.dumps(item) + "\n" for item in items[args.samples_from - 1 :]))
        kvpress_answers(args, folder, samples_file, methods, eos, args.out / f"kvpress{suffix}.jsonl")
    if "report" not in stages:
        return

    ours_rows = [row for path in sorted(args.out.glob("ours*.jsonl")) for row in _read_jsonl(path)]
    theirs_rows = [row for path in sorted(args.out.glob("kvpress*.jsonl")) for row in _read_jsonl(path)]
    ours, theirs = answer_tables(ours_rows, theirs_rows, methods)
    answered = both_answered(ours, theirs, methods)
    paired = [(item, sample) for item, sample in zip(items, samples, strict=True) if item["key"] in answered]
    if not paired:
        raise SystemExit(f"no sample in {args.out} has been answered by both systems yet")
    print(f"report on {len(paired)} of {len(items)} samples (those both systems answered)")
    items, samples = [item for item, _ in paired], [sample for _, sample in paired]
    report = compare(items, ours, theirs, samples, tokenizer, methods)
    if args.explain:
        context_of = {item["key"]: item["context_ids"] for item in items}
        for method, result in report.items():
            if method == "full":
                continue
            for row in result["disagreements"]:
                row["kept_sets"] = kept_difference(
                    model, folder, context_of[row["key"]], method, float(args.budget), args.window
                )
    summary = {
        "command": " ".join(["python benchmarks/quality_vs_kvpress.py", *sys.argv[1:]]),
        "model": args.model,
        "samples": len(items),
        "samples_requested": args.samples,
        "length": args.length,
        "budget": args.budget,
        "dtype": args.dtype,
        "regime": "agnostic",
        "threads": torch.get_num_threads(),
        "machine": machine(),
        "git": git_state(),
        "methods": report,
    }
    (args.out / "report.json").write_text(json.dumps(summary, indent=2))
    for method, r in report.items():
        print(
            f"{method:16s} agreement {100 * r['exact_agreement']:5.1f}%  score ours {r['ours_mean_score']:5.1f}  "
            f"kvpress {r['kvpress_mean_score']:5.1f}  disagreements {len(r['disagreements'])}"
        )
    print(f"wrote {args.out / 'report.json'}")


if __name__ == "__main__":
    main()
