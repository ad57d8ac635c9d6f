"""Model loading: offline presets and supported families."""

from criticalkv.models.families import SUPPORTED_FAMILIES, check_length, check_supported, head_dim, text_config
from criticalkv.models.gguf import resolve_model_folder
from criticalkv.models.loading import load_model
from criticalkv.models.presets import PRESETS, list_presets

__all__ = [
    "PRESETS",
    "SUPPORTED_FAMILIES",
    "check_length",
    "check_supported",
    "head_dim",
    "list_presets",
    "load_model",
    "resolve_model_folder",
    "text_config",
]
