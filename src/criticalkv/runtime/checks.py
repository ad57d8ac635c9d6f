"""What the runtime refuses before any forward: a model or config a method cannot compress, nested blocks."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PretrainedConfig, PreTrainedModel

from criticalkv.cache.fused_attention import ATTENTION_ENV_VAR, flash_setup_reasons, requested_path
from criticalkv.errors import CacheStateError, UnsupportedModelError
from criticalkv.logits import logit_changes
from criticalkv.models.families import check_supported, head_dim, layer_types, text_config
from criticalkv.runtime.method import Method


def refuse_nesting(model: PreTrainedModel) -> None:
    """Refuse a model already inside ``criticalkv.compress(...)``: its hooks would compress whatever runs next, also
    a run meant to keep the full cache."""
    if model.config._attn_implementation.startswith("criticalkv_"):
        raise CacheStateError("this model is already inside criticalkv.compress(...); blocks do not nest")


def check_methods_config(config: PretrainedConfig, methods: Sequence[Method | None]) -> None:
    """Refuse, from the checkpoint's config alone (the commands check it before loading weights), a model one of
    ``methods`` cannot compress: an unsupported family, a model whose every attention layer is a sliding-window one
    (nothing to compress), sliding-window layers with a scorer that cannot run beside them
    (``supports_sliding_windows = False``: reconstruction), or what the ``check_config(config)`` of a
    scorer, allocator or selector refuses (reconstruction: soft-capped logits and sinks; measured selectors:
    sinks), and a forced flash-attn path (``$CRITICALKV_ATTENTION=flash``) on soft-capped or sink attention. None
    (the full cache, in a ``SharedPrefill``) needs the family alone."""
    check_supported(config)
    compressing = [method for method in methods if method is not None]
    if not compressing:
        return
    kinds, kwargs = layer_types(config)
    if "full_attention" not in kinds:
        windows = sorted({k["sliding_window"] for k in kwargs if k.get("sliding_window") is not None}) or ["?"]
        positions = getattr(text_config(config), "max_position_embeddings", None)
        raise UnsupportedModelError(
            f"every attention layer of this model is a sliding-window layer (a window of {windows[0]} tokens over "
            f"{positions} positions, as in Phi-3-mini-4k or Mistral-7B-v0.1): criticalkv compresses full-attention "
            "layers only, so there is nothing to compress"
        )
    sliding = sum(kind != "full_attention" for kind in kinds)
    for method in compressing:
        scorer = method.scorer
        if sliding and not scorer.supports_sliding_windows:
            raise UnsupportedModelError(
                f"{type(scorer).__name__} does not support models with sliding-window layers yet ({sliding} of this "
                f"model's {len(kinds)} layers): their caches cannot be rewound after its passes; use a scorer that "
                "reads the prefill alone (snapkv, tova, knorm, ...)"
            )
        for piece in method.pieces:
            piece.check_config(config)
    if requested_path() == "flash" and logit_changes(config):
        raise UnsupportedModelError(
            f"{ATTENTION_ENV_VAR}=flash: this model soft-caps its attention logits or adds attention sinks, which "
            "criticalkv's flash-attn call does not pass on; leave the path to criticalkv"
        )


def check_compressible(model: PreTrainedModel, method: Method | None) -> None:
    """Refuse, before any forward, a model ``method`` cannot compress: what ``check_methods_config`` refuses of its
    config, a forced flash-attn path (``$CRITICALKV_ATTENTION=flash``) the model's device, dtype or heads cannot
    take, and what the ``check_model(model)`` of the scorer, allocator or selector refuses
    (reconstruction: its tokenizer)."""
    check_methods_config(model.config, [method])
    if method is None:
        return
    if requested_path() == "flash":
        weight = next(model.parameters())
        reasons = flash_setup_reasons(weight.device, weight.dtype, head_dim(model.config))
        if reasons:
            raise UnsupportedModelError(f"{ATTENTION_ENV_VAR}=flash cannot run on this model: {'; '.join(reasons)}")
    for piece in method.pieces:
        piece.check_model(model)
