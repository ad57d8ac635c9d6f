"""A model's fingerprint: what a learned artefact (a surrogate scorer) was fitted to, so that it is found for that
model and refused for any other."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn
from transformers import PretrainedConfig

from criticalkv.models.families import text_config

# Config fields that fix the architecture; the rest (paths, dtype, attention implementation, generation defaults)
# changes with how a model is loaded, not with what it computes.
_ARCHITECTURE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rms_norm_eps",
    "tie_word_embeddings",
    "layer_types",
    "sliding_window",
)
_SAMPLES_PER_WEIGHT = 4096  # values hashed per parameter: a fine-tune changes almost all of them


def architecture_of(config: PretrainedConfig) -> dict[str, object]:
    """The architecture fields of a model's (text) config, JSON-ready."""
    values = text_config(config).to_dict()
    return {key: values[key] for key in _ARCHITECTURE_FIELDS if values.get(key) is not None}


@torch.no_grad()
def model_fingerprint(model: nn.Module) -> str:
    """``sha256:<hex>`` of the architecture (``architecture_of``) and of every parameter's name, shape and a strided
    sample of its values rounded to bfloat16.

    The rounding makes the fingerprint independent of the dtype the weights are loaded in (a bfloat16 checkpoint
    loaded in float32 keeps its values exactly), so one artefact serves the model however it is loaded; a sample
    rather than every value keeps it to milliseconds on a model of billions of weights.
    """
    digest = hashlib.sha256(json.dumps(architecture_of(model.config), sort_keys=True, default=str).encode())
    for name, weight in sorted(model.named_parameters(), key=lambda item: item[0]):
        flat = weight.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLES_PER_WEIGHT)]
        digest.update(f"{name}:{tuple(weight.shape)}".encode())
        digest.update(sample.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"
