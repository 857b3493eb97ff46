"""Attention over packed variable-length segments.

`varlen`: torch's FlashAttention-2 varlen kernel (CUDA only). It reads segment boundaries from a
device tensor and takes the longest-segment bound as a Python int, so a captured graph picks up
new boundaries on replay as long as the bound holds. `sdpa`: one SDPA call per segment, reading
the boundaries on the host; fine on the CPU, where there is no graph and no sync to avoid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "varlen", "sdpa")


def resolve_backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "varlen" if device.type == "cuda" else "sdpa"
    if name == "varlen" and device.type != "cuda":
        raise ValueError("attention backend 'varlen' needs a CUDA device")
    return name


def packed_attention(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim]. Rows outside every segment are left unspecified."""
    if backend == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return _sdpa_per_segment(q, k, v, cu_seqlens)


def _sdpa_per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()  # host-side on purpose: this backend is for the CPU
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = [x[start:end].transpose(0, 1) for x in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*seg).transpose(0, 1)
    return out
