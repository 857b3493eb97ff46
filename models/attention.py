"""Attention over packed variable-length segments, and the choice of backend.

Every backend takes q, k, v as [tokens, heads, head_dim], the segment boundaries as an int32
device tensor `cu_seqlens` (padded with repeats: zero-length segments) and a longest-segment bound
`max_seqlen` as a Python int, so a captured graph picks up new boundaries on replay as long as the
bound holds. Rows outside every segment are left unspecified.

- `varlen`: torch's FlashAttention-2 varlen kernel (CUDA, bf16 and fp16, head dims up to 256): the
  baseline and the fallback. A head dim that is not a multiple of 8 is zero-padded to one (the scale
  stays the head dim's own): the padded columns add nothing to q.k and come out as zeros, cut off.
- `cudnn`: cuDNN's fused attention in its ragged layout through cudnn-frontend (models/attention_cudnn.py;
  bf16 and fp16, head dims that are multiples of 8 up to 128); on Hopper, cuDNN runs head dims 72 and 80
  well ahead of FlashAttention-2. Needs the `cuda` extra. Calls over short segments are the exception:
  layers whose segments are at most `SHORT_SEQLEN` patches by construction (Qwen2.5-VL's windows) run
  varlen_attn, which was faster there (H200, bf16, 16 heads, captured; 8 images 1344x756 as 672
  windows: 0.25 ms against cuDNN's 0.36 at head dim 80, 0.26 against 0.37 at 72), while cuDNN led at
  every bound measured from 256 up. The choice follows the layer (`short`), never the batch: a kernel
  picked by the batch's longest segment would make an item's bytes depend on its neighbours.
- `sdpa`: torch's scaled_dot_product_attention, any dtype and head dim. On the CPU one call per segment,
  reading the boundaries on the host. On CUDA (`dense_attention`) every segment is gathered into one
  [segments, max_seqlen] batch with a key mask, sync-free and graph-capturable: it computes
  segments x max_seqlen rows where the packed kernels compute the tokens, so it serves float32 (which
  no packed kernel takes) and is the last resort elsewhere.

`auto` serves `sdpa` on the CPU and for float32 on CUDA. For bf16 and fp16 on CUDA it tries the
backends of `AUTO_ORDER` that can take the head dim and keeps the first that runs and agrees with
varlen_attn on a self-check at load (`check_backend`: seeded inputs, ragged boundaries with
zero-length padding, twice through one plan with different boundaries), else `varlen` (else `sdpa` for
head dims over 256); the log says which backend serves and why another was passed over. A backend
named explicitly must be able to take the dtype and head dim (`backend_problem`, checked before the
server binds its port) and pass the same check, or loading fails.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("vitserve.models")

BACKENDS = ("auto", "varlen", "cudnn", "sdpa")
CUDA_ONLY = ("varlen", "cudnn")
# The cudnn backend hands layers whose segments are at most this many rows to varlen_attn: on
# Qwen2.5-VL's windows it took 0.25 ms against cuDNN's 0.36 (H200, head dim 80, captured; see the docstring).
SHORT_SEQLEN = 64
# Tried in order by `auto` on CUDA.
AUTO_ORDER = ("cudnn",)
CHECK_TOLERANCE = 1e-2  # relative difference to varlen_attn, as for the fused kernels
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Head dims each packed kernel takes (after padding to a multiple of 8 for varlen).
MAX_HEAD_DIM = {"varlen": 256, "cudnn": 128}


def check_backend_name(name: str, device: torch.device) -> str:
    """`name` when it is a backend that can be asked for on `device`; ValueError otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name in CUDA_ONLY and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device; on the CPU use sdpa (or auto)")
    return name


