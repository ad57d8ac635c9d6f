"""criticalkv: KV-cache eviction for long-context inference with transformers.

CriticalKV's perturbation-constrained selection over attention-based eviction methods, with a cache whose
per-head segments really free memory.
"""

from criticalkv.budget import Budget
from criticalkv.errors import CriticalKVError
from criticalkv.methods import PRESETS, build_method, method_names
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.api import compress
from criticalkv.runtime.method import Method

__all__ = [
    "PRESETS",
    "Budget",
    "CriticalKVError",
    "Method",
    "build_method",
    "compress",
    "encode_prompt",
    "method_names",
]
__version__ = "0.1.0"
