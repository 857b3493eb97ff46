"""Fused GPU kernels for the towers' memory-bound steps, with torch fallbacks.

In plain torch, the steps between the matrix products are separate passes over the hidden states:
the rotary embedding (three float32 passes over q and k), QuickGELU (three), SwiGLU (two, on
strided halves), each residual add followed by its norm (two), RMSNorm and its scale (two). Each
Triton kernel here does one such step in a single pass, in float32, rounding where the reference
rounds. tanh-GELU goes into the matrix product's epilogue instead (cuBLASLt).

Every kernel is used only when it compiles and agrees with its torch path on this machine (checked
once at load; see `enable_triton`), and only on CUDA tensors. Elsewhere the torch path runs, which
is what CI and the CPU backend use; the Triton kernels also run in CI under the Triton interpreter
(tests/test_kernels.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("vitserve.models")

KERNELS = ("rotary", "rotary_tables", "act", "add_norm", "add_norm_taps", "normalize", "gelu_epilogue", "fp8_rows",
           "add_norm_fp8", "act_fp8")
FP8_KERNELS = ("fp8_rows", "add_norm_fp8", "act_fp8")  # checked only where e4m3 exists
_enabled: set[str] = set()

# Activation codes shared by the Triton kernel and the torch fallbacks.
ACT_CODES = {"quick_gelu": 0, "silu": 1, "gelu_pytorch_tanh": 2}

try:  # Triton ships with CUDA builds of torch; CPU builds and odd machines may lack it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # the precise sin and cos torch's CUDA kernels use

    @triton.jit
    def _rotary_pairs(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, x_row_stride, PAIRS: tl.constexpr,
                      HALF: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """y = x * cos + roll(x, HALF) * sin over each head of D values, taken as its HALF pairs (j, j + HALF):
        a tile is ROWS rows by BLOCK pairs of a row's PAIRS, so no lane idles on a head dim that is not a power
        of two (72, 80) and the cos and sin rows are read once for many heads."""
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        pair = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        head = pair // HALF
        j = pair - head * HALF
        lo = head * D + j  # the pair's first value in the row; its second is HALF on
        mask = (rows < n_rows) & (pair < PAIRS)
        src = x_ptr + rows * x_row_stride + lo
        a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        table = rows * D + j
        cos_a = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin_a = tl.load(sin_ptr + table, mask=mask, other=0.0)
        cos_b = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0)
        sin_b = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0)
        dst = out_ptr + rows * (2 * PAIRS) + lo
        tl.store(dst, (a * cos_a + b * sin_a).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (b * cos_b + a * sin_b).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _activated(src, cols, mask, up_offset, ACT: tl.constexpr, GATED: tl.constexpr):
        """act(x[cols]) (* x[up_offset + cols] when GATED) of one row at `src`, in float32."""
        x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            y = x * tl.sigmoid(1.702 * x)
        elif ACT == 1:
            y = x * tl.sigmoid(x)
        else:
            inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))  # tanh(z) = 2 sigmoid(2z) - 1
        if GATED:
            y = y * tl.load(src + up_offset + cols, mask=mask, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _act_rows(x_ptr, out_ptr, n_cols, x_row_stride, up_offset,
                  ACT: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr):
        """out[r, c] = act(x[r, c]) (* x[r, up_offset + c] when GATED), float32 math, one rounding."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _activated(x_ptr + row * x_row_stride, cols, mask, up_offset, ACT, GATED)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_store(y, cols, out_ptr, scale_ptr, row, width, INV_FP8_MAX: tl.constexpr):
        """Row y (float32, zero past its columns) as e4m3 over its own scale: `_fp8_rows`' arithmetic."""
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) * INV_FP8_MAX, 1e-12)
        q = y * tl.math.div_rn(1.0, scale)
        tl.store(out_ptr + row * width + cols, q.to(out_ptr.dtype.element_ty), mask=cols < width)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _add_norm_rows(x_ptr, d_ptr, w_ptr, b_ptr, sum_ptr, out_ptr, scale_ptr, table_ptr, tap_ptr, tap_w_ptr,
                       n_cols, width, eps, HAS_DELTA: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       RMS: tl.constexpr, FP8_OUT: tl.constexpr, INV_FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        """sum = x + d (rounded to the stream's dtype, as the reference's add is), out = norm(sum); with
        FP8_OUT, out is norm(sum) rounded to the stream's dtype and then quantized (e4m3 [rows, width], scale
        per row), the bytes `fp8_rows` would make of the rounded row. With TAPS, d is not read but made:
        the weighted sum of TAPS table rows (`Taps`), in float32, rounded to the stream's dtype."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            if TAPS > 0:
                d = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(TAPS):
                    at = tl.load(tap_ptr + row * TAPS + j).to(tl.int64)
                    part = tl.load(table_ptr + at * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                    d += part * tl.load(tap_w_ptr + row * TAPS + j)
                d = d.to(sum_ptr.dtype.element_ty).to(tl.float32)
            else:
                d = tl.load(d_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + d).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * n_cols + cols, s, mask=mask)
            x = s.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if RMS:
            # The reference rounds the normalised row to the input dtype before the scale.
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
            y = (x * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32) * w
        else:
            mean = tl.sum(x, axis=0) / n_cols
            xc = tl.where(mask, x - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
            y = xc * rstd * w
            if HAS_BIAS:
                y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if FP8_OUT:
            rounded = tl.where(mask, y.to(sum_ptr.dtype.element_ty).to(tl.float32), 0.0)
            _fp8_store(rounded, cols, out_ptr, scale_ptr, row, width, INV_FP8_MAX)
        else:
            tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_fp8_rows(x_ptr, out_ptr, scale_ptr, n_cols, width, x_row_stride, up_offset, ACT: tl.constexpr,
                      GATED: tl.constexpr, INV_FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        """`_act_rows`' row rounded to the input's dtype and quantized as `_fp8_rows` would (one pass)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _activated(x_ptr + row * x_row_stride, cols, mask, up_offset, ACT, GATED)
        rounded = tl.where(mask, y.to(x_ptr.dtype.element_ty).to(tl.float32), 0.0)
        _fp8_store(rounded, cols, out_ptr, scale_ptr, row, width, INV_FP8_MAX)

    @triton.jit
    def _fp8_rows(x_ptr, out_ptr, scale_ptr, n_cols, width, x_row_stride, INV_FP8_MAX: tl.constexpr,
                  BLOCK: tl.constexpr):
        """out[r] = e4m3(x[r] * (1 / s[r])) with s[r] = max|x[r]| * (1 / 448) (zero columns from n_cols to
        width): the torch path's float32 arithmetic (an IEEE reciprocal, one rounding to e4m3) in one pass."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) * INV_FP8_MAX, 1e-12)
        y = x * tl.math.div_rn(1.0, scale)
        tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=cols < width)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _normalize_rows(x_ptr, mean_ptr, std_ptr, out_ptr, n_cols, rescale, BLOCK: tl.constexpr):
        """out = (float(x) * rescale - mean) / std per column: `Normalize`'s three float32 steps, each
        rounded as torch rounds it (an IEEE division), in one pass over the uint8 rows."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0).to(tl.float32)
        mean = tl.load(mean_ptr + cols, mask=mask, other=0.0)
        std = tl.load(std_ptr + cols, mask=mask, other=1.0)
        scaled = x * rescale
        y = tl.math.div_rn(scaled - mean, std)
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)

    @triton.jit
    def _rotary_tables(pos_ptr, axis_ptr, freq_ptr, cos_ptr, sin_ptr, n_axes, D: tl.constexpr,
                       HALF: tl.constexpr, BLOCK: tl.constexpr):
        """cos and signed sin [rows, D] of angle = pos[row, axis[c]] * freq[c] for c = d mod HALF (the
        angles repeated for rotate_half, the first half of sin negated): `Rotary2D`'s table in one pass."""
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK)
        mask = d < D
        c = d % HALF
        axis = tl.load(axis_ptr + c, mask=mask, other=0)
        angle = tl.load(pos_ptr + row * n_axes + axis, mask=mask, other=0).to(tl.float32) \
            * tl.load(freq_ptr + c, mask=mask, other=0.0)
        tl.store(cos_ptr + row * D + d, libdevice.cos(angle), mask=mask)
        sin = libdevice.sin(angle)
        tl.store(sin_ptr + row * D + d, tl.where(d < HALF, -sin, sin), mask=mask)

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001 - any import problem just means the torch path
    _HAVE_TRITON = False


