"""Timed greedy generation and memory probes, shared by criticalkv's and kvpress's benchmark processes.

Imports torch and the standard library only, so the same code times both systems: it runs in criticalkv's
environment and in kvpress's (benchmarks/kvpress/speed_kvpress.py), never with both libraries in one process.

Time: wall-clock seconds and this process's CPU seconds (``time.process_time``). With one torch thread the CPU
time is the figure to read on a machine that other jobs share: it counts only what this process computed. On a GPU
only the wall clock means anything.

Operators (``count_prefill_ops``): the aten operators one prefill dispatches, those among them that run a kernel (not
views or bare allocations: about one launch each on a GPU), and those whose result the host reads (``.item()``,
``nonzero``, ``bool(tensor)``, ``Tensor.tolist``, indexing by a boolean mask), each a wait for the GPU.
On a small model on a GPU the prefill is bound by these launches, not by arithmetic: the count explains times
that the arithmetic does not, and it can be taken on a CPU.

Phases (``PhaseClock``): the prefill's CPU time and minor page faults split into each layer's attention module,
its MLP and the system's compression, on both sides through the same hooks.

Memory: peak resident set size (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) above the RSS just before
the prefill, and on a GPU the peak of ``torch.cuda.max_memory_allocated`` above what was allocated then. Run the
process in ``child_environment("mmap")`` so that freed tensors leave the process and RSS tracks live memory.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATORS = ("mmap", "glibc", "retain")  # settings of glibc's allocator for a measurement process (child_environment)
HOST_READS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal")  # operators whose result the host waits for
MASK_INDEXING = ("index", "index_put", "index_put_")  # with a boolean index these count its True entries first
# Operators that are neither views (``OpOverload.is_view``) nor run a kernel: metadata and bare allocations
NO_KERNEL = (
    "_unsafe_view",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
)
_RETAIN = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}  # glibc: never mmap, never trim


def child_environment(allocator: str = "mmap") -> dict[str, str]:
    """The environment of a measurement process: this one's, with glibc's allocator set for ``allocator``.

    "mmap": glibc keeps freed large blocks in its heap unless they were mmapped; with a 64 KiB threshold (or the one
    already set) every tensor buffer is mmapped and returned on free, so peak RSS measures live memory, not the
    allocator's retention, at the cost of page faults that add CPU time. "glibc": its defaults, for times.
    "retain": no buffer is mmapped and the heap is never trimmed, so freed memory stays in the process and a prefill
    after one of the same length maps no fresh pages: times without the kernel's page zeroing, whose amount under
    the defaults depends on the order of allocations and frees and moves from process to process (peak RSS is then
    retention).
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    env = dict(os.environ)
    for name in _RETAIN:
        env.pop(name, None)
    if allocator == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = env.get("MALLOC_MMAP_THRESHOLD_", "65536")
        return env
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if allocator == "retain":
        env.update(_RETAIN)
    return env


