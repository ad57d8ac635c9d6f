"""How much the surrogate's placement of entries decides a chunked prefill's choice, isolated from everything else:
one forward of a RULER context gives every layer's keys and values; the surrogate's top ``cap`` entries per KV head
of the whole context (one-shot compression) are compared with what it keeps compressing those same keys and values
chunk after chunk, each held entry placed by its rank among the entries held (``place=held``) or by where it stands
in the prompt (``place=prompt``, the default). The share of one-shot's entries each keeps, per layer (JSON).

    python benchmarks/surrogate_placement.py --model qwen2.5-0.5b --tasks niah_single_1,vt --samples 1 \
        --cap 1024 --chunk-size 1024 --out results/surrogate_placement.json

Later chunks' keys and values are the one-shot forward's (a real chunked prefill attends to a compressed cache),
so the figures say what the placement alone changes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from criticalkv.eval import ruler
from criticalkv.models import load_model
from criticalkv.models.families import attention_modules, full_attention_layers
from criticalkv.prompts import chat_prompt_parts, encode_prompt_parts
from criticalkv.scorers import LayerView, SurrogateScorer
from criticalkv.scorers.base import follows_places


def scores_of(
    scorer: SurrogateScorer,
    module: nn.Module,
    keys: torch.Tensor,
    values: torch.Tensor,
    places: torch.Tensor,
    seen: int,
) -> torch.Tensor:
    """(h_kv, n) the scorer's scores of entries with keys and values (1, h_kv, n, d) standing at prompt ``places``
    (h_kv, n) among ``seen`` tokens, as the runtime hands them to it (the places only to a scorer that reads them);
    its protected entries (the sinks) score highest."""
    n = keys.shape[2]
    view = LayerView(module, keys[:, :, :0], keys, values, torch.ones(1, n, dtype=torch.bool), 1.0)  # no queries read
    if follows_places(scorer):
        view.places, view.seen = places[None], torch.tensor([seen])
    return scorer.score(view)[0].masked_fill(scorer.protected(view)[0], float("inf"))


def chunked_keep(
    scorer: SurrogateScorer, module: nn.Module, keys: torch.Tensor, values: torch.Tensor, cap: int, chunk: int
) -> torch.Tensor:
    """(h_kv, cap) prompt positions kept after compressing keys and values (1, h_kv, t, d) chunk after chunk."""
    h, t = keys.shape[1], keys.shape[2]
    held = torch.empty(h, 0, dtype=torch.long)  # (h_kv, n) prompt positions held, ascending
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        held = torch.cat([held, torch.arange(start, end).expand(h, -1)], dim=1)
        if held.shape[1] <= cap:
            continue
        k, v = (x.gather(2, held[None, ..., None].expand(-1, -1, -1, x.shape[-1])) for x in (keys, values))
        scores = scores_of(scorer, module, k, v, held, end)
        held = held.gather(1, scores.topk(cap, dim=-1).indices.sort(-1).values)
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--tasks", default="niah_single_1,vt")
    parser.add_argument("--samples", type=int, default=1, help="per task")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--cap", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("results/surrogate_placement.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model, dtype="float32")
    scorers = {place: SurrogateScorer(place=place) for place in ("held", "prompt")}
    for scorer in scorers.values():
        scorer.check_model(model)  # the shipped maps, attached to the model's attention layers
    compressed = set(full_attention_layers(model.config))  # the layers a map was fitted for
    modules = {m.layer_idx: m for m in attention_modules(model) if m.layer_idx in compressed}
    rows = []
    for task in args.tasks.split(","):
        for sample in ruler.generate(task, tokenizer, args.length, args.samples):
            prefix, _ = chat_prompt_parts(tokenizer, sample.context, sample.question, sample.answer_prefix)
            ids = torch.tensor([encode_prompt_parts(tokenizer, prefix, "")[0]])
            with torch.no_grad():
                cache = model(ids, use_cache=True).past_key_values
            t = ids.shape[1]
            row = {"task": task, "index": sample.index, "tokens": t, "held": [], "prompt": []}
            for layer, module in modules.items():
                keys, values = cache.layers[layer].keys, cache.layers[layer].values  # (1, h_kv, t, d)
                h = keys.shape[1]
                full = torch.arange(t).expand(h, -1)
                one_shot = scores_of(scorers["prompt"], module, keys, values, full, t).topk(args.cap, dim=-1).indices
                for place, scorer in scorers.items():
                    kept = chunked_keep(scorer, module, keys, values, args.cap, args.chunk_size)
                    same = sum(len(set(kept[j].tolist()) & set(one_shot[j].tolist())) for j in range(h))
                    row[place].append(round(same / (h * args.cap), 4))
            row.update({f"mean_{p}": round(sum(row[p]) / len(row[p]), 4) for p in ("held", "prompt")})
            print(json.dumps({k: v for k, v in row.items() if k not in ("held", "prompt")}), flush=True)
            rows.append(row)
    summary = {p: round(sum(r[f"mean_{p}"] for r in rows) / len(rows), 4) for p in ("held", "prompt")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"settings": settings, "share_of_one_shot": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
