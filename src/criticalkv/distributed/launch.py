"""Running under ``torchrun``: the process group, loading a model split over the launched processes, and one
process (rank 0) that prints and writes.

``torchrun`` starts one process per rank and sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; every process
runs the same program, and every forward is a collective step all of them take together.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError


def launched_world_size() -> int:
    """Processes ``torchrun`` started (``WORLD_SIZE``); 1 in a plain ``python`` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank (0 in a plain run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """True on rank 0 (and in a plain run): the process that prints and writes."""
    return rank() == 0


def init_process_group() -> None:
    """Join the process group ``torchrun`` set up (idempotent; nothing in a plain run).

    NCCL when this process has a CUDA device (bound to ``LOCAL_RANK``), gloo on CPUs.
    """
    if launched_world_size() <= 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(hours=2))
    else:
        dist.init_process_group("gloo", timeout=timedelta(hours=2))
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    """Destroy the group before the interpreter exits: left to the C++ destructors, gloo's threads could abort a
    rank that finished first ("terminate called without an active exception") while another still worked."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


_REQUESTED: dict[str, int | None] = {"tp_size": None, "pp_size": None}  # set by configure (the CLI's options)


def configure(tp_size: int | None = None, pp_size: int | None = None) -> None:
    """Set the split ``load_model`` uses when given none (the CLI's ``--tp-size``/``--pp-size``); under
    ``torchrun``, join the process group and silence the standard output of every rank but 0."""
    _REQUESTED.update(tp_size=tp_size, pp_size=pp_size)
    if launched_world_size() > 1:
        init_process_group()
        quiet_unless_main()


def parallel_sizes(tp_size: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """(tensor-parallel size, pipeline stages) for the launched processes.

    By default every process is a tensor-parallel rank (``tp_size = WORLD_SIZE / pp_size``, ``pp_size = 1``);
    sizes not given fall back to those set by ``configure``.

    Raises
    ------
    CriticalKVError
        The sizes do not multiply to the number of launched processes.
    """
    world = launched_world_size()
    pp = pp_size or _REQUESTED["pp_size"] or 1
    tp = tp_size or _REQUESTED["tp_size"] or max(world // pp, 1)
    if tp < 1 or pp < 1 or tp * pp != world:
        raise CriticalKVError(
            f"tensor-parallel size {tp} x pipeline stages {pp} needs {tp * pp} processes, but {world} were launched "
            f"(run under `torchrun --nproc_per_node {tp * pp}`)"
        )
    return tp, pp


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = "auto",
    tp_size: int | None = None,
    pp_size: int | None = None,
    attn_implementation: str = "auto",
    device: str = "auto",
    check_config: Callable[[PretrainedConfig], None] | None = None,
    with_tokenizer: Callable[[PretrainedConfig, PreTrainedTokenizerBase], None] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``criticalkv.models.load_model``, split over the processes ``torchrun`` launched.

    In a plain run (one process) this is ``load_model`` itself, on ``device`` (``"auto"``: the GPU when there is
    one). Under ``torchrun`` the model is loaded with transformers' ``DistributedConfig(tp_size, pp_size)``
    (defaults: ``parallel_sizes``), each rank's part where transformers places it (its ``LOCAL_RANK`` GPU, or the
    CPU), so ``device`` must be ``"auto"``; a preset is converted once, by rank 0, while the others wait. The heads
    are checked before any weight is loaded (``UnevenHeadsError``); ``check_config`` and ``with_tokenizer`` run before
    it too, as in ``load_model``.
    """
    from transformers.distributed import DistributedConfig

    from criticalkv.models import gguf, loading
    from criticalkv.models.presets import PRESETS

    tp, pp = parallel_sizes(tp_size, pp_size)
    if tp * pp == 1:
        return loading.load_model(
            name_or_path,
            dtype=dtype,
            device=device,
            attn_implementation=attn_implementation,
            check_config=check_config,
            with_tokenizer=with_tokenizer,
        )
    if device != "auto":
        raise CriticalKVError(f"--device {device}: under torchrun each rank runs on its own device; leave it 'auto'")
    init_process_group()
    if name_or_path in PRESETS and is_main_process():
        gguf.resolve_model_folder(name_or_path)  # converts on first use; the other ranks wait below
    barrier()
    config = DistributedConfig(tp_size=tp, pp_size=pp)
    return loading.load_model(
        name_or_path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        distributed_config=config,
        check_config=check_config,
        with_tokenizer=with_tokenizer,
    )


def quiet_unless_main() -> None:
    """Send this process's standard output and transformers' progress bars to nowhere unless it is rank 0
    (errors and warnings still reach stderr)."""
    if not is_main_process():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