def rerun_under(allocator: str, marker: str) -> str:
    """Run this script again under ``allocator`` (glibc reads its settings at start), unless it is that run: the
    environment variable ``marker`` tells it. Returns the allocator setting the process runs under."""
    if os.environ.get(marker) is None:
        environment = {**child_environment(allocator), marker: allocator}
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)  # the interpreter's flags too
    return os.environ[marker]


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_memory(device: torch.device) -> dict[str, int]:
    """Reset the peak marks (RSS, and CUDA on a GPU); return the current figures they are measured from."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = {"rss": _status_bytes("VmRSS")}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start["cuda"] = torch.cuda.memory_allocated(device)
    return start


def peak_memory_above(device: torch.device, start: dict[str, int]) -> dict[str, int]:
    """Peak memory since ``reset_peak_memory``, above the figures it returned."""
    peak = {"peak_rss_above_start_bytes": _status_bytes("VmHWM") - start["rss"]}
    if device.type == "cuda":
        peak["peak_cuda_above_start_bytes"] = torch.cuda.max_memory_allocated(device) - start["cuda"]
    return peak


def held_kv(cache) -> tuple[int, int]:
    """(bytes, entries) of key/value storage a cache holds: what it allocated, masked entries included.

    criticalkv's cache reports its own (kept entries, tail capacity and per-segment counts); a transformers
    ``DynamicCache`` (kvpress's) holds its layers' ``keys``/``values`` of shape (b, h_kv, t, d).
    """
    if hasattr(cache, "nbytes") and hasattr(cache, "entries"):
        return cache.nbytes(), cache.entries()
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    entries = sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] for layer in layers)
    return nbytes, entries


def _cache_argument(model) -> str:
    """The forward's (and its output's) name for the cache: ``cache`` (transformers 5.24) or ``past_key_values``
    (transformers 5.2, kvpress's)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _OperatorCount(TorchDispatchMode):
    """Counts the aten operators dispatched inside it (below autograd), those that launch a kernel (not views, not
    bare allocations: ``NO_KERNEL``), and the host reads among them; ``Tensor.tolist`` dispatches no operator on a
    CPU (on a GPU it copies to the host first), so its calls are counted as host reads by wrapping it while the mode
    is on."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.launches = 0  # the operators that run a kernel: not views, not bare allocations
        self.host_reads = 0
        self._tolist = None

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        original = self._tolist

        def counted(tensor, *args, **kwargs):
            self.host_reads += 1
            return original(tensor, *args, **kwargs)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.total += 1
        self.launches += not (func.is_view or name in NO_KERNEL)
        self.host_reads += _reads_host(name, args)
        return func(*args, **(kwargs or {}))


def _reads_host(name: str, args: tuple) -> bool:
    """Whether an operator makes the host wait for the device: a read of a value, or indexing by a boolean mask
    (``x[mask]``, ``x[mask] = y``), whose output size is the mask's count."""
    if name in HOST_READS:
        return True
    indices = args[1] if name in MASK_INDEXING and len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


@torch.no_grad()
def count_prefill_ops(
    model,
    input_ids: torch.Tensor,
    cache,
    prefill_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, int]:
    """The operators one prefill of ``input_ids`` (with ``attention_mask``, a left-padded batch) dispatches inside
    ``prefill_scope()``, and how many the host waits for (``_reads_host``). Run it apart from timed runs: counting
    slows every operator."""
    counter = _OperatorCount()
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, _cache_argument(model): cache}
    with prefill_scope(), counter:
        model(**inputs, use_cache=True, logits_to_keep=1)
    return {
        "prefill_dispatched_ops": counter.total,
        "prefill_launching_ops": counter.launches,
        "prefill_host_reads": counter.host_reads,
    }


PHASE_MODULES = {"self_attn": "attention", "mlp": "mlp"}  # decoder-layer submodules by their attribute name


