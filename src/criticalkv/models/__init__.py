"""Model loading: offline presets and supported families."""

from criticalkv.models.families import SUPPORTED_FAMILIES, check_length, check_supported, head_dim, text_config
from criticalkv.models.presets import PRESETS, list_presets, load_model, resolve_model_folder

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