def _use(name: str, *tensors: torch.Tensor) -> bool:
    return name in _enabled and all(t.is_cuda for t in tensors)


# ---- rotary ---------------------------------------------------------------------------------------


def rotary_torch(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk: [P, 2, H, D]; cos, signed sin: [P, 1, 1, D] float32. rotate_half(x) = roll(x, D/2) * sign."""
    out = torch.empty_like(qk)
    return torch.addcmul(qk * cos, qk.roll(qk.shape[-1] // 2, dims=-1), sin, out=out)


# A rotary tile, rows by pairs: the fastest of 2-16 rows, 128-512 pairs, 4 or 8 warps at 784, 6272 and 41472
# rows of Qwen3-VL-8B (3.4, 17.9 and 132 us against 3.8, 23.7 and 136 for a row a program; H200).
ROTARY_ROWS, ROTARY_BLOCK, ROTARY_WARPS = 2, 512, 8


def rotary_triton(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    n, two, heads, d = qk.shape
    out = torch.empty((n, two, heads, d), dtype=qk.dtype, device=qk.device)
    pairs = two * heads * (d // 2)
    if n:
        block = min(ROTARY_BLOCK, triton.next_power_of_2(pairs))
        _rotary_pairs[(triton.cdiv(n, ROTARY_ROWS), triton.cdiv(pairs, block))](
            qk, cos, sin, out, n, qk.stride(0), PAIRS=pairs, HALF=d // 2, D=d, ROWS=ROTARY_ROWS, BLOCK=block,
            num_warps=ROTARY_WARPS)
    return out


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotated = cos.shape[-1]
    if rotated < qk.shape[-1]:  # a partial rotary (models.rotary): the tail of each head passes through
        return torch.cat([apply_rotary(qk[..., :rotated], cos, sin), qk[..., rotated:]], dim=-1)
    if _use("rotary", qk) and qk.stride(-1) == 1 and qk.stride(2) == qk.shape[-1] \
            and qk.stride(1) == qk.shape[-1] * qk.shape[-2]:
        return rotary_triton(qk, cos, sin)
    return rotary_torch(qk, cos, sin)


def rotary_tables_torch(pos: torch.Tensor, axis: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [P, axes] integer; axis [H] (which coordinate), freq [H] float32 (its frequency) of each angle column
    -> cos, signed sin [P, 1, 1, 2H] float32: the angles repeated for rotate_half, whose sign is folded into
    sin (first half negated), so that applying the rotation is x*cos + roll(x)*sin."""
    angles = pos.float()[:, axis] * freq
    emb = torch.cat([angles, angles], dim=-1)
    sin = emb.sin()
    sin[:, : angles.shape[-1]].neg_()
    return emb.cos()[:, None, None], sin[:, None, None]


def rotary_tables_triton(pos: torch.Tensor, axis: torch.Tensor, freq: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, half = pos.shape[0], axis.shape[0]
    cos = torch.empty((rows, 1, 1, 2 * half), dtype=torch.float32, device=pos.device)
    sin = torch.empty_like(cos)
    if rows:
        _rotary_tables[(rows,)](pos, axis, freq, cos, sin, pos.shape[1], D=2 * half, HALF=half,
                                BLOCK=triton.next_power_of_2(2 * half))
    return cos, sin


def rotary_tables(pos: torch.Tensor, axis: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary embedding's cos and signed sin tables (see `rotary_tables_torch`)."""
    if _use("rotary_tables", pos) and pos.dim() == 2 and pos.is_contiguous():
        return rotary_tables_triton(pos, axis, freq)
    return rotary_tables_torch(pos, axis, freq)


# ---- pixel normalisation ----------------------------------------------------------------------------


def normalize_torch(pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, rescale: float) -> torch.Tensor:
    """uint8 rows -> (float(x) * rescale - mean) / std, float32 (the processor's last steps)."""
    return (pixels.float() * rescale - mean) / std


def normalize_triton(pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, rescale: float) -> torch.Tensor:
    rows, cols = pixels.shape
    out = torch.empty((rows, cols), dtype=torch.float32, device=pixels.device)
    if rows:
        block = 1024
        # no multiply-add contraction: torch rounds the product before the subtraction
        _normalize_rows[(rows, triton.cdiv(cols, block))](pixels, mean, std, out, cols, rescale, BLOCK=block,
                                                          enable_fp_fusion=False)
    return out


def normalize_pixels(pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, rescale: float) -> torch.Tensor:
    """uint8 patch rows -> normalised float32 rows (see `normalize_torch`)."""
    if _use("normalize", pixels) and pixels.dim() == 2 and pixels.is_contiguous() and mean.shape == std.shape \
            == pixels.shape[-1:]:
        return normalize_triton(pixels, mean, std, rescale)
    return normalize_torch(pixels, mean, std, rescale)


# ---- activations ----------------------------------------------------------------------------------


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def act_torch(h: torch.Tensor, act: str, gated_width: int | None = None) -> torch.Tensor:
    """act(h), or act(h[:, :w]) * h[:, w:2w] for a gated MLP whose gate and up share one GEMM."""
    if gated_width is None:
        return ACTIVATIONS[act](h)
    gate, up = h[:, :gated_width], h[:, gated_width : 2 * gated_width]
    return ACTIVATIONS[act](gate) * up


def act_triton(h: torch.Tensor, act: str, gated_width: int | None = None) -> torch.Tensor:
    rows = h.shape[0]
    width = h.shape[1] if gated_width is None else gated_width
    out = torch.empty((rows, width), dtype=h.dtype, device=h.device)
    if rows:
        block = 1024
        _act_rows[(rows, triton.cdiv(width, block))](
            h, out, width, h.stride(0), width, ACT=ACT_CODES[act], GATED=gated_width is not None, BLOCK=block
        )
    return out


def act_fp8_triton(h: torch.Tensor, act: str, gated_width: int | None, width: int) -> Fp8Rows:
    rows = h.shape[0]
    cols = h.shape[1] if gated_width is None else gated_width
    values = torch.empty((rows, width), dtype=FP8, device=h.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=h.device)
    if rows:
        _act_fp8_rows[(rows,)](h, values, scale, cols, width, h.stride(0), cols, ACT=ACT_CODES[act],
                               GATED=gated_width is not None, INV_FP8_MAX=INV_FP8_MAX,
                               BLOCK=triton.next_power_of_2(width))
    return Fp8Rows(values, scale, cols, h.dtype)


def activate(h: torch.Tensor, act: str, gated_width: int | None = None, fp8_width: int | None = None) -> Any:
    """The MLP's activation on a [rows, width] matrix product output (see `act_torch`); with `fp8_width` (the
    next product is FP8), as `Fp8Rows`, the same bytes `fp8_rows` makes of it."""
    triton_ok = act in ACT_CODES and h.dim() == 2 and h.stride(1) == 1
    if fp8_width is not None:
        width = h.shape[1] if gated_width is None else gated_width
        if triton_ok and _use("act_fp8", h) and fp8_width >= width:
            return act_fp8_triton(h, act, gated_width, fp8_width)
        return Fp8Rows.of(activate(h, act, gated_width), fp8_width)
    if triton_ok and _use("act", h):
        return act_triton(h, act, gated_width)
    return act_torch(h, act, gated_width)


def clamped_swiglu(h: torch.Tensor, act: str, gated_width: int, limit: float) -> torch.Tensor:
    """act(min(gate, limit)) * clamp(up, -limit, limit) with gate, up = h[:, :w], h[:, w:2w] (GLM-5's SwiGLU):
    clamping rounds nothing, so this is the reference's arithmetic in the input dtype."""
    gate = h[:, :gated_width].clamp(max=limit)
    up = h[:, gated_width : 2 * gated_width].clamp(-limit, limit)
    return ACTIVATIONS[act](gate) * up


def linear_act(x: torch.Tensor, linear: nn.Linear, act: str) -> torch.Tensor:
    """act(linear(x)); tanh-GELU runs in cuBLASLt's epilogue, where it costs no extra pass."""
    if act == "gelu_pytorch_tanh" and isinstance(linear, nn.Linear) and linear.bias is not None and x.dim() == 2 \
            and _use("gelu_epilogue", x):  # an FP8 product (models/quantization.py) has no GELU epilogue
        return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)
    return activate(linear(x), act)


# ---- residual add + norm ---------------------------------------------------------------------------


def _norm_params(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float, bool]:
    """(weight, bias, eps, is_rms) of an nn.LayerNorm or a module marked `rms = True` (RMSNorm)."""
    if getattr(norm, "rms", False):
        return norm.weight, None, float(norm.eps), True
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine:
        return norm.weight, norm.bias, float(norm.eps), False
    raise TypeError(f"no fused path for {type(norm).__name__}")


@dataclass
class Taps:
    """A residual delta not yet made: row r is sum_j weight[r, j] * table[index[r, j]] in float32, rounded to the
    stream's dtype (a position table resampled to each patch, models/positions.py). `add_norm` makes it inside
    its own pass where it can."""

    table: torch.Tensor  # [rows of the table, dim]
    index: torch.Tensor  # [rows, taps] integer
    weight: torch.Tensor  # [rows, taps] float32

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return weighted_rows(self.table, self.index, self.weight).to(dtype)


def weighted_rows(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_j weight[:, j] * table[index[:, j]], float32 [rows, dim]."""
    return (table[index] * weight[..., None]).sum(1)


def _taps_args(x: torch.Tensor, delta: torch.Tensor | Taps | None) -> tuple[torch.Tensor, ...]:
    """(delta, table, index, weight) for `_add_norm_rows`: unused ones point at x."""
    if isinstance(delta, Taps):
        return x, delta.table, delta.index, delta.weight
    return (x if delta is None else delta), x, x, x


def _taps_fit(x: torch.Tensor, taps: Taps) -> bool:
    """Whether the fused pass can make this delta for x: contiguous rows it can index, x's width and dtype."""
    table, index, weight = taps.table, taps.index, taps.weight
    return (_use("add_norm_taps", x, table) and table.dtype == x.dtype and table.shape[1] == x.shape[1]
            and index.dim() == 2 and index.shape == weight.shape and index.shape[0] == x.shape[0]
            and weight.dtype == torch.float32
            and all(t.is_contiguous() for t in (table, index, weight)))


def add_norm_torch(x: torch.Tensor, delta: torch.Tensor | Taps | None, norm: nn.Module
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(delta, Taps):
        delta = delta.dense(x.dtype)
    s = x if delta is None else x + delta
    weight, bias, eps, rms = _norm_params(norm)
    if rms:
        return s, weight * F.rms_norm(s, (s.shape[-1],), eps=eps)
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


def _launch_add_norm(x: torch.Tensor, delta: torch.Tensor | Taps | None, norm: nn.Module, s: torch.Tensor,
                     out: torch.Tensor, scale: torch.Tensor, fp8: bool) -> None:
    """One `_add_norm_rows` pass writing the sum into s and the normalised rows into out (e4m3 with their scales
    when fp8)."""
    weight, bias, eps, rms = _norm_params(norm)
    rows, cols = x.shape
    if not rows:
        return
    d, table, index, tap_w = _taps_args(x, delta)
    _add_norm_rows[(rows,)](
        x, d, weight, weight if bias is None else bias, s, out, scale, table, index, tap_w, cols, out.shape[1],
        eps, HAS_DELTA=delta is not None, TAPS=delta.index.shape[1] if isinstance(delta, Taps) else 0,
        HAS_BIAS=bias is not None, RMS=rms, FP8_OUT=fp8, INV_FP8_MAX=INV_FP8_MAX,
        BLOCK=triton.next_power_of_2(out.shape[1]),
    )


def add_norm_triton(x: torch.Tensor, delta: torch.Tensor | Taps | None, norm: nn.Module
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    _launch_add_norm(x, delta, norm, s, out, out, fp8=False)
    return s, out


def add_norm_fp8_triton(x: torch.Tensor, delta: torch.Tensor | Taps | None, norm: nn.Module, width: int
                        ) -> tuple[torch.Tensor, Fp8Rows]:
    rows, cols = x.shape
    s = x if delta is None else torch.empty_like(x)
    values = torch.empty((rows, width), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _launch_add_norm(x, delta, norm, s, values, scale, fp8=True)
    return s, Fp8Rows(values, scale, cols, x.dtype)


def add_norm(x: torch.Tensor, delta: torch.Tensor | Taps | None, norm: nn.Module, fp8_width: int | None = None
             ) -> tuple[torch.Tensor, Any]:
    """(s, norm(s)) with s = x + delta (or x): a residual add and the next norm in one pass (a `Taps` delta made
    in that pass too). With `fp8_width` (the next product is FP8 and reads nothing else), norm(s) comes as
    `Fp8Rows`, the same bytes."""
    if isinstance(delta, Taps) and not (x.dim() == 2 and _taps_fit(x, delta)):
        delta = delta.dense(x.dtype)
    fused = x.dim() == 2 and x.is_contiguous() and (delta is None or isinstance(delta, Taps) or (
        delta.is_contiguous() and delta.dtype == x.dtype))
    if fp8_width is not None:
        if fused and _use("add_norm_fp8", x) and fp8_width >= x.shape[1]:
            return add_norm_fp8_triton(x, delta, norm, fp8_width)
        s, normed = add_norm(x, delta, norm)
        return s, Fp8Rows.of(normed, fp8_width)
    if fused and _use("add_norm", x):
        return add_norm_triton(x, delta, norm)
    return add_norm_torch(x, delta, norm)


# ---- FP8 activations (models/quantization.py) -------------------------------------------------------

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 1 / FP8_MAX  # a multiplication, which torch's division by a scalar on CUDA is too


def fp8_rows_torch(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] -> e4m3 [rows, width] (zero columns past k) and float32 scales [rows, 1]: each row over its
    own largest magnitude, so a row's values do not depend on the other rows."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).float()
    scale = (amax * INV_FP8_MAX).clamp_min(1e-12)
    values = x * scale.reciprocal()  # float32: a value at most 448 by a rounding rounds to 448 (no clamp needed)
    if width != x.shape[1]:
        values = F.pad(values, (0, width - x.shape[1]))
    return values.to(FP8), scale


def fp8_rows_triton(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    values = torch.empty((rows, width), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _fp8_rows[(rows,)](x, values, scale, cols, width, x.stride(0), INV_FP8_MAX=INV_FP8_MAX,
                           BLOCK=triton.next_power_of_2(width))
    return values, scale


@dataclass
class Fp8Rows:
    """Activation rows already quantized for an FP8 product (models/quantization.py): e4m3 `values` [rows,
    width >= cols], float32 `scale` [rows, 1], the rows' own width `cols` and the dtype they stand for (the
    product's output dtype). A norm or activation whose only reader is an FP8 product writes these."""

    values: torch.Tensor
    scale: torch.Tensor
    cols: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.cols)

    @classmethod
    def of(cls, x: torch.Tensor, width: int) -> Fp8Rows:
        """x [rows, cols] quantized by `fp8_rows` (the unfused path)."""
        return cls(*fp8_rows(x, width), x.shape[-1], x.dtype)


def fp8_rows(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) e4m3 values of x, padded to `width` columns, and their scales (see `fp8_rows_torch`)."""
    if _use("fp8_rows", x) and x.dim() == 2 and x.stride(1) == 1:
        return fp8_rows_triton(x, width)
    return fp8_rows_torch(x, width)


def has_fp8(device: torch.device) -> bool:
    """FP8 tensor-core products (and Triton's e4m3 casts): compute capability 8.9 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# ---- enabling ---------------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Relative difference of each fused kernel to its torch path on seeded random inputs
    (infinity where the kernel fails to compile or run)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    def rotary() -> float:
        qkv = randn(37, 3, 16, 80)
        cos = torch.rand(37, 80, device=device, generator=gen)[:, None, None]
        sin = torch.rand(37, 80, device=device, generator=gen)[:, None, None]
        return _rel(rotary_triton(qkv[:, :2], cos, sin), rotary_torch(qkv[:, :2], cos, sin))

    def rotary_tables_() -> float:
        pos = torch.randint(0, 700, (37, 2), device=device, generator=gen)
        axis = torch.arange(18, device=device) // 9
        freq = torch.rand(18, device=device, generator=gen)
        return max(_rel(a, b) for a, b in zip(rotary_tables_triton(pos, axis, freq),
                                              rotary_tables_torch(pos, axis, freq)))

    def normalize_() -> float:
        pixels = torch.randint(0, 256, (37, 1176), dtype=torch.uint8, device=device, generator=gen)
        mean, std = torch.rand(1176, device=device, generator=gen), torch.rand(1176, device=device, generator=gen) + .2
        return _rel(normalize_triton(pixels, mean, std, 1 / 255), normalize_torch(pixels, mean, std, 1 / 255))

    def act() -> float:
        h = randn(37, 2 * 1088) * 3
        plain = max(_rel(act_triton(h, a), act_torch(h, a)) for a in ACT_CODES)
        return max(plain, _rel(act_triton(h, "silu", 1000), act_torch(h, "silu", 1000)))

    def add_norm_() -> float:
        x, d = randn(37, 1152), randn(37, 1152)
        ln = nn.LayerNorm(1152, eps=1e-6, device=device, dtype=dtype)
        with torch.no_grad():
            ln.weight.copy_(randn(1152))
            ln.bias.copy_(randn(1152))
        worst = 0.0
        for norm in (ln, _RmsProbe(randn(1152))):
            for delta in (d, None):
                (s1, n1), (s2, n2) = add_norm_triton(x, delta, norm), add_norm_torch(x, delta, norm)
                worst = max(worst, _rel(s1, s2), _rel(n1, n2))
        return worst

    def add_norm_taps() -> float:
        """A position table resampled into the first block's add and norm, in the stream's dtype and as e4m3."""
        x, table = randn(37, 1000), randn(64, 1000)
        taps = Taps(table, torch.randint(0, 64, (37, 4), device=device, generator=gen),
                    torch.rand(37, 4, device=device, generator=gen))
        ln = nn.LayerNorm(1000, eps=1e-6, device=device, dtype=dtype)
        (s1, n1), (s2, n2) = add_norm_triton(x, taps, ln), add_norm_torch(x, taps, ln)
        worst = max(_rel(s1, s2), _rel(n1, n2))
        if has_fp8(device):
            s3, q = add_norm_fp8_triton(x, taps, ln, 1008)
            worst = max(worst, _rel(s3, s1), same_fp8(q, *fp8_rows_triton(n1, 1008)))
        return worst

    def gelu_epilogue() -> float:
        x = randn(37, 1152)
        fc = nn.Linear(1152, 4304, device=device, dtype=dtype)
        with torch.no_grad():
            fused = torch._addmm_activation(fc.bias, x, fc.weight.t(), use_gelu=True)
            return _rel(fused, act_torch(fc(x), "gelu_pytorch_tanh"))

    def fp8_rows_() -> float:
        """Bytes that differ (the kernel repeats the torch path's arithmetic), and the scales' difference."""
        x = randn(37, 1000) * 3
        x[5] = 0  # a row of zeros takes the smallest scale
        (v1, s1), (v2, s2) = fp8_rows_triton(x, 1008), fp8_rows_torch(x, 1008)
        differ = (v1.view(torch.uint8) != v2.view(torch.uint8)).float().mean().item()
        if differ or not torch.equal(s1, s2):
            log.info("fp8_rows: %.2e of the bytes differ, scales %.2e apart", differ, _rel(s1, s2))
        return max(differ, _rel(s1, s2))

    def same_fp8(a: Fp8Rows, values: torch.Tensor, scale: torch.Tensor) -> float:
        differ = (a.values.view(torch.uint8) != values.view(torch.uint8)).float().mean().item()
        return max(differ, _rel(a.scale, scale))

    def add_norm_fp8() -> float:
        """Against the two kernels it fuses: the same sum, the same e4m3 bytes and scales."""
        x, d = randn(37, 1000), randn(37, 1000)
        ln = nn.LayerNorm(1000, eps=1e-6, device=device, dtype=dtype)
        worst = 0.0
        for norm in (ln, _RmsProbe(randn(1000))):
            for delta in (d, None):
                (s1, q), (s2, normed) = add_norm_fp8_triton(x, delta, norm, 1008), add_norm_triton(x, delta, norm)
                worst = max(worst, _rel(s1, s2), same_fp8(q, *fp8_rows_triton(normed, 1008)))
        return worst

    def act_fp8() -> float:
        h = randn(37, 2 * 1000) * 3
        return max(same_fp8(act_fp8_triton(h, a, g, w), *fp8_rows_triton(act_triton(h, a, g), w))
                   for a in ACT_CODES for g, w in ((None, 2000), (1000, 1008)))

    checks = {"rotary": rotary, "rotary_tables": rotary_tables_, "act": act, "add_norm": add_norm_,
              "add_norm_taps": add_norm_taps, "normalize": normalize_, "gelu_epilogue": gelu_epilogue,
              "fp8_rows": fp8_rows_, "add_norm_fp8": add_norm_fp8, "act_fp8": act_fp8}
    errors: dict[str, float] = {}
    for name, check in checks.items():
        if name == "gelu_epilogue" and device.type != "cuda":
            continue  # a cuBLASLt epilogue: nothing to check elsewhere
        if name in FP8_KERNELS and device.type == "cuda" and not has_fp8(device):
            continue  # no e4m3 here: nothing is quantized
        try:
            errors[name] = check()
        except Exception as exc:  # noqa: BLE001 - no compiler, no driver support: keep the torch path
            log.warning("fused kernel %s unavailable, using torch: %s", name, exc)
            errors[name] = float("inf")
    return errors


class _RmsProbe(nn.Module):
    rms = True

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight, requires_grad=False), 1e-6


def set_enabled(names: set[str] | None) -> None:
    """Force the set of fused kernels (None: none); for benchmarks that compare with the torch path."""
    _enabled.clear()
    _enabled.update(names or ())


def enable_triton(device: torch.device) -> bool:
    """Turn on each fused kernel that works here and matches its torch path; log which are used.
    True when all of them are on."""
    if device.type != "cuda" or not _HAVE_TRITON:
        return False
    errors = check_kernels(device)
    set_enabled({name for name, err in errors.items() if err < 1e-2})
    states = (f"{n} {'on' if n in _enabled else 'OFF'} ({e:.1e})" for n, e in errors.items())
    log.info("fused kernels (relative difference to torch): %s", ", ".join(states))
    return _enabled == set(errors)