def backend_problem(name: str, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why backend `name` cannot serve a tower of `head_dim` attention in `dtype` on a `device_type`
    device, in words for the operator; None when it can (`auto` always can)."""
    if name in CUDA_ONLY and device_type != "cuda":
        return f"attention backend {name!r} needs a CUDA device; on the CPU use sdpa (or auto)"
    if name not in CUDA_ONLY:
        return None
    if dtype not in HALF_DTYPES:
        return (f"attention backend {name!r} takes bfloat16 or float16, not {str(dtype).removeprefix('torch.')}; "
                "--attention sdpa (or auto) serves float32")
    if head_dim > MAX_HEAD_DIM[name]:
        return f"attention backend {name!r} takes head dims up to {MAX_HEAD_DIM[name]}, this tower's is {head_dim}"
    if name == "cudnn" and head_dim % 8:
        return (f"attention backend 'cudnn' takes head dims that are multiples of 8, this tower's is {head_dim}; "
                "varlen (or auto) pads it")
    return None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, heads: int = 16,
                    head_dim: int = 80) -> str:
    """The backend that serves a tower of `heads` x `head_dim` attention in `dtype` on `device`."""
    check_backend_name(name, device)
    problem = backend_problem(name, device.type, dtype, head_dim)
    if problem:
        raise ValueError(problem)
    if name == "auto" and (device.type != "cuda" or dtype not in HALF_DTYPES):
        return "sdpa"
    if name in ("varlen", "sdpa"):
        return name
    candidates = AUTO_ORDER if name == "auto" else (name,)
    for candidate in candidates:
        skip = backend_problem(candidate, device.type, dtype, head_dim)
        if skip:
            log.info("attention: %s not used: %s", candidate, skip)
            continue
        err, reason = check_backend(candidate, device, dtype, heads, head_dim)
        if err < CHECK_TOLERANCE:
            log.info("attention: %s serves (relative difference to varlen_attn %.1e)", candidate, err)
            return candidate
        if name != "auto":
            raise ValueError(f"attention backend {candidate!r} is unusable here: {reason}")
        log.warning("attention: %s not used, falling back to varlen: %s", candidate, reason)
    if backend_problem("varlen", device.type, dtype, head_dim):
        log.info("attention: sdpa serves (head dim %d is beyond the packed kernels)", head_dim)
        return "sdpa"
    log.info("attention: varlen serves")
    return "varlen"


def kernel_for(backend: str, short: bool = False) -> str:
    """The kernel that runs a call of `backend` in a layer whose segments are at most SHORT_SEQLEN rows
    long by construction (`short`: window attention), or not."""
    if backend == "cudnn" and short:
        return "varlen"
    return backend


def packed_attention(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    short: bool = False,
) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim]. Rows outside every segment are left unspecified."""
    kernel = kernel_for(backend, short)
    if kernel == "cudnn":
        from models.attention_cudnn import cudnn_attention

        return cudnn_attention(q, k, v, cu_seqlens, max_seqlen)
    if kernel == "varlen":
        return varlen_padded(q, k, v, cu_seqlens, max_seqlen)
    if q.is_cuda:
        return dense_attention(q, k, v, cu_seqlens, max_seqlen)
    return sdpa_per_segment(q, k, v, cu_seqlens)


def varlen_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int) -> torch.Tensor:
    """varlen_attn, its head dim zero-padded to a multiple of 8 where it is not one."""
    from torch.nn.attention.varlen import varlen_attn

    d = q.shape[-1]
    pad = -d % 8
    if not pad:
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=d**-0.5)[..., :d]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int) -> torch.Tensor:
    """SDPA over every segment padded to `max_seqlen` rows, keys beyond a segment's end masked out;
    gathers and scatters by index, so nothing is read back to the host. Rows of zero-length and
    padding slots land in one spare row that is dropped."""
    n, heads, d = q.shape
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offsets = torch.arange(max(max_seqlen, 1), device=q.device)
    valid = offsets < lengths[:, None]  # [segments, max_seqlen]
    rows = torch.where(valid, starts[:, None] + offsets, n)  # the spare row for padding
    padded = [torch.cat([x, x.new_zeros(1, heads, d)])[rows].transpose(1, 2) for x in (q, k, v)]
    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(*padded, attn_mask=mask).transpose(1, 2)  # [segments, len, heads, d]
    result = q.new_empty(n + 1, heads, d)
    result[rows.reshape(-1)] = out.reshape(-1, heads, d)
    return result[:n]


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
