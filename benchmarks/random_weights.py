"""A model folder of a checkpoint's shape with random weights, for a machine the checkpoint cannot reach.

Speed and memory depend on a model's shapes, not on its weights (every method keeps the entries its budget says,
every run decodes the same number of steps). This copies the configuration and tokenizer files of SOURCE (a local
model folder, or a preset name once converted), draws every weight with a fixed seed through transformers' own
initialisation, and saves the result as safetensors, so that criticalkv and kvpress load the same folder. What
random weights change is where attention falls: head-wise budgets (AdaKV) follow the random model's scores.

    python benchmarks/random_weights.py smollm2-135m results/smollm2-135m-random --seed 0
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
NOT_COPIED = ("criticalkv-preset.json",)  # a converted preset's completion marker: the new folder is no preset
MARKER = "random-weights.json"  # records where the shape came from and the seed


def write_random_model(
    source: Path, out: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> Path:
    """Save a model of ``source``'s configuration with weights drawn under ``seed`` into ``out``; returns ``out``.

    ``device``: where the weights are drawn (a GPU draws a 0.5B model in a second; the CPU's and a GPU's random
    streams differ, so the device is part of what makes the weights)."""
    if not (source / "config.json").is_file():
        raise SystemExit(f"{source} holds no config.json")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty")
    config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    for path in sorted(source.iterdir()):  # tokenizer, chat template, generation config; never the weights
        copied = path.suffix not in WEIGHT_SUFFIXES and path.name not in NOT_COPIED
        if path.is_file() and copied and not (out / path.name).exists():
            shutil.copy2(path, out / path.name)
    record = {"shape_of": source.name, "seed": seed, "dtype": str(dtype).removeprefix("torch."), "device": device}
    (out / MARKER).write_text(json.dumps(record, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a local model folder, or a criticalkv preset name (converted on first use)")
    parser.add_argument("out", type=Path, help="the new folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cpu", help="where the weights are drawn: cpu or cuda")
    args = parser.parse_args()
    source = Path(args.source)
    if not source.is_dir():
        from criticalkv.models import PRESETS, resolve_model_folder

        if args.source not in PRESETS:
            raise SystemExit(f"{args.source} is neither a folder nor a preset ({', '.join(PRESETS)})")
        source = resolve_model_folder(args.source)
    print(write_random_model(source, args.out, args.seed, getattr(torch, args.dtype), args.device))


if __name__ == "__main__":
    main()
