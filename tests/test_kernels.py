"""The fused Triton kernels (models/kernels.py) against their torch paths, on the CPU.

Triton's interpreter (TRITON_INTERPRET=1) runs the same kernel code with numpy; it must be set
before the kernels are defined, hence a subprocess. In float32 the kernels must agree with torch
to rounding; in bfloat16 the interpreter converts float32 to bfloat16 by truncation where the GPU
rounds to nearest, so there the bound is only a sanity check (the GPU test in test_cuda_graphs.py
holds the kernels to the load-time bound).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is a test dependency on x86-64 Linux (pyproject.toml)")

ROOT = Path(__file__).resolve().parents[1]
K_NAMES = ("rotary", "rotary_tables", "act", "add_norm", "add_norm_taps", "normalize", "gelu_epilogue", "fp8_rows",
           "add_norm_fp8", "act_fp8")

SCRIPT = r"""
import json, torch
import triton.language as tl
from triton.language.extra import libdevice
from torch import nn
# The interpreter runs no libdevice: numpy's float32 sin and cos (through tl's) stand in for CUDA's
libdevice.sin, libdevice.cos = (lambda x: tl.math.sin(x)), (lambda x: tl.math.cos(x))
from models import kernels as K

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

results = {}
for dtype in (torch.float32, torch.bfloat16):
    name = str(dtype).split(".")[-1]
    gen = torch.Generator().manual_seed(1)
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    worst = {}
    for rows, heads, dim in [(5, 16, 80), (3, 16, 72), (1, 4, 16), (0, 16, 80)]:
        qkv = randn(rows, 3, heads, dim)
        cos = torch.rand(rows, dim, generator=gen)[:, None, None]
        sin = torch.rand(rows, dim, generator=gen)[:, None, None]
        fast, ref = K.rotary_triton(qkv[:, :2], cos, sin), K.rotary_torch(qkv[:, :2], cos, sin)
        assert fast.shape == ref.shape
        if rows:
            worst["rotary"] = max(worst.get("rotary", 0), rel(fast, ref))
    for rows, heads, kv, dim in [(5, 16, 4, 80), (3, 8, 8, 72)]:
        # models.layers.Attention's view: q and k heads of one projection row, then v (grouped or not)
        packed = randn(rows, heads + 2 * kv, dim)
        qk = packed[:, : heads + kv].unsqueeze(1)
        assert qk.stride(1) == (heads + kv) * dim  # what apply_rotary asks before taking the kernel
        cos = torch.rand(rows, dim, generator=gen)[:, None, None]
        sin = torch.rand(rows, dim, generator=gen)[:, None, None]
        worst["rotary"] = max(worst["rotary"], rel(K.rotary_triton(qk, cos, sin), K.rotary_torch(qk, cos, sin)))
    for rows, width in [(4, 5120), (3, 1000), (2, 1), (0, 64)]:
        h = randn(rows, 2 * width) * 3
        for act in K.ACT_CODES:
            for gated in (None, width):
                fast, ref = K.act_triton(h, act, gated), K.act_torch(h, act, gated)
                assert fast.shape == ref.shape
                if rows:
                    worst["act"] = max(worst.get("act", 0), rel(fast, ref))
    for rows, dim in [(4, 1280), (3, 1152), (2, 100), (0, 1280)]:
        ln = nn.LayerNorm(dim, eps=1e-6).to(dtype)
        with torch.no_grad():
            ln.weight.copy_(torch.randn(dim, generator=gen))
            ln.bias.copy_(torch.randn(dim, generator=gen))
        rms = K._RmsProbe(randn(dim))
        x, d = randn(rows, dim) * 4 + 1, randn(rows, dim)
        for norm in (ln, rms):
            for delta in (d, None):
                (s1, n1), (s2, n2) = K.add_norm_triton(x, delta, norm), K.add_norm_torch(x, delta, norm)
                assert s1.shape == s2.shape and n1.shape == n2.shape
                if rows:
                    worst["add_norm"] = max(worst.get("add_norm", 0), rel(s1, s2), rel(n1, n2))
    for rows, cols, width in [(6, 1000, 1008), (3, 1280, 1280), (2, 3420, 3424), (0, 64, 64)]:
        x = randn(rows, cols) * 3
        if rows:
            x[1] = 0  # the smallest scale, not a division by zero
        (v, sc), (v_ref, sc_ref) = K.fp8_rows_triton(x, width), K.fp8_rows_torch(x, width)
        assert v.shape == v_ref.shape == (rows, width) and v.dtype == K.FP8 and sc.shape == (rows, 1)
        if rows:
            assert torch.equal(sc, sc_ref) and not v[:, cols:].float().any()
            worst["fp8_scale"] = max(worst.get("fp8_scale", 0), rel(sc, sc_ref))
            worst["fp8_rows"] = max(worst.get("fp8_rows", 0), rel(v[:, :cols].float() * sc, x))
    # the norm and the activation writing e4m3 rows: the bytes of the two kernels they fuse, to the bit
    def differ(q, values, scale):
        return max((q.values.view(torch.uint8) != values.view(torch.uint8)).float().mean().item(), rel(q.scale, scale))
    for rows, dim, width in [(4, 1280, 1280), (3, 1000, 1008), (0, 64, 64)]:
        x, d = randn(rows, dim) * 4 + 1, randn(rows, dim)
        for norm in (nn.LayerNorm(dim, eps=1e-6).to(dtype), K._RmsProbe(randn(dim))):
            for delta in (d, None):
                (s1, q), (s2, normed) = K.add_norm_fp8_triton(x, delta, norm, width), K.add_norm_triton(x, delta, norm)
                assert q.shape == (rows, dim) and q.values.shape == (rows, width) and q.dtype == dtype
                if rows:
                    worst["add_norm_fp8"] = max(worst.get("add_norm_fp8", 0), rel(s1, s2),
                                                differ(q, *K.fp8_rows_triton(normed, width)))
    for rows, cols, width in [(4, 3456, 3456), (3, 1000, 1008), (0, 64, 64)]:
        h = randn(rows, 2 * cols) * 3
        for act in K.ACT_CODES:
            for gated in (None, cols):
                w = width if gated else 2 * cols
                q = K.act_fp8_triton(h, act, gated, w)
                assert q.values.shape == (rows, w)
                if rows:
                    worst["act_fp8"] = max(worst.get("act_fp8", 0),
                                           differ(q, *K.fp8_rows_triton(K.act_triton(h, act, gated), w)))
    # the rotary tables of both column orders (axis-major, Kimi's frequency-major), three axes too
    for rows, axes, band in [(7, 2, 18), (5, 2, 20), (3, 3, 10), (0, 2, 16)]:
        pos = torch.randint(0, 900, (rows, axes), generator=gen)
        freq = 1.0 / (10000 ** (torch.arange(band, dtype=torch.float) / band))
        for axis, f in ((torch.arange(axes * band) // band, freq.repeat(axes)),
                        (torch.arange(axes * band) % axes, freq.repeat_interleave(axes))):
            fast, ref = K.rotary_tables_triton(pos, axis, f), K.rotary_tables_torch(pos, axis, f)
            assert all(a.shape == b.shape == (rows, 1, 1, 2 * axes * band) for a, b in zip(fast, ref))
            if rows:
                worst["rotary_tables"] = max(worst.get("rotary_tables", 0), *(rel(a, b) for a, b in zip(fast, ref)))
    for rows, cols in [(5, 1536), (3, 1176), (2, 3), (0, 588)]:
        pixels = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
        mean, std = torch.rand(cols, generator=gen), torch.rand(cols, generator=gen) + 0.1
        fast, ref = K.normalize_triton(pixels, mean, std, 1 / 255), K.normalize_torch(pixels, mean, std, 1 / 255)
        assert fast.shape == ref.shape and fast.dtype == torch.float32
        if rows:
            worst["normalize"] = max(worst.get("normalize", 0), rel(fast, ref))
    for rows, dim, taps in [(6, 1152, 4), (3, 100, 4), (2, 64, 16), (0, 64, 4)]:
        x, table = randn(rows, dim), randn(50, dim)
        t = K.Taps(table, torch.randint(0, 50, (rows, taps), generator=gen), torch.rand(rows, taps, generator=gen))
        for norm in (nn.LayerNorm(dim, eps=1e-6).to(dtype), K._RmsProbe(randn(dim))):
            (s1, n1), (s2, n2) = K.add_norm_triton(x, t, norm), K.add_norm_torch(x, t, norm)
            assert s1.shape == s2.shape == n1.shape == (rows, dim)
            if rows:
                worst["add_norm_taps"] = max(worst.get("add_norm_taps", 0), rel(s1, s2), rel(n1, n2))
    results[name] = worst
results["check_kernels"] = K.check_kernels(torch.device("cpu"), torch.float32)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["rotary", "rotary_tables", "act", "add_norm", "add_norm_taps", "normalize"])
def test_kernels_match_torch_in_float32(interpreted: dict, kernel: str) -> None:
    assert interpreted["float32"][kernel] < 1e-6


