"""Does a split run decide exactly as one process? Run methods on a fixed prompt, gather every rank's decisions
into the whole model's, and compare two runs.

    python -m criticalkv.distributed.equivalence --model M --out single.pt
    torchrun --nproc_per_node 3 -m criticalkv.distributed.equivalence --model M --reference single.pt
    torchrun --nproc_per_node 2 -m criticalkv.distributed.equivalence --model M --splits 2x1,1x2 --reference single.pt

Each method prefills the prompt under ``criticalkv.compress`` (keep masks recorded), then decodes greedily; a run
records, per method, every layer's per-head budgets and keep masks (all heads, in the model's order), the logits
of the prefill's last position and of every decoding step, the greedy tokens, and each rank's KV bytes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from criticalkv.budget import Budget
from criticalkv.core.layout import ParallelLayout
from criticalkv.core.positions import forward_on_cache
from criticalkv.methods import build_method
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.method import Method


@dataclass
class MethodRun:
    """One method's decisions and outputs over the whole model (every layer, every head)."""

    budgets: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (b, h_kv) long
    keep: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (b, h_kv, t) bool
    logits: torch.Tensor | None = None  # (steps, b, vocab) float32: prefill's last position, then each step
    tokens: torch.Tensor | None = None  # (b, steps) greedy tokens
    rank_bytes: list[int] = field(default_factory=list)  # KV bytes each rank holds after the prefill


def _whole_model(parts: list[tuple[int, bool, list]]) -> tuple[dict, dict]:
    """Every rank's (tp_rank, heads_sharded, records) -> per-layer budgets and keep masks over all heads."""
    by_layer: dict[int, dict[int, tuple]] = {}
    for tp_rank, sharded, records in parts:
        for layer, kept, keep in records:
            by_layer.setdefault(layer, {})[tp_rank if sharded else 0] = (kept, keep)
    budgets, keeps = {}, {}
    for layer, blocks in sorted(by_layer.items()):
        ordered = [blocks[r] for r in sorted(blocks)]  # tensor-parallel rank order = head order
        budgets[layer] = torch.cat([kept for kept, _ in ordered], dim=1)
        keeps[layer] = torch.cat([keep for _, keep in ordered], dim=1)
    return budgets, keeps


@torch.no_grad()
def run_method(
    model: PreTrainedModel,
    method: str | Method,
    budget: Budget | float | int | str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    new_tokens: int,
) -> MethodRun:
    """Prefill ``input_ids`` (b, t) under ``method``, decode ``new_tokens`` greedily, gather the whole model's
    decisions. ``"full"`` keeps every layer whole (the uncompressed model, through criticalkv's cache). Every
    rank must call it; every rank returns the same ``MethodRun``."""
    layout = ParallelLayout.of(model)
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    run = MethodRun()
    if method == "full":  # every layer kept whole, in criticalkv's cache: the uncompressed reference
        method, budget = build_method("snapkv"), Budget(1.0)
    with Compressor(
        model, method if isinstance(method, Method) else build_method(method), Budget.parse(budget)
    ) as compressor:
        compressor.record_keep = True
        cache = compressor.new_cache()
        logits, tokens = [], []
        for step in range(new_tokens):
            out = forward_on_cache(model, ids, mask, cache)
            if step == 0:
                run.rank_bytes = [int(n) for n in layout.gather(cache.nbytes())]
            logits.append(out.logits[:, -1, :].float().cpu())
            ids = logits[-1].argmax(-1, keepdim=True).to(device)  # (b, 1)
            tokens.append(ids.cpu())
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
        records = [(r.layer, r.kept.cpu(), r.keep.cpu()) for r in compressor.records]
    run.logits, run.tokens = torch.stack(logits), torch.cat(tokens, dim=1)
    parts = layout.gather((layout.tp_rank, layout.heads_sharded, records))
    run.budgets, run.keep = _whole_model(parts)
    return run


def compare(reference: dict[str, MethodRun], candidate: dict[str, MethodRun], atol: float = 1e-5) -> list[str]:
    """What differs between two runs of the same methods (empty when kept indices, budgets and greedy tokens are
    identical and logits agree within ``atol``)."""
    problems = []
    for name, ref in reference.items():
        got = candidate.get(name)
        if got is None:
            problems.append(f"{name}: missing")
            continue
        if sorted(ref.keep) != sorted(got.keep):
            problems.append(f"{name}: layers {sorted(ref.keep)} vs {sorted(got.keep)}")
        for layer in sorted(set(ref.keep) & set(got.keep)):
            if not torch.equal(ref.budgets[layer], got.budgets[layer]):
                problems.append(f"{name}: layer {layer} budgets differ")
            if not torch.equal(ref.keep[layer], got.keep[layer]):
                differ = int((ref.keep[layer] != got.keep[layer]).sum())
                problems.append(f"{name}: layer {layer} keeps {differ} entries differently")
        gap = (ref.logits - got.logits).abs().max().item()
        if gap > atol:
            problems.append(f"{name}: logits differ by {gap:.3g} > {atol}")
        if not torch.equal(ref.tokens, got.tokens):
            problems.append(f"{name}: greedy tokens differ")
    return problems


