"""Which map should the surrogate of the reconstruction scorer be? Held-out fit of the candidates on one model.

Training and held-out windows of the King James text are prefilled under the reconstruction scorer as
``criticalkv train-scorer`` does (same split, same seeded windows); each layer's input hidden states (the
normalised input its attention reads) are recorded beside the keys, values and true scores. Then, per layer and
KV head, candidate maps to the log-score are fitted on the training windows and measured on the held-out ones:

- linear on the key and value features (key pair magnitudes, keys, values: the shipped features without the three
  of an entry's place, added later with the maps per length; ``key_value_features``), the form ``train-scorer`` ships;
- linear on the hidden states, and on both (the hidden state is what KVzap reads);
- a small MLP on the shipped features (GELU hidden layer beside a linear path; Adam, seeded minibatches).

Per candidate: the mean over layers and heads of the rank correlation with the true scores and of the share of the
true 20% best entries kept, the same over every layer at once (the cross-layer presets' contest), and its size.

    python benchmarks/surrogate_maps.py --model smollm2-135m --windows 24 --tokens 512 --threads 1 \
        --out results/surrogate_maps_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from criticalkv.models import load_model
from criticalkv.models.families import attention_modules
from criticalkv.progress import step_progress
from criticalkv.scorers.reconstruct import ReconstructionScorer
from criticalkv.scorers.surrogate import key_value_features
from criticalkv.training.surrogate import (
    SCORE_FLOOR,
    NormalEquations,
    TrainingOptions,
    collect,
    kept_overlap,
    spearman,
    split_windows,
)
from criticalkv.training.text import kjv_text

REPORT_EVERY = 50  # MLP steps per progress line


@dataclass
class Rows:
    """One layer of one window, the protected sinks left out: shipped features (h_kv, n, F), hidden states (n, D)
    and log-scores (h_kv, n), float32."""

    features: torch.Tensor
    hidden: torch.Tensor
    target: torch.Tensor

    def inputs(self, kind: str) -> torch.Tensor:
        """(h_kv, n, F') float32 inputs of a linear candidate: 'kv', 'hidden' or 'kv+hidden'."""
        if kind == "kv":
            return self.features
        hidden = self.hidden[None].expand(self.features.shape[0], -1, -1)
        return hidden if kind == "hidden" else torch.cat([self.features, hidden], -1)


def gather(model, ids: torch.Tensor, scorer: ReconstructionScorer) -> dict[int, Rows]:
    """Every compressible layer's rows for the prefill of ``ids`` (1, t)."""
    hidden: dict[int, torch.Tensor] = {}

    def record(module, args, kwargs):  # the first call per layer is the prefill; later ones are the passes
        hidden.setdefault(module.layer_idx, kwargs["hidden_states"][0].detach().float().clone())

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in attention_modules(model)]
    try:
        samples = collect(model, ids, scorer)
    finally:
        for handle in handles:
            handle.remove()
    rows = {}
    for sample in samples:
        free = ~sample.protected
        features = key_value_features(sample.keys, sample.values)[:, free]
        target = sample.scores[:, free].clamp(min=SCORE_FLOOR).log().float()
        rows[sample.layer] = Rows(features, hidden[sample.layer][free], target)
    return rows


def with_ones(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], -1).double()


def fit_figures(predict, held_out: list[dict[int, Rows]], budget: float) -> dict[str, float]:
    """Held-out mean Spearman and kept-set overlap per layer and head, and the cross-layer overlap."""
    rank, overlap, cross = [], [], []
    for window in held_out:
        predicted_all, true_all = [], []
        for layer, rows in window.items():
            predicted, true = predict(layer, rows).double(), rows.target.double()  # (h_kv, n)
            rank.append(float(spearman(predicted, true).mean()))
            overlap.append(float(kept_overlap(predicted, true, budget).mean()))
            predicted_all.append(predicted.reshape(-1))
            true_all.append(true.reshape(-1))
        cross.append(float(kept_overlap(torch.cat(predicted_all), torch.cat(true_all), budget)))
    return {
        name: round(statistics.fmean(xs), 4)
        for name, xs in (("spearman", rank), ("overlap", overlap), ("cross_layer_overlap", cross))
    }


def linear_candidate(kind: str, ridge: float, train: list[dict[int, Rows]]):
    """The ridge fit of ``train`` on ``kind`` inputs: its predictor and parameter count."""
    equations = NormalEquations()
    for window in train:
        for layer, rows in window.items():
            # one length: every window has the same number of rows, which keys the sums
            equations.add_rows(layer, rows.target.shape[1], with_ones(rows.inputs(kind)), rows.target.double())
    weight, bias, layers, _ = equations.solve(ridge)  # (L, h_kv, 1, F'), (L, h_kv, 1): one length
    weight, bias = weight[:, :, 0], bias[:, :, 0]
    index = {layer: i for i, layer in enumerate(layers)}

    def predict(layer: int, rows: Rows) -> torch.Tensor:
        i = index[layer]
        return torch.einsum("hnf,hf->hn", rows.inputs(kind), weight[i]) + bias[i][:, None]

    return predict, weight.numel() + bias.numel()


