"""Loading a supported causal LM and its tokenizer: a preset (converted on first use), a local folder or a hub id."""

from __future__ import annotations

from collections.abc import Callable
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

from criticalkv.errors import CriticalKVError, UnsupportedModelError, did_you_mean
from criticalkv.models.device_dtype import as_dtype, preset_dtype, resolve_device, slow_dtype_note
from criticalkv.models.families import check_supported
from criticalkv.models.gguf import resolve_model_folder
from criticalkv.models.hub import hub_reachable
from criticalkv.models.presets import DEFAULT_PRESET, PRESETS

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
        ``"auto"`` means, for presets, bfloat16 (float32 on a CPU without bfloat16 instructions: ``preset_dtype``),
        and the checkpoint's own dtype otherwise.
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
    runs_on = target if target is not None else resolve_device("auto")  # torchrun's ranks: a GPU each, or the CPU
    torch_dtype = as_dtype(dtype, preset_dtype(runs_on) if is_preset else "auto")
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