@pytest.mark.parametrize("kernel", ["rotary", "rotary_tables", "act", "add_norm", "add_norm_taps", "normalize"])
def test_kernels_close_to_torch_in_bfloat16(interpreted: dict, kernel: str) -> None:
    assert interpreted["bfloat16"][kernel] < 2e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_rows_scales_exact_values_within_e4m3(interpreted: dict, dtype: str) -> None:
    """The scales are the torch path's to the bit; the interpreter's e4m3 cast is not the GPU's rounding (the
    GPU's load-time check asks for the same bytes), so the values are held to e4m3's own precision: a 3-bit
    mantissa, at most 1/16 of a value off when rounded, 1/8 when truncated."""
    assert interpreted[dtype]["fp8_scale"] == 0
    assert interpreted[dtype]["fp8_rows"] < 0.07


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["add_norm_fp8", "act_fp8"])
def test_fused_fp8_outputs_are_the_bytes_of_the_kernels_they_fuse(interpreted: dict, dtype: str, kernel: str) -> None:
    """A norm or activation writing e4m3 rows gives the bytes and scales its own kernel then `fp8_rows` give."""
    assert interpreted[dtype][kernel] == 0


def test_load_time_check_covers_every_triton_kernel(interpreted: dict) -> None:
    errors = interpreted["check_kernels"]
    # gelu_epilogue is cuBLASLt: GPU only
    assert set(errors) == set(K_NAMES) - {"gelu_epilogue"}
    assert errors["add_norm_fp8"] == errors["act_fp8"] == 0
    assert max(errors[k] for k in ("rotary", "rotary_tables", "act", "add_norm", "add_norm_taps", "normalize")) < 1e-6
    assert errors["fp8_rows"] < 0.05  # the share of bytes that differ (see above)


def test_torch_path_on_cpu_tensors() -> None:
    """Without CUDA tensors no fused kernel is used, whatever is enabled."""
    import torch

    from models import kernels

    kernels.set_enabled(set(kernels.KERNELS))
    try:
        x = torch.randn(3, 8)
        norm = torch.nn.LayerNorm(8)
        s, n = kernels.add_norm(x, x, norm)
        assert torch.equal(s, x + x) and torch.allclose(n, norm(x + x))
        assert torch.equal(kernels.activate(x, "quick_gelu"), x * torch.sigmoid(1.702 * x))
    finally:
        kernels.set_enabled(None)