def mlp_candidate(train: list[dict[int, Rows]], hidden: int, steps: int, batch: int, seed: int):
    """Per layer and head, log-score = w . x + W2 gelu(W1 x + b1) + b on standardised shipped features, fitted by
    Adam on seeded minibatches of the training rows (all maps at once); its predictor and parameter count."""
    layers = sorted(train[0])
    x = torch.stack([torch.cat([w[layer].features for w in train], 1) for layer in layers])  # (L, h, N, F)
    y = torch.stack([torch.cat([w[layer].target for w in train], 1) for layer in layers])  # (L, h, N)
    maps, n, f = x.shape[0] * x.shape[1], x.shape[2], x.shape[3]
    x, y = x.reshape(maps, n, f), y.reshape(maps, n)
    mean, std = x.mean(1, keepdim=True), x.std(1, keepdim=True) + 1e-6  # (maps, 1, F)
    generator = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(maps, f, hidden, generator=generator) / f**0.5).requires_grad_()
    b1 = torch.zeros(maps, 1, hidden, requires_grad=True)
    w2 = (torch.randn(maps, hidden, 1, generator=generator) / hidden**0.5).requires_grad_()
    linear = torch.zeros(maps, f, 1, requires_grad=True)
    bias = y.mean(1)[:, None, None].clone().requires_grad_()
    params = [w1, b1, w2, linear, bias]

    def forward(inputs: torch.Tensor, of: slice = slice(None)) -> torch.Tensor:
        """Raw features (maps ``of``, m, F) -> predicted log-scores (maps ``of``, m)."""
        inputs = (inputs - mean[of]) / std[of]
        return (torch.nn.functional.gelu(inputs @ w1[of] + b1[of]) @ w2[of] + inputs @ linear[of] + bias[of])[..., 0]

    optimiser = torch.optim.Adam(params, lr=3e-3, weight_decay=1e-4)
    with step_progress(f"MLP fit, {REPORT_EVERY} steps a line", -(-steps // REPORT_EVERY)) as advance:
        for step in range(steps):
            pick = torch.randint(0, n, (batch,), generator=generator)
            loss = (forward(x[:, pick]) - y[:, pick]).square().mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            if (step + 1) % REPORT_EVERY == 0 or step + 1 == steps:
                advance(f"step {step + 1}, minibatch loss {loss.item():.3f}")
    heads = train[0][layers[0]].target.shape[0]
    index = {layer: i for i, layer in enumerate(layers)}

    @torch.no_grad()
    def predict(layer: int, rows: Rows) -> torch.Tensor:
        start = index[layer] * heads
        return forward(rows.features, slice(start, start + heads))

    return predict, sum(p.numel() for p in params) + mean.numel() + std.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=24, help="training windows")
    parser.add_argument("--held-out", type=int, default=2, help="held-out windows")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per window")
    parser.add_argument("--ridges", default="0.001,0.01,0.1", help="ridge penalties of the linear candidates")
    parser.add_argument("--mlp-hidden", type=int, default=16, help="hidden units of the MLP candidate")
    parser.add_argument("--mlp-steps", type=int, default=1000)
    parser.add_argument("--budget", type=float, default=0.2, help="kept fraction of the overlap figures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/surrogate_maps.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    text = kjv_text()
    model, tokenizer = load_model(args.model, dtype="float32")
    options = TrainingOptions(windows=args.windows, held_out=args.held_out, lengths=(args.tokens,), seed=args.seed)
    train_ids, held_out_ids = split_windows(tokenizer, text.text, options)  # the windows train-scorer reads
    scorer = ReconstructionScorer(tokenizer=tokenizer)
    started = time.perf_counter()
    with step_progress("prefill + reconstruction", len(train_ids) + len(held_out_ids)) as advance:
        rows = []
        for ids in train_ids + held_out_ids:
            rows.append(gather(model, ids, scorer))
            advance(f"window {len(rows)}")
    train, held_out = rows[: len(train_ids)], rows[len(train_ids) :]
    collected = time.perf_counter() - started

    results = []
    candidates = [
        (f"linear on {kind}, ridge {ridge:g}", lambda kind=kind, ridge=ridge: linear_candidate(kind, ridge, train))
        for kind in ("kv", "hidden", "kv+hidden")
        for ridge in (float(r) for r in args.ridges.split(","))
    ]
    candidates.append(
        (
            f"MLP ({args.mlp_hidden} GELU units + linear) on kv",
            lambda: mlp_candidate(train, args.mlp_hidden, args.mlp_steps, 2048, args.seed),
        )
    )
    for name, build in candidates:
        started_fit = time.perf_counter()
        predict, parameters = build()
        figures = fit_figures(predict, held_out, args.budget)
        results.append(
            {"candidate": name, "parameters": parameters, **figures, "fit_s": round(time.perf_counter() - started_fit)}
        )
        print(f"{name}: {figures}, {parameters} parameters", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": args.model,
        "windows": args.windows,
        "held_out": args.held_out,
        "tokens": args.tokens,
        "budget": args.budget,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "collect_s": round(collected),
        "candidates": results,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print("| candidate | parameters | Spearman | overlap at budget | cross-layer overlap |\n|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['candidate']} | {row['parameters']:,} | {row['spearman']:.3f} | {row['overlap']:.3f} | "
            f"{row['cross_layer_overlap']:.3f} |"
        )


if __name__ == "__main__":
    main()
