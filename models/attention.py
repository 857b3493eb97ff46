"""Attention over packed variable-length segments, and the choice of backend.

Every backend takes q, k, v as [tokens, heads, head_dim], the segment boundaries as an int32
device tensor `cu_seqlens` (padded with repeats: zero-length segments) and a longest-segment bound
`max_seqlen` as a Python int, so a captured graph picks up new boundaries on replay as long as the
bound holds. Rows outside every segment are left unspecified.

- `varlen`: torch's FlashAttention-2 varlen kernel (CUDA only): the baseline and the fallback.
- `cudnn`: cuDNN's fused attention in its ragged layout through cudnn-frontend (models/attention_cudnn.py);
  on Hopper, cuDNN runs head dims 72 and 80 well ahead of FlashAttention-2. Needs the `cuda` extra.
  Short segments are the exception: a call whose bound `max_seqlen` is at most `SHORT_SEQLEN` (64
  patches: Qwen2.5-VL's windows) runs varlen_attn, which was faster there (H200, bf16, 16 heads,
  captured; 8 images 1344x756 as 672 windows: 0.25 ms against cuDNN's 0.36 at head dim 80, 0.26
  against 0.37 at 72), while cuDNN led at every bound measured from 256 up (32 x 256: 0.059 against
  0.064 ms). The bound is a Python int fixed at capture, so the choice is made on the host and a
  graph keeps it.
- `sdpa`: one SDPA call per segment, reading the boundaries on the host; fine on the CPU, where
  there is no graph and no sync to avoid.

`auto` serves `sdpa` on the CPU. On CUDA it tries the backends of `AUTO_ORDER` and keeps the first
that runs and agrees with varlen_attn on a self-check at load (`check_backend`: seeded inputs,
ragged boundaries with zero-length padding, twice through one plan with different boundaries),
else `varlen`; the log says which backend serves and why another was passed over. A backend named
explicitly must pass the same check or loading fails.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("vitserve.models")

BACKENDS = ("auto", "varlen", "cudnn", "sdpa")
CUDA_ONLY = ("varlen", "cudnn")
# The cudnn backend hands calls whose bound is at most this many rows to varlen_attn: on Qwen2.5-VL's
# windows it took 0.25 ms against cuDNN's 0.36 (H200, head dim 80, captured; see the docstring).
SHORT_SEQLEN = 64
# Tried in order by `auto` on CUDA.
AUTO_ORDER = ("cudnn",)
CHECK_TOLERANCE = 1e-2  # relative difference to varlen_attn, as for the fused kernels


def check_backend_name(name: str, device: torch.device) -> str:
    """`name` when it is a backend that can be asked for on `device`; ValueError otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name in CUDA_ONLY and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device; on the CPU use sdpa (or auto)")
    return name


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, heads: int = 16,
                    head_dim: int = 80) -> str:
    """The backend that serves a tower of `heads` x `head_dim` attention in `dtype` on `device`."""
    check_backend_name(name, device)
    if name == "auto" and device.type != "cuda":
        return "sdpa"
    if name in ("varlen", "sdpa"):
        return name
    if dtype not in (torch.bfloat16, torch.float16):
        if name != "auto":
            raise ValueError(f"attention backend {name!r} takes bfloat16 or float16, not {dtype}")
        return "varlen"
    for candidate in AUTO_ORDER if name == "auto" else (name,):
        err, reason = check_backend(candidate, device, dtype, heads, head_dim)
        if err < CHECK_TOLERANCE:
            log.info("attention: %s serves (relative difference to varlen_attn %.1e)", candidate, err)
            return candidate
        if name != "auto":
            raise ValueError(f"attention backend {candidate!r} is unusable here: {reason}")
        log.warning("attention: %s not used, falling back to varlen: %s", candidate, reason)
    log.info("attention: varlen serves")
    return "varlen"


def kernel_for(backend: str, max_seqlen: int) -> str:
    """The kernel that runs a call of `backend` whose segments are at most `max_seqlen` rows long."""
    if backend == "cudnn" and max_seqlen <= SHORT_SEQLEN:
        return "varlen"
    return backend


def packed_attention(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim]. Rows outside every segment are left unspecified."""
    kernel = kernel_for(backend, max_seqlen)
    if kernel == "cudnn":
        from models.attention_cudnn import cudnn_attention

        return cudnn_attention(q, k, v, cu_seqlens, max_seqlen)
    if kernel == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return sdpa_per_segment(q, k, v, cu_seqlens)


def sdpa_per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()  # host-side on purpose: this backend is for the CPU
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = [x[start:end].transpose(0, 1) for x in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*seg).transpose(0, 1)
    return out


# ---- the load-time self-check ---------------------------------------------------------------------

# Two layouts of one capacity (8 segments, 1024 rows, longest 512): ragged, with zero-length
# padding segments, a segment of one row and rows outside every segment. The bound is above
# SHORT_SEQLEN, so the check runs the backend's own kernel.
CHECK_LAYOUTS = ([300, 0, 77, 512, 1, 0, 0, 0], [64, 64, 500, 9, 233, 17, 0, 0])
CHECK_ROWS, CHECK_MAX_SEQLEN = 1024, 512


def check_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, heads: int = 16,
                  head_dim: int = 80) -> tuple[float, str]:
    """(worst relative difference to varlen_attn, reason) of backend `name` on seeded inputs laid
    out like the towers' (q and k views of one [rows, 2, heads, head_dim] tensor, v a view of a
    [rows, 3, heads, head_dim] one), over both `CHECK_LAYOUTS` through one plan; infinity and the
    error when the backend fails to import, build or run."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        gen = torch.Generator(device=device).manual_seed(0)
        qk = torch.randn(CHECK_ROWS, 2, heads, head_dim, device=device, generator=gen).to(dtype)
        qkv = torch.randn(CHECK_ROWS, 3, heads, head_dim, device=device, generator=gen).to(dtype)
        q, k = qk.unbind(1)
        v = qkv[:, 2]
        worst = 0.0
        for lengths in CHECK_LAYOUTS:
            bounds = [0]
            for n in lengths:
                bounds.append(bounds[-1] + n)
            cu = torch.tensor(bounds, dtype=torch.int32, device=device)
            got = packed_attention(name, q, k, v, cu, CHECK_MAX_SEQLEN)
            ref = varlen_attn(q, k, v, cu, cu, CHECK_MAX_SEQLEN, CHECK_MAX_SEQLEN)
            rows = bounds[-1]  # the rest lie outside every segment: unspecified
            a, b = got[:rows].float(), ref[:rows].float()
            err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            if not err == err:  # NaN: a wrong result, not a small one
                err = float("inf")
            worst = max(worst, err)
        reason = "" if worst < CHECK_TOLERANCE else f"relative difference to varlen_attn {worst:.2e}"
        return worst, reason
    except Exception as exc:  # noqa: BLE001 - not installed, unsupported here, failed to build: not served
        return float("inf"), f"{type(exc).__name__}: {exc}"