def _usage() -> tuple[float, int]:
    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class PhaseClock:
    """CPU seconds and minor page faults of a forward, split into phases: each decoder layer's attention module and
    MLP (``PHASE_MODULES``), and whatever ``wrap`` adds (a system's compression). Exclusive: a phase that runs inside
    another (criticalkv compresses inside the attention function, kvpress in a hook after the module, registered
    later than this clock's) is counted in its own phase only. What no phase covers (embeddings, norms, the mask,
    rotary tables, the head) is the prefill's total less their sum.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._stack: list[list] = []  # [phase, cpu at entry, faults at entry, cpu of nested phases, their faults]
        self.totals: dict[str, list] = {}
        for name, module in model.named_modules():
            phase = PHASE_MODULES.get(name.rsplit(".", 1)[-1])
            if phase is not None:
                module.register_forward_pre_hook(lambda *_, p=phase: self._enter(p))
                module.register_forward_hook(lambda *_: self._exit())

    def wrap(self, owner: object, attribute: str, phase: str) -> None:
        """Count the calls of ``owner.attribute`` (a method or a hook the owner installs later) as ``phase``."""
        inner = getattr(owner, attribute)

        def counted(*args, **kwargs):
            self._enter(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                self._exit()

        setattr(owner, attribute, counted)

    def reset(self) -> None:
        self.totals = {}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per phase: CPU seconds, minor faults and calls since ``reset``."""
        return {phase: {"cpu_seconds": c, "minor_faults": f, "calls": n} for phase, (c, f, n) in self.totals.items()}

    def _enter(self, phase: str) -> None:
        self._stack.append([phase, *_usage(), 0.0, 0])

    def _exit(self) -> None:
        phase, cpu, faults, nested_cpu, nested_faults = self._stack.pop()
        now_cpu, now_faults = _usage()
        spent, faulted = now_cpu - cpu, now_faults - faults
        total = self.totals.setdefault(phase, [0.0, 0, 0])
        total[0] += spent - nested_cpu
        total[1] += faulted - nested_faults
        total[2] += 1
        if self._stack:
            self._stack[-1][3] += spent
            self._stack[-1][4] += faulted


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def timed_greedy(
    model,
    input_ids: torch.Tensor,
    cache,
    decode_steps: int,
    prefill_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    compression_clock: Callable[[], float] | None = None,
    phase_clock: PhaseClock | None = None,
) -> dict:
    """Prefill ``input_ids`` (1, t) into ``cache`` inside ``prefill_scope()``, then greedy-decode ``decode_steps``.

    Decoding continues at the original positions t, t+1, ... (kvpress's pipeline does the same; criticalkv's
    cache keeps logical positions anyway). No end-of-sequence stop: every run decodes the same number of tokens.

    Returns time to first token (the prefill forward and its argmax) and each decode step's time, in wall and
    CPU seconds, with the decode medians; KV bytes and entries held right after the prefill; peak memory above
    the start of the prefill; the minor page faults of the prefill (fresh memory the kernel mapped in, a cost in
    its CPU time); and the generated ids. With ``compression_clock`` (the CPU seconds the system has
    spent compressing so far, a running total), also the part of the prefill's CPU time spent compressing (host
    time: on a GPU, where kernels run asynchronously, mostly their launches). With ``phase_clock``, also the prefill's
    CPU time and faults per phase (``prefill_phases``; CPU clocks: on a GPU, host time).
    """
    device = input_ids.device
    name = _cache_argument(model)
    t = input_ids.shape[1]
    start_memory = reset_peak_memory(device)
    compressed_before = compression_clock() if compression_clock else 0.0
    if phase_clock is not None:
        phase_clock.reset()
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # pages the kernel mapped in on first touch
    start, start_cpu = time.perf_counter(), time.process_time()
    with prefill_scope():
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{name: cache})
    token = out.logits[:, -1].argmax(-1)  # (1,)
    tokens = [int(token)]  # int() waits for the device
    ttft, ttft_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    prefill_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    compression = {"compression_cpu_seconds": compression_clock() - compressed_before} if compression_clock else {}
    phases = {"prefill_phases": phase_clock.snapshot()} if phase_clock is not None else {}
    cache = getattr(out, name)  # criticalkv swaps in its own cache at the prefill
    kv_bytes, kv_entries = held_kv(cache)
    steps, steps_cpu = [], []
    for i in range(decode_steps):
        tick, tick_cpu = time.perf_counter(), time.process_time()
        position = torch.tensor([[t + i]], device=device)
        out = model(input_ids=token[:, None], position_ids=position, use_cache=True, **{name: cache})
        token = out.logits[:, -1].argmax(-1)
        tokens.append(int(token))
        _sync(device)
        steps.append(time.perf_counter() - tick)
        steps_cpu.append(time.process_time() - tick_cpu)
    return {
        "prompt_tokens": t,
        "ttft_seconds": ttft,
        "ttft_cpu_seconds": ttft_cpu,
        "prefill_minor_faults": prefill_faults,
        "decode_seconds": steps,
        "decode_cpu_seconds": steps_cpu,
        "decode_ms_per_token_median": 1000 * statistics.median(steps) if steps else float("nan"),
        "decode_cpu_ms_per_token_median": 1000 * statistics.median(steps_cpu) if steps_cpu else float("nan"),
        "kv_bytes": kv_bytes,
        "kv_entries": kv_entries,
        **peak_memory_above(device, start_memory),
        **compression,
        **phases,
        "generated": tokens,
    }
