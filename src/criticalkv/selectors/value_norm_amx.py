"""The projected value norm on a CPU with AMX in one fused kernel (``value_norm_amx.c``): mean_g ||V_i W_O^g||_1.

torch has no CPU operator that sums a product's absolute values inside the product: ``value_norm``'s chunked products
write every (t, G * hidden) result out and read it back twice (absolute value, sum), about as long as the product
itself. The C kernel multiplies 16 rows of o_proj's weight (16 output features of W_O^g) by 16 tokens' values in AMX
tiles (bfloat16 products accumulated in float32) and adds the tile's absolute values to AVX-512 registers while it is
still in L1, so only the (t,) norms reach memory. bfloat16 times bfloat16 is exact in float32, so the norms are the
float32 reference's up to the order of the sums, as on a GPU (``value_norm_triton``).

It is compiled on first use with the system's C compiler (``$CC``, else ``cc``) into criticalkv's cache folder, once
per source and compiler, and loaded once per process (``availability``). ``amx_kernel()`` is None, and
``why_no_amx_kernel()`` says why, where the CPU has no AMX, the platform is not Linux (the kernel asks Linux for the
tile state), no compiler builds it (a warning then), or ``$CRITICALKV_AMX=0``: the norms then come from torch's
products (the same norms, more slowly).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from filelock import FileLock

from criticalkv.core.device import cpu_has_amx, cpu_has_avx512_bf16
from criticalkv.core.paths import cache_root

SOURCE = Path(__file__).with_suffix(".c")
#: Environment variable that turns the kernel off ("0"): the norms then come from torch's products.
SWITCH_ENV_VAR = "CRITICALKV_AMX"
#: head_dim values the kernel handles (two or four AMX tiles of 32 bfloat16 values a token).
HEAD_DIMS = (64, 128)
_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw"]


class Availability(NamedTuple):
    """The kernel (``amx_value_norms`` bound to its library), or None and why."""

    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    reason: str | None


def describe() -> str:
    """Where this CPU's float32 value norms of bfloat16 values come from, in words (for benchmark records)."""
    features = (
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"amx_tile {'yes' if cpu_has_amx() else 'no'}, avx512_bf16 {'yes' if cpu_has_avx512_bf16() else 'no'}"
    )
    if amx_kernel() is not None:
        return f"the AMX kernel (value_norm_amx.c); {features}"
    return f"torch's products, no AMX kernel: {why_no_amx_kernel()}; {features}"


def amx_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``amx_value_norms`` where this CPU and a C compiler can run the kernel, else None (``why_no_amx_kernel``)."""
    return availability().kernel


def why_no_amx_kernel() -> str | None:
    """Why ``amx_kernel()`` is None (None when the kernel is there)."""
    return availability().reason


@functools.cache
def availability() -> Availability:
    """Builds and loads the kernel once per process. A CPU with AMX that cannot have it (no compiler, a failed
    build) gets a warning: its value norms then take about ten times as long."""
    reason = _not_applicable()
    if reason is not None:
        return Availability(None, reason)
    reason = _unbuildable()
    if reason is None:
        try:
            library = _load(_compiled())
        except subprocess.CalledProcessError as error:
            reason = f"the AMX value-norm kernel did not build: {error}; {(error.stderr or '').strip()[-500:]}"
        except OSError as error:
            reason = f"the AMX value-norm kernel did not build or load: {error}"
        else:
            if library.ckv_amx_init() != 0:
                reason = "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
            else:
                return Availability(functools.partial(amx_value_norms, library), None)
    warnings.warn(
        f"{reason}. CriticalKV's value norms come from torch's products on this AMX CPU instead (the same norms, "
        f"about ten times slower; ${SWITCH_ENV_VAR}=0 says so without this warning)",
        stacklevel=3,
    )
    return Availability(None, reason)


def handles(values: torch.Tensor, o_proj_weight: torch.Tensor) -> bool:
    """Whether the kernel computes these norms: bfloat16 values and weight on the CPU, a head_dim of ``HEAD_DIMS``
    and a hidden size that is a multiple of 16, on a CPU where ``amx_kernel()`` runs."""
    return (
        values.device.type == "cpu"
        and values.dtype == torch.bfloat16
        and o_proj_weight.dtype == torch.bfloat16
        and values.shape[-1] in HEAD_DIMS
        and o_proj_weight.shape[0] % 16 == 0
        and amx_kernel() is not None
    )


def amx_value_norms(library: ctypes.CDLL, values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """||V_i W_O^g||_1 per query head g of each KV head's group: (b, h_kv, t, G) float32.

    values (b, h_kv, t, d) bfloat16; o_proj_weight (hidden, h_q * d) bfloat16 (``handles``)."""
    b, h_kv, t, d = values.shape
    hidden, in_features = o_proj_weight.shape
    groups = in_features // (h_kv * d)
    values = values.contiguous()
    weight = o_proj_weight.detach().contiguous()
    scratch = torch.empty_like(weight)  # the weight's tiles, laid out contiguously by the kernel
    out = torch.empty(b, h_kv, t, groups, dtype=torch.float32)
    status = library.ckv_value_norms(
        _pointer(values),
        _pointer(weight),
        _pointer(scratch),
        _pointer(out),
        b * h_kv,
        h_kv,
        t,
        d,
        groups,
        hidden,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"the AMX value-norm kernel takes head_dim {HEAD_DIMS}, not {d}")
    return out


def _not_applicable() -> str | None:
    """Why the kernel is not for this machine or was switched off, or None."""
    if os.environ.get(SWITCH_ENV_VAR, "1") == "0":
        return f"${SWITCH_ENV_VAR}=0"
    if not sys.platform.startswith("linux"):
        return "the AMX kernel asks Linux for the tile state; this is " + sys.platform
    if not cpu_has_amx():
        return "this CPU has no AMX tiles (or torch cannot tell)"
    return None


def _unbuildable() -> str | None:
    """Why the kernel cannot be built here before trying, or None."""
    if shutil.which(_compiler()) is None:
        return f"no C compiler ({_compiler()}; set $CC) to build the AMX value-norm kernel"
    return None


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _compiled() -> Path:
    """The shared library built from ``SOURCE`` by this compiler, built once under a file lock."""
    compiler = shutil.which(_compiler())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    stamp = hashlib.sha256("\0".join([SOURCE.read_text(), version, *_FLAGS]).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"value_norm_amx-{stamp}.so"
    with FileLock(str(target) + ".lock"):
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                built = Path(scratch) / target.name
                subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, check=True)
                os.replace(built, target)
    return target


def _load(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    library.ckv_amx_init.restype = ctypes.c_int
    library.ckv_amx_init.argtypes = []
    library.ckv_value_norms.restype = ctypes.c_int
    library.ckv_value_norms.argtypes = [pointer, pointer, pointer, pointer, i64, i64, i64, i64, i64, i64, ctypes.c_int]
    return library


def _pointer(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())
