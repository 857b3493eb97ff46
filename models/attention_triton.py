"""A varlen flash-attention forward kernel in Triton: non-causal, fp32 accumulation, online softmax.

One program per (block of BLOCK_M query rows, segment, head). A program reads its segment's
boundaries from `cu_seqlens` on the device and returns at once when its block starts past the
segment's end, so zero-length padding segments and the rows beyond a short segment cost a launch
slot and nothing else; the grid depends only on (max_seqlen, segment capacity, heads), which a
captured CUDA graph fixes, and a replay reads whatever boundaries the buffer holds.

`tl.dot` wants power-of-two extents of at least 16, so the head dim is split into two column
blocks: D0, the largest power of two not above it, and D1, the rest rounded up to a power of two
(80 = 64 + 16; 72 = 64 + 16 with 8 masked columns; 64 = 64 alone). Scores add the two partial
products, and the output accumulates in two tiles.

The launch parameters (BLOCK_M, BLOCK_N, num_warps, num_stages) come from `CONFIGS` by name, so a
probe can compare them on the device; nothing is autotuned at run time.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634

# name -> (BLOCK_M, BLOCK_N, num_warps, num_stages)
CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "m128_n64_w8_s2": (128, 64, 8, 2),
    "m128_n64_w4_s3": (128, 64, 4, 3),
    "m128_n128_w8_s2": (128, 128, 8, 2),
    "m64_n64_w4_s3": (64, 64, 4, 3),
    "m64_n32_w4_s2": (64, 32, 4, 2),
}
DEFAULT_CONFIG = "m128_n64_w8_s2"

try:  # Triton ships with CUDA builds of torch; CPU builds may lack it
    import triton
    import triton.language as tl

    @triton.jit
    def _attend_block(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, begin, length, n0, s_kn, s_vn, qk_scale,
                      D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_D1: tl.constexpr,
                      BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One BLOCK_N block of keys and values folded into the running softmax state."""
        cols = n0 + tl.arange(0, BLOCK_N)
        rows = (begin + cols).to(tl.int64)
        d0 = tl.arange(0, D0)
        d1 = D0 + tl.arange(0, D1)
        if MASKED:
            col_ok = cols < length
            k0 = tl.load(k_base + rows[:, None] * s_kn + d0[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k0 = tl.load(k_base + rows[:, None] * s_kn + d0[None, :])
        s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
        if HAS_D1:
            if MASKED:
                k1 = tl.load(k_base + rows[:, None] * s_kn + d1[None, :], mask=col_ok[:, None] & (d1[None, :] < D),
                             other=0.0)
            else:
                k1 = tl.load(k_base + rows[:, None] * s_kn + d1[None, :], mask=d1[None, :] < D, other=0.0)
            s += tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        s = s * qk_scale
        if MASKED:
            s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v0 = tl.load(v_base + rows[:, None] * s_vn + d0[None, :], mask=col_ok[:, None], other=0.0)
        else:
            v0 = tl.load(v_base + rows[:, None] * s_vn + d0[None, :])
        p = p.to(v0.dtype)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, v0, input_precision=DOT_PRECISION)
        if HAS_D1:
            if MASKED:
                v1 = tl.load(v_base + rows[:, None] * s_vn + d1[None, :], mask=col_ok[:, None] & (d1[None, :] < D),
                             other=0.0)
            else:
                v1 = tl.load(v_base + rows[:, None] * s_vn + d1[None, :], mask=d1[None, :] < D, other=0.0)
            acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=DOT_PRECISION)
        return acc0, acc1, l_i, m_new

    @triton.jit
    def _varlen_attention_fwd(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, qk_scale,
                              s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_on, s_oh,
                              D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_D1: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        block = tl.program_id(0)
        seg = tl.program_id(1)
        head = tl.program_id(2).to(tl.int64)
        begin = tl.load(cu_ptr + seg)
        length = tl.load(cu_ptr + seg + 1) - begin
        if block * BLOCK_M >= length:  # past this segment's end (always, for a zero-length one)
            return
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < length
        rows = (begin + offs_m).to(tl.int64)
        d0 = tl.arange(0, D0)
        d1 = D0 + tl.arange(0, D1)
        q_base = q_ptr + head * s_qh + rows[:, None] * s_qn
        q0 = tl.load(q_base + d0[None, :], mask=row_ok[:, None], other=0.0)
        if HAS_D1:
            q1 = tl.load(q_base + d1[None, :], mask=row_ok[:, None] & (d1[None, :] < D), other=0.0)
        else:  # unused: a placeholder of the right type for the helper's signature
            q1 = tl.zeros([BLOCK_M, D1], dtype=q0.dtype)
        k_base = k_ptr + head * s_kh
        v_base = v_ptr + head * s_vh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
        full = (length // BLOCK_N) * BLOCK_N
        for n0 in range(0, full, BLOCK_N):  # whole key blocks: no masks
            acc0, acc1, l_i, m_i = _attend_block(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, begin, length, n0,
                                                 s_kn, s_vn, qk_scale, D, D0, D1, HAS_D1, BLOCK_N, False,
                                                 DOT_PRECISION)
        if full < length:  # the segment's last, partial key block
            acc0, acc1, l_i, m_i = _attend_block(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, begin, length, full,
                                                 s_kn, s_vn, qk_scale, D, D0, D1, HAS_D1, BLOCK_N, True,
                                                 DOT_PRECISION)
        inv = 1.0 / l_i
        o_base = o_ptr + head * s_oh + rows[:, None] * s_on
        tl.store(o_base + d0[None, :], (acc0 * inv[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        if HAS_D1:
            tl.store(o_base + d1[None, :], (acc1 * inv[:, None]).to(o_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (d1[None, :] < D))

    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - any import problem just means this backend is unavailable
    HAVE_TRITON = False


def split_head_dim(d: int) -> tuple[int, int]:
    """(D0, D1): the head dim as a power-of-two column block of at least 16 plus a remainder block
    (a power of two, at least 16, or 0 when the first block covers it all)."""
    if d < 1:
        raise ValueError(f"head dim must be positive, got {d}")
    d0 = max(16, 1 << (d.bit_length() - 1))
    rest = d - d0
    return d0, (0 if rest <= 0 else max(16, 1 << (rest - 1).bit_length()))


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     config: str | tuple[int, int, int, int] = DEFAULT_CONFIG) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim] (any row and head strides, unit last stride); cu_seqlens:
    int32 [segments + 1] on the same device. Rows outside every segment are left unspecified."""
    if not HAVE_TRITON:
        raise RuntimeError("the triton attention backend needs Triton, which is not installed")
    n, heads, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if d < 16:
        raise ValueError(f"the triton attention backend needs a head dim of at least 16, got {d}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k, v need a unit stride along the head dim")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    block_m, block_n, warps, stages = CONFIGS[config] if isinstance(config, str) else config
    out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    segments = cu_seqlens.numel() - 1
    if n == 0 or segments < 1 or max_seqlen < 1:
        return out
    d0, d1 = split_head_dim(d)
    grid = (triton.cdiv(max_seqlen, block_m), segments, heads)
    _varlen_attention_fwd[grid](
        q, k, v, out, cu_seqlens, LOG2E / math.sqrt(d),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        D=d, D0=d0, D1=max(d1, 16), HAS_D1=d1 > 0, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )
    return out