def prompt(model: PreTrainedModel, tokenizer, tokens: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (rows, tokens) batch, left-padded: row r is ``r * 7`` tokens shorter. A needle-in-a-haystack text when
    the tokenizer has a vocabulary the model covers, else random ids."""
    lengths = [tokens - 7 * r for r in range(rows)]
    texts = []
    if tokenizer is not None and len(tokenizer) <= model.config.vocab_size:
        from criticalkv.eval.needle import build_needle_sample

        for r, n in enumerate(lengths):
            sample = build_needle_sample(tokenizer, n, depth=0.5, seed=seed + r)
            texts.append(tokenizer(sample.context, add_special_tokens=False)["input_ids"][:n])
    else:
        generator = torch.Generator().manual_seed(seed)
        texts = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    ids = torch.zeros(rows, tokens, dtype=torch.long)
    mask = torch.zeros(rows, tokens, dtype=torch.long)
    for r, row in enumerate(texts):
        ids[r, tokens - len(row) :] = torch.tensor(row)
        mask[r, tokens - len(row) :] = 1
    return ids, mask


def _splits(text: str | None, tp_size: int | None, pp_size: int | None) -> list[tuple[int | None, int | None]]:
    """``"2x1,1x2"`` -> [(2, 1), (1, 2)]; without ``--splits``, the one split of ``--tp-size`` x ``--pp-size``."""
    if not text:
        return [(tp_size, pp_size)]
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        tp, _, pp = item.partition("x")
        out.append((int(tp), int(pp or 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="preset name or model folder")
    parser.add_argument("--methods", default="critical-snapkv,critical-adakv,critical-headkv")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--tokens", type=int, default=256, help="prompt length (the longest row)")
    parser.add_argument("--rows", type=int, default=2, help="batch rows, left-padded")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-size", type=int, default=None, help="default: every launched process")
    parser.add_argument("--pp-size", type=int, default=None, help="pipeline stages (default 1)")
    parser.add_argument("--splits", help='several TPxPP splits run one after another, e.g. "2x1,1x2"')
    parser.add_argument("--out", type=Path, help="save the runs here (rank 0): {split: {method: MethodRun}}")
    parser.add_argument(
        "--reference", type=Path, help="a saved one-process run to compare with; exit 1 on a difference"
    )
    parser.add_argument("--atol", type=float, default=1e-5, help="largest logit difference counted as equal")
    args = parser.parse_args(argv)

    from criticalkv.distributed.launch import is_main_process, load_model

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results: dict[str, dict[str, MethodRun]] = {}
    for tp_size, pp_size in _splits(args.splits, args.tp_size, args.pp_size):
        model, tokenizer = load_model(args.model, dtype=args.dtype, tp_size=tp_size, pp_size=pp_size)
        layout = ParallelLayout.of(model)
        label = f"tp{layout.tp_size}xpp{layout.pp_size}"
        ids, mask = prompt(model, tokenizer, args.tokens, args.rows, args.seed)
        results[label] = {name: run_method(model, name, args.budget, ids, mask, args.new_tokens) for name in methods}
        del model
        if is_main_process():
            print(f"{args.model} {label}: prompt {tuple(ids.shape)}, budget {args.budget}")
            for name, run in results[label].items():
                print(f"  {name}: KV bytes per rank {run.rank_bytes} (max {max(run.rank_bytes)})")
    if not is_main_process():
        return 0
    if args.out is not None:
        torch.save(results, args.out)
    if args.reference is None:
        return 0
    (reference,) = torch.load(args.reference, weights_only=False).values()
    for label, runs in results.items():
        for name, run in runs.items():
            gap = (run.logits - reference[name].logits).abs().max().item()
            print(f"  {label} {name}: largest logit difference {gap:.3g}")
    problems = [f"{label}: {p}" for label, runs in results.items() for p in compare(reference, runs, args.atol)]
    print("identical to the reference" if not problems else "\n".join(["DIFFERENT:", *problems]))
    return 1 if problems else 0


if __name__ == "__main__":
    from criticalkv.distributed.equivalence import main as run  # saved runs then name this module, not __main__

    sys.exit(run())
