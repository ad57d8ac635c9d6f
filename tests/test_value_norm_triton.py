"""The Triton value-norm kernel against the float32 reference (``projected_value_norm``'s chunked products): on the
CPU through Triton's interpreter (small shapes: it runs every program in Python), on a GPU where there is one.

The interpreter must be on before triton is first imported (triton's own library functions are made for it then),
so its test runs the cases in a fresh process. It multiplies bfloat16 tiles as their raw bits
(triton-lang/triton#11584, "not supported yet"), so bfloat16 runs on a GPU only; float16 takes the same tensor-core
branch of the kernel and float32 the IEEE one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from criticalkv.selectors.value_norm import projected_value_norm

triton = pytest.importorskip("triton")

# (b, h_kv, G, t, d, hidden): tiles cut short in every direction (t and hidden not multiples of 64, d not a power of
# two), one token, and MHA (G = 1)
SHAPES = [(2, 2, 3, 70, 24, 70), (1, 1, 1, 1, 16, 20), (1, 2, 2, 9, 64, 33)]


def _case(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu", weight_dtype: torch.dtype | None = None):
    b, h_kv, g, t, d, hidden = shape
    gen = torch.Generator().manual_seed(sum(shape))
    # a view of a (b, t, h_kv, d) projection, as the attention layers hand the values over: not contiguous
    values = torch.randn(b, t, h_kv, d, generator=gen).to(dtype).transpose(1, 2)
    weight = (torch.randn(hidden, h_kv * g * d, generator=gen) * 0.1).to(weight_dtype or dtype)
    return values.to(device), weight.to(device)


def check_interpreted() -> None:
    """Every CPU case under every tuning config through the interpreter (run by the test below in a process with
    ``TRITON_INTERPRET=1``; the interpreter times nothing, so the tuner itself runs on a GPU only)."""
    from criticalkv.selectors.value_norm_triton import CONFIGS, fused_projected_value_norm

    cases = [(shape, dtype, None) for shape in SHAPES for dtype in (torch.float32, torch.float16)]
    for shape, dtype, weight_dtype in [*cases, (SHAPES[2], torch.float16, torch.float32)]:
        values, weight = _case(shape, dtype, weight_dtype=weight_dtype)
        expected = projected_value_norm(values, weight)
        for config in CONFIGS:
            got = fused_projected_value_norm(values, weight, config)
            assert got.dtype == torch.float32 and got.shape == values.shape[:3]
            torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6, msg=lambda m, c=config: f"{c}: {m}")
    values, weight = _case(SHAPES[2], torch.float32)
    assert fused_projected_value_norm(values[:, :, :0], weight, CONFIGS[0]).shape == (1, 2, 0)
    try:
        fused_projected_value_norm(values, weight[:, :-1], CONFIGS[0])
    except ValueError as error:
        assert "not a multiple" in str(error)
    else:
        raise AssertionError("a weight whose inputs are not h_kv x d x G was accepted")
    print("interpreted cases agree")


@pytest.mark.skipif(
    Version(triton.__version__) < Version("3.9"),
    reason="Triton before 3.9 interprets a loop bound that is a product of scalar arguments as an array and fails "
    "(seen with 3.6; the compiled kernel is fine); the dev extra asks for triton >= 3.9",
)
def test_interpreted_kernel_matches_float32_reference():
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-c", "import test_value_norm_triton as t; t.check_interpreted()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "interpreted cases agree" in run.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [*SHAPES, (2, 8, 4, 3000, 128, 4096)])
def test_cuda_kernel_matches_float32_reference(shape, dtype):
    from triton.runtime.errors import OutOfResources

    from criticalkv.selectors.value_norm_triton import CONFIGS, fused_projected_value_norm

    values, weight = _case(shape, dtype, "cuda")
    expected = projected_value_norm(values.cpu(), weight.cpu())

    ran = 0
    for config in [None, *CONFIGS]:  # the tuned choice, then each config
        try:
            got = fused_projected_value_norm(values, weight, config).cpu()
        except OutOfResources:  # a config this GPU cannot hold (float32 tiles): the tuner skips it the same way
            assert config is not None and dtype == torch.float32
            continue
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, c=config: f"{c}: {m}")
        ran += 1
    assert ran >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [SHAPES[0], (2, 2, 7, 700, 64, 896)])
def test_cuda_chunked_products_match_the_cpu(shape):
    """Where the kernel does not run (the values' dtype, or per-head norms), a GPU takes one product for every row and
    KV head per query head, a CPU one per row and KV head: the same norms."""
    values, weight = _case(shape, torch.bfloat16, "cuda")
    for kwargs, tolerance in (({"compute_dtype": None}, 1e-2), ({"per_head": True}, 1e-5)):
        got = projected_value_norm(values, weight, **kwargs).cpu()
        expected = projected_value_norm(values.cpu(), weight.cpu(), **kwargs)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
