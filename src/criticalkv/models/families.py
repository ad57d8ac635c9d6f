"""Model families criticalkv supports, the few config facts the cache needs from them, and where a model's attention
modules are."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from criticalkv.errors import CriticalKVError, UnsupportedModelError

#: ``config.model_type`` -> human-readable family name. Iterating yields the model types in order.
SUPPORTED_FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "Llama (also SmolLM2)",
        "mistral": "Mistral",
        "qwen2": "Qwen2 / Qwen2.5",
        "qwen3": "Qwen3",
        "qwen3_moe": "Qwen3-MoE",
        "gemma3_text": "Gemma 3 (text-only)",
        "phi3": "Phi-3",
        "smollm3": "SmolLM3",
        "olmo2": "OLMo 2",
        "granite": "IBM Granite",
        "mixtral": "Mixtral",
        "qwen2_moe": "Qwen1.5-MoE / Qwen2-MoE",
        "ministral": "Ministral",
        "cohere": "Cohere Command R",
        "cohere2": "Cohere Command R7B / A",
        "olmo": "OLMo",
        "olmo3": "OLMo 3",
        "glm": "GLM-4",
        "glm4": "GLM-4-0414",
        "exaone4": "EXAONE 4.0",
        "helium": "Kyutai Helium",
        "seed_oss": "Seed-OSS",
        "ernie4_5": "ERNIE 4.5",
        "arcee": "Arcee AFM",
        "apertus": "Apertus",
        "gemma": "Gemma",
        "nemotron": "Nemotron / Minitron",
        "hunyuan_v1_dense": "Hunyuan dense",
        "hunyuan_v1_moe": "Hunyuan-A13B MoE",
        "hy_v3": "Hunyuan 3",
        "glm4_moe": "GLM-4.5 / 4.6",
        "olmoe": "OLMoE",
        "flex_olmo": "FlexOlmo",
        "ernie4_5_moe": "ERNIE 4.5 MoE",
        "dots1": "dots.llm1",
        "granitemoe": "IBM Granite MoE",
        "granitemoeshared": "IBM Granite MoE with shared experts",
        "exaone_moe": "EXAONE MoE",
        "cohere2_moe": "Cohere Command MoE",
        "solar_open": "Solar Open",
        "jais2": "Jais 2",
        "mellum": "JetBrains Mellum",
        "hyperclovax": "HyperCLOVA X",
        "cwm": "Meta Code World Model",
        "kolibri1": "Kolibri",
        "gemma2": "Gemma 2",
        "gpt_oss": "gpt-oss",
        "phimoe": "Phi-3.5-MoE",
    }
)

#: model types refused for a reason beyond "not tested": what their attention does that criticalkv's does not
NOT_YET: Mapping[str, str] = MappingProxyType(
    {
        "bitnet": "BitNet normalises the attention output before o_proj, so the value norm ||V W_O|| of CriticalKV "
        "would not measure what an entry adds to the layer's output",
        "qwen3_next": "Qwen3-Next gates the attention output before o_proj and mixes in linear-attention layers, "
        "whose state is not a cache of entries to evict",
    }
)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """Return the decoder text config (the config itself for plain causal LMs).

    Parameters
    ----------
    config : PretrainedConfig
        Any transformers config, possibly a multimodal wrapper.

    Returns
    -------
    PretrainedConfig
        ``config.get_text_config(decoder=True)``.
    """
    return config.get_text_config(decoder=True)


def check_supported(config: PretrainedConfig) -> str:
    """Raise unless ``config`` belongs to a supported decoder family.

    Parameters
    ----------
    config : PretrainedConfig
        The model's top-level config. Multimodal wrappers (e.g. ``model_type="gemma3"``) are refused:
        load the text-only model instead.

    Returns
    -------
    str
        The config's ``model_type``.

    Raises
    ------
    UnsupportedModelError
        Naming the model type and listing the supported families; or a supported family's model with
        bidirectional attention (``use_bidirectional_attention``, EmbeddingGemma).
    """
    model_type = getattr(config, "model_type", None) or "<unknown>"
    if model_type in SUPPORTED_FAMILIES and getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"this '{model_type}' model uses bidirectional attention (an embedding model such as EmbeddingGemma): "
            "criticalkv compresses the caches of causal decoders only"
        )
    if model_type in SUPPORTED_FAMILIES:
        return model_type
    supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_FAMILIES.items())
    reason = f" {NOT_YET[model_type]}." if model_type in NOT_YET else ""
    hint = ""
    inner = getattr(text_config(config), "model_type", None)
    if inner in SUPPORTED_FAMILIES and inner != model_type:
        hint = (
            f" This is a multimodal wrapper around a supported '{inner}' text model: load the text-only "
            f"model (its config has model_type '{inner}', e.g. via AutoModelForCausalLM on a text checkpoint)."
        )
    raise UnsupportedModelError(
        f"criticalkv does not support model_type '{model_type}'.{reason} Supported families: {supported}.{hint}"
    )


def head_dim(config: PretrainedConfig) -> int:
    """Per-head dimension of keys/values (channels per head).

    Parameters
    ----------
    config : PretrainedConfig
        A decoder config (multimodal wrappers are unwrapped to their text config).

    Returns
    -------
    int
        ``config.head_dim`` when set, else ``hidden_size // num_attention_heads`` (Qwen2 has no
        ``head_dim`` field).
    """
    cfg = text_config(config)
    value = getattr(cfg, "head_dim", None)
    if value is not None:
        return int(value)
    return int(cfg.hidden_size // cfg.num_attention_heads)


def layer_types(config: PretrainedConfig) -> tuple[list[str], list[dict]]:
    """transformers' cache layer type of each decoder layer and the kwargs of its cache layer, with a sliding window
    at least as long as the model's positions read as full attention: it never binds (Phi-3's 128k checkpoints
    declare a 262144-token window over 131072 positions).

    Parameters
    ----------
    config : PretrainedConfig
        A decoder config (multimodal wrappers are unwrapped to their text config).

    Returns
    -------
    (list of str, list of dict)
        As ``transformers.cache_utils.get_layer_types_and_kwargs``.
    """
    cfg = text_config(config)
    kinds, kwargs = get_layer_types_and_kwargs(cfg)
    positions = getattr(cfg, "max_position_embeddings", None)
    for i, (kind, layer_kwargs) in enumerate(zip(kinds, kwargs, strict=True)):
        window = layer_kwargs.get("sliding_window")
        if kind == "sliding_attention" and positions is not None and window is not None and window >= positions:
            kinds[i], kwargs[i] = "full_attention", {}
    return kinds, kwargs


def check_length(config: PretrainedConfig, length: int, what: str = "length") -> int | None:
    """Refuse ``length`` tokens when they exceed the model's ``max_position_embeddings``; return that maximum
    (None when the config has none). ``what`` names the length in the error."""
    max_length = getattr(text_config(config), "max_position_embeddings", None)
    if max_length is not None and length > max_length:
        raise CriticalKVError(f"{what} {length} exceeds the model's maximum of {max_length} positions")
    return max_length


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules (those with an ``o_proj`` and a ``layer_idx``), in layer order."""
    modules = [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]
    return sorted(modules, key=lambda m: m.layer_idx)


def full_attention_layers(config: PretrainedConfig) -> list[int]:
    """Indices of the model's full-attention layers: the ones ``CompressedCache`` compresses.

    Sliding-window layers are never compressed, so depth-dependent allocators spread the budget over the
    full-attention layers only; for most models that is every layer.
    """
    kinds, _ = layer_types(config)
    return [i for i, kind in enumerate(kinds) if kind == "full_attention"]


def compressed_layer_position(module: nn.Module) -> tuple[int, int]:
    """(rank of this attention module's layer among the full-attention layers, how many there are)."""
    config = getattr(module, "config", None)
    layer_idx = getattr(module, "layer_idx", None)
    if config is None or layer_idx is None:
        raise CriticalKVError("this allocator needs the attention module's .config and .layer_idx")
    full = full_attention_layers(config)
    if layer_idx not in full:
        raise CriticalKVError(f"layer {layer_idx} is not a full-attention layer: it is not compressed")
    return full.index(layer_idx), len(full)
