"""How far the measured selector's swap search lowers its window objective per round, and what each round costs.

Captures one full-cache prefill of the needle prompt, then decides every layer with
``measured-snapkv:search=S;rounds=R`` for each search norm S and round count R: the window objective L (the
exact L1 perturbation of the window queries, summed over the layers) relative to the starting set's (R = 0), and
the CPU time of the decisions (SnapKV's scoring included; the median over ``--repeats``, each decision on a
fresh view so that nothing is reused between them).

    python benchmarks/measured_search.py --model smollm2-135m --tokens 4096 --budget 0.2 --threads 1 \
        --searches l1,l2 --rounds 0,1,2,4,8 --out results/measured_search_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from criticalkv.analysis.capture import capture
from criticalkv.budget import Budget
from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.methods import build_method
from criticalkv.models import load_model
from criticalkv.selectors.measured import WindowPerturbation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--searches", default="l1,l2")
    parser.add_argument("--rounds", default="0,1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/measured_search.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model)
    ids = torch.tensor([needle_prompt_ids(tokenizer, args.tokens)])
    layers = capture(model, ids, generate=0).analysed
    budget = Budget(args.budget)
    rows = []
    for search in args.searches.split(","):
        for rounds in (int(r) for r in args.rounds.split(",")):
            method = build_method(f"measured-snapkv:search={search};rounds={rounds}")
            seconds, loss = [], 0.0
            for repeat in range(args.repeats):
                spent = 0.0
                for layer in layers:
                    view = layer.view()
                    start = time.process_time()
                    keep = method.decide(view, budget).keep
                    spent += time.process_time() - start
                    if repeat == 0:
                        loss += float(WindowPerturbation.of_view(layer.view(), method.selector.window).loss(keep).sum())
                seconds.append(spent)
            rows.append({"search": search, "rounds": rounds, "window_loss": loss, "cpu_seconds": seconds})
            print(
                f"search={search} rounds={rounds:2d}  L {loss:12.2f}  decisions {statistics.median(seconds):.3f} CPU s"
            )
    for row in rows:  # against the starting set (rounds=0), when it was run
        start = next((r for r in rows if r["search"] == row["search"] and r["rounds"] == 0), None)
        row["window_loss_vs_start"] = row["window_loss"] / start["window_loss"] if start else None
    report = {
        "command": "python benchmarks/measured_search.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": args.model,
        "prompt_tokens": ids.shape[1],
        "layers": len(layers),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
