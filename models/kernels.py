"""Fused GPU kernels for the towers' memory-bound steps, with torch fallbacks.

Rotary embedding in plain torch costs three full passes over queries and keys in float32 (and
more on strided views); one Triton program per patch row reads q and k once, rotates in float32
as the reference does, and writes bf16. Used only when Triton compiles and agrees with the torch
path on this machine (checked once at load; see `enable_triton`).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("vitserve.models")
_TRITON_OK = False

try:  # Triton ships with CUDA builds of torch; CPU builds and odd machines may lack it
    import triton
    import triton.language as tl

    @triton.jit
    def _rotary_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, x_row_stride, HEADS: tl.constexpr,
                     HEADS_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, HALF: tl.constexpr):
        row = tl.program_id(0)
        h = tl.arange(0, HEADS_P2)[:, None]
        d = tl.arange(0, D_P2)[None, :]
        mask = (h < HEADS) & (d < D)
        base = x_ptr + row * x_row_stride + h * D
        x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        x_rolled = tl.load(base + (d + HALF) % D, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + row * D + d, mask=d < D, other=0.0)
        s = tl.load(sin_ptr + row * D + d, mask=d < D, other=0.0)
        y = x * c + x_rolled * s
        tl.store(out_ptr + row * (HEADS * D) + h * D + d, y.to(out_ptr.dtype.element_ty), mask=mask)

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001 - any import problem just means the torch path
    _HAVE_TRITON = False


def rotary_torch(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk: [P, 2, H, D]; cos, signed sin: [P, 1, 1, D] float32. rotate_half(x) = roll(x, D/2) * sign."""
    out = torch.empty_like(qk)
    return torch.addcmul(qk * cos, qk.roll(qk.shape[-1] // 2, dims=-1), sin, out=out)


def rotary_triton(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    n, two, heads, d = qk.shape
    out = torch.empty((n, two, heads, d), dtype=qk.dtype, device=qk.device)
    if n:
        _rotary_rows[(n,)](qk, cos, sin, out, qk.stride(0), HEADS=two * heads,
                           HEADS_P2=triton.next_power_of_2(two * heads), D=d,
                           D_P2=triton.next_power_of_2(d), HALF=d // 2)
    return out


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if _TRITON_OK and qk.is_cuda and qk.stride(-1) == 1 and qk.stride(2) == qk.shape[-1] \
            and qk.stride(1) == qk.shape[-1] * qk.shape[-2]:
        return rotary_triton(qk, cos, sin)
    return rotary_torch(qk, cos, sin)


def enable_triton(device: torch.device) -> bool:
    """Turn the Triton path on if it compiles here and matches the torch path; say which is used."""
    global _TRITON_OK
    if device.type != "cuda" or not _HAVE_TRITON:
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        qkv = torch.randn(37, 3, 16, 80, device=device, generator=gen).to(torch.bfloat16)
        cos = torch.rand(37, 80, device=device, generator=gen)[:, None, None]
        sin = torch.rand(37, 80, device=device, generator=gen)[:, None, None]
        fast, ref = rotary_triton(qkv[:, :2], cos, sin), rotary_torch(qkv[:, :2], cos, sin)
        err = ((fast.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        _TRITON_OK = err < 1e-2
        log.info("Triton rotary kernel %s (max rel diff to torch %.1e)", "on" if _TRITON_OK else "OFF", err)
    except Exception as exc:  # noqa: BLE001 - no compiler, no driver support: keep the torch path
        log.warning("Triton rotary kernel unavailable, using torch: %s", exc)
        _TRITON_OK = False
    return _TRITON_OK
