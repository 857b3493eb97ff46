"""Attention over short segments with the rotary embedding applied as q and k are loaded (Triton).

A tower with rotary positions otherwise rotates q and k in a pass of their own (a read and a write of
2/3 of the projection's rows) and then calls cuDNN, which adds a setup kernel and a memset per call: on
32 images of 224x224 (Qwen3-VL-8B, H200) those are 21 + 3 + 2 us of a 450 us layer beside a 59 us
attention. This kernel reads the projection's rows as they are (q and k unrotated, grouped key/value
heads indexed in place), rotates in float32, rounds to the rows' dtype as the rotary pass does, and runs
the segment's attention in one program per (query block, head, segment).

An item's bytes must not depend on its batch: the kernel takes every segment of at most
`MAX_PATCHES` patches and leaves the longer ones alone, whatever else the batch holds. A batch whose
longest segment is within the bound calls nothing else; a longer batch runs its usual path (rotary pass
and cuDNN) for all segments and this kernel after it, over the same output, for its short ones.

Opt-in (`OPT_IN` in models/kernels.py) until measured against cuDNN on the GPU.
"""

from __future__ import annotations

import math

import torch

MAX_PATCHES = 256  # the longest segment the kernel takes (a 224x224 image is 196 patches of 16 pixels)
BLOCK_M, BLOCK_N, WARPS = 64, 64, 4

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _rotated(rows_ptr, cos_ptr, sin_ptr, rows, valid, col0, d, partner, row_stride, D: tl.constexpr):
        """One head's values of `rows` (a block of row indices), rotated: x * cos + x[partner] * signed sin,
        in float32 and rounded to the rows' dtype, as models.kernels.apply_rotary gives them."""
        mask = valid[:, None] & (d < D)[None, :]
        base = rows_ptr + rows[:, None] * row_stride + col0
        x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        table = rows[:, None] * D + d[None, :]
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
        return (x * cos + xp * sin).to(rows_ptr.dtype.element_ty)

    @triton.jit
    def _rotary_attention(rows_ptr, cos_ptr, sin_ptr, cu_ptr, out_ptr, row_stride, out_row_stride, scale_log2,
                          HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                          MAX_LEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
        block, head, segment = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(cu_ptr + segment).to(tl.int64)
        length = tl.load(cu_ptr + segment + 1).to(tl.int64) - start
        if (length > MAX_LEN) | (block * BM >= length):
            return
        d = tl.arange(0, DP)
        half = D // 2
        partner = tl.where(d < half, d + half, d - half)
        kv_head = head // (HEADS // KV)
        offs_m = block * BM + tl.arange(0, BM)
        q = _rotated(rows_ptr, cos_ptr, sin_ptr, start + offs_m, offs_m < length, head * D, d, partner, row_stride,
                     D)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DP], tl.float32)
        for n0 in range(0, length, BN):
            offs_n = n0 + tl.arange(0, BN)
            keys = offs_n < length
            k = _rotated(rows_ptr, cos_ptr, sin_ptr, start + offs_n, keys, (HEADS + kv_head) * D, d, partner,
                         row_stride, D)
            v = tl.load(rows_ptr + (start + offs_n)[:, None] * row_stride + (HEADS + KV + kv_head) * D + d[None, :],
                        mask=keys[:, None] & (d < D)[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(keys[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        rows = start + offs_m
        tl.store(out_ptr + rows[:, None] * out_row_stride + head * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(offs_m < length)[:, None] & (d < D)[None, :])

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001 - no Triton: only the torch path
    _HAVE_TRITON = False


def fits(rows: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> bool:
    """Whether the kernel can take this call (the caller checks that it is on: models.kernels): Triton is here
    and the rotary turns every value of a head (no partial rotary) from one table row per token."""
    if not (_HAVE_TRITON and cos is not None and sin is not None):
        return False
    table = rows.shape[0] * rows.shape[-1]
    return cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == table \
        and cos.shape[-1] == rows.shape[-1]


def rotary_attention_triton(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                            heads: int, out: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """rows: a projection's rows [tokens, heads + 2 kv, D] (q, then k, then v; q and k unrotated); cos, signed
    sin: [tokens, 1, 1, D] float32 (models.kernels.rotary_tables); out: [tokens, heads, D]. Writes the rows of
    every segment of at most MAX_PATCHES patches into out; leaves the others as they are."""
    n, width, d = rows.shape
    kv = (width - heads) // 2
    assert rows.stride(2) == 1 and rows.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
    segments = cu_seqlens.numel() - 1
    longest = min(max_seqlen, MAX_PATCHES)
    if n and segments and longest:
        grid = (triton.cdiv(longest, BLOCK_M), heads, segments)
        _rotary_attention[grid](rows, cos, sin, cu_seqlens, out, rows.stride(0), out.stride(0),
                                math.log2(math.e) / math.sqrt(d), HEADS=heads, KV=kv, D=d,
                                DP=triton.next_power_of_2(d), MAX_LEN=MAX_PATCHES, BM=BLOCK_M, BN=BLOCK_N,
                                PRECISION="ieee" if rows.dtype == torch.float32 else "tf32", num_warps=WARPS)
    return out


def short_attention_torch(qk: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor
                          ) -> torch.Tensor:
    """The kernel's reference after the rotary: qk [tokens, heads + kv, D] rotated, v [tokens, kv, D]; each
    segment of at most MAX_PATCHES patches in float32 SDPA into out [tokens, heads, D], the others left alone."""
    heads = out.shape[1]
    kv = qk.shape[1] - heads
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if not 0 < end - start <= MAX_PATCHES:
            continue
        q = qk[start:end, :heads].transpose(0, 1)
        k = qk[start:end, heads:].transpose(0, 1).repeat_interleave(heads // kv, 0)
        values = v[start:end].transpose(0, 1).repeat_interleave(heads // kv, 0)
        att = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), values.float())
        out[start:end] = att.transpose(0, 1).to(out.dtype)
    return out
