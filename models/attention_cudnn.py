"""cuDNN's fused attention over ragged segments, through cudnn-frontend's Python graph API.

The packed tokens are handed to cuDNN as a [segments, heads, max_seqlen, head_dim] problem in its
ragged (THD) layout: each segment is one batch entry whose first row is found through a ragged
offset (elements from the tensor's start: cu_seqlens[i] * row stride) and whose length through
the padding mask's per-sequence lengths (cu_seqlens[i+1] - cu_seqlens[i]; zero for padding
segments). The row and head strides are the tensors' own, so q and k stay views of the rotary
output and v a view of the qkv projection: nothing is copied.

A cuDNN graph and execution plan are built once per `PlanKey` (device, dtype, segment capacity,
longest-segment bound, heads, head dim, strides), with the capacity and the bound rounded up to a
few classes so that eager batches of every size share plans. A call then computes the lengths and
offsets from `cu_seqlens` on the device, into buffers the plan owns (one small kernel), and hands
cuDNN the pointers on torch's current stream: no allocation but the output, no host sync, so a
CUDA graph captured around a call recomputes them from whatever boundaries its buffer holds at
each replay. Plans are never dropped: a captured graph keeps reading their buffers and workspace.

cudnn-frontend (`pip install nvidia-cudnn-frontend`, the `cuda` extra) is imported on first use;
without it, or without a GPU, `available()` says why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from models.forward_scope import PerForward

_DTYPES = ("bfloat16", "float16")
PYTHON_ENGINES = "sdpa_fwd_prefill"  # name prefix of cudnn-frontend's Python SDPA engines
# Variant-pack uids of the graph's tensors.
_Q, _K, _V, _O, _SEQ_Q, _SEQ_KV, _OFF_Q, _OFF_K, _OFF_V, _OFF_O = range(1, 11)

_lock = threading.Lock()  # a cuDNN handle must not run calls from two threads at once
_build_lock = threading.Lock()
_plans: dict[PlanKey, CudnnPlan] = {}
_handles: dict[int, Any] = {}
_module: Any = None
_import_error: str | None = None

try:  # the lengths-and-offsets step as one kernel; torch ops where Triton is missing
    import triton
    import triton.language as tl

    @triton.jit
    def _ragged_metadata(cu_ptr, seq_ptr, off_ptr, n_bounds, n_slots, s0, s1, s2, s3,
                         N_STRIDES: tl.constexpr, BLOCK: tl.constexpr):
        """cu_seqlens (n_bounds values) padded with its last value to n_slots + 1 bounds ->
        seq_len[n_slots] (int32) and offsets[N_STRIDES, n_slots + 1] = bound * stride (computed in
        int64, stored in the buffer's integer type)."""
        i = tl.arange(0, BLOCK)
        last = tl.load(cu_ptr + n_bounds - 1)
        lo = tl.where(i < n_bounds, tl.load(cu_ptr + i, mask=i < n_bounds, other=0), last)
        hi = tl.where(i + 1 < n_bounds, tl.load(cu_ptr + i + 1, mask=i + 1 < n_bounds, other=0), last)
        tl.store(seq_ptr + i, (hi - lo).to(tl.int32), mask=i < n_slots)
        lo = lo.to(tl.int64)
        ok = i < n_slots + 1
        tl.store(off_ptr + i, lo * s0, mask=ok)
        if N_STRIDES > 1:
            tl.store(off_ptr + (n_slots + 1) + i, lo * s1, mask=ok)
        if N_STRIDES > 2:
            tl.store(off_ptr + 2 * (n_slots + 1) + i, lo * s2, mask=ok)
        if N_STRIDES > 3:
            tl.store(off_ptr + 3 * (n_slots + 1) + i, lo * s3, mask=ok)

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False


def size_class(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (2^k and 3 * 2^k) not below n: plans are built
    per class, so eager batches of any size share a few of them at most 1.5x their size."""
    if n <= 4:
        return max(n, 1)
    p = 1 << (n - 1).bit_length()  # the power of two at or above n
    return 3 * p // 4 if 3 * p // 4 >= n else p


@dataclass(frozen=True)
class PlanKey:
    """What a cuDNN plan is specialised on. Strides are (row, head) in elements; the output is
    always a fresh [tokens, heads, head_dim] tensor."""

    device: int
    dtype: str
    segments: int  # capacity class: at least the number of segments in cu_seqlens
    max_seqlen: int  # class of the longest-segment bound
    heads: int
    head_dim: int
    q_strides: tuple[int, int]
    k_strides: tuple[int, int]
    v_strides: tuple[int, int]

    @property
    def row_strides(self) -> tuple[int, ...]:
        """The distinct row strides of q, k, v and the output: one offsets row each."""
        out = self.heads * self.head_dim
        return tuple(sorted({self.q_strides[0], self.k_strides[0], self.v_strides[0], out}))


def plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> PlanKey:
    """The plan a call runs on; raises ValueError for inputs cuDNN's ragged layout cannot take."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype or str(q.dtype).removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"the cudnn attention backend takes bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k, v need a unit stride along the head dim")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be int32 [segments + 1], got {cu_seqlens.dtype}{tuple(cu_seqlens.shape)}")
    _, heads, d = q.shape
    return PlanKey(
        device=q.device.index if q.device.index is not None else -1,
        dtype=str(q.dtype).removeprefix("torch."),
        segments=size_class(cu_seqlens.numel() - 1),
        max_seqlen=size_class(max(max_seqlen, 1)),
        heads=heads,
        head_dim=d,
        q_strides=(q.stride(0), q.stride(1)),
        k_strides=(k.stride(0), k.stride(1)),
        v_strides=(v.stride(0), v.stride(1)),
    )


def ragged_metadata_torch(cu_seqlens: torch.Tensor, slots: int, row_strides: tuple[int, ...]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_len int32 [slots], offsets int64 [len(row_strides), slots + 1]) from cu_seqlens, whose
    segments beyond its own count are zero-length (its last value repeated): what the plan's
    buffers hold before each call, in plain torch (the reference, and the path without Triton)."""
    n = cu_seqlens.numel()
    bounds = torch.cat([cu_seqlens, cu_seqlens[-1:].expand(slots + 1 - n)]).to(torch.int64)
    strides = torch.tensor(row_strides, dtype=torch.int64, device=cu_seqlens.device)[:, None]
    return (bounds[1:] - bounds[:-1]).to(torch.int32), bounds[None, :] * strides


def fill_ragged_metadata(cu_seqlens: torch.Tensor, seq_len: torch.Tensor, offsets: torch.Tensor,
                         row_strides: tuple[int, ...]) -> None:
    """`ragged_metadata_torch` written into existing buffers, in one Triton kernel where possible."""
    slots = seq_len.numel()
    if _HAVE_TRITON and (cu_seqlens.is_cuda or _interpreting()):
        s = list(row_strides) + [0] * (4 - len(row_strides))
        _ragged_metadata[(1,)](cu_seqlens, seq_len, offsets, cu_seqlens.numel(), slots, *s,
                               N_STRIDES=len(row_strides), BLOCK=triton.next_power_of_2(slots + 1))
        return
    lengths, offs = ragged_metadata_torch(cu_seqlens, slots, row_strides)
    seq_len.copy_(lengths)
    offsets.copy_(offs)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- cudnn-frontend -------------------------------------------------------------------------------


def _cudnn() -> Any:
    """The cudnn-frontend module, imported once; RuntimeError with the reason when unusable."""
    global _module, _import_error
    if _module is None and _import_error is None:
        try:
            import cudnn  # torch is imported first, so its libcudnn is the one the frontend finds

            cudnn.backend_version()
            _module = cudnn
        except Exception as exc:  # noqa: BLE001 - not installed, no libcudnn, no driver
            _import_error = f"{type(exc).__name__}: {exc}"
    if _module is None:
        raise RuntimeError(f"cudnn-frontend is unusable here ({_import_error}); "
                           "install the `cuda` extra (nvidia-cudnn-frontend)")
    return _module


def available() -> str | None:
    """None when the backend can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _cudnn()
    except RuntimeError as exc:
        return str(exc)
    return None


def versions() -> dict[str, Any]:
    """cudnn-frontend and cuDNN backend versions (for logs and benchmarks)."""
    cudnn = _cudnn()
    return {"frontend": getattr(cudnn, "__version__", "?"), "backend": cudnn.backend_version(),
            "torch_cudnn": torch.backends.cudnn.version()}


def _handle(device: int) -> Any:
    handle = _handles.get(device)
    if handle is None:
        with torch.cuda.device(device):
            handle = _handles[device] = _cudnn().create_handle()
    return handle


def offsets_dtype(backend_version: int) -> torch.dtype:
    """64-bit ragged offsets need cuDNN 9.5; 32 bits suffice below 2^31 elements per tensor."""
    return torch.int64 if backend_version >= 90500 else torch.int32


def build_graph(cudnn: Any, key: PlanKey, handle: Any, offsets: torch.dtype = torch.int64) -> Any:
    """The cuDNN graph of one plan, described but not yet validated or built."""
    b, s, h, d = key.segments, key.max_seqlen, key.heads, key.head_dim
    offsets_type = cudnn.data_type.INT64 if offsets == torch.int64 else cudnn.data_type.INT32
    io = {"bfloat16": cudnn.data_type.BFLOAT16, "float16": cudnn.data_type.HALF}[key.dtype]
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

    def bounds(uid: int, name: str) -> Any:
        return graph.tensor(uid=uid, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=offsets_type, name=name)

    def lengths(uid: int, name: str) -> Any:
        return graph.tensor(uid=uid, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, name=name)

    def packed(uid: int, name: str, strides: tuple[int, int], offset_uid: int) -> Any:
        # [B, H, S, D] over BSHD-like rows; the batch stride is unused with ragged offsets
        row, head = strides
        t = graph.tensor(uid=uid, dim=[b, h, s, d], stride=[s * row, head, row, 1], data_type=io, name=name)
        return t.set_ragged_offset(bounds(offset_uid, name + "_offsets"))

    q = packed(_Q, "q", key.q_strides, _OFF_Q)
    k = packed(_K, "k", key.k_strides, _OFF_K)
    v = packed(_V, "v", key.v_strides, _OFF_V)
    o, _ = graph.sdpa(q=q, k=k, v=v, name="attention", generate_stats=False, attn_scale=d**-0.5,
                      use_padding_mask=True, seq_len_q=lengths(_SEQ_Q, "seq_len_q"),
                      seq_len_kv=lengths(_SEQ_KV, "seq_len_kv"))
    o.set_uid(_O).set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1])
    o.set_ragged_offset(bounds(_OFF_O, "o_offsets"))
    return graph


class CudnnPlan:
    """One built cuDNN graph with the buffers its calls fill: per-segment lengths, ragged offsets
    and the workspace. Built outside any CUDA graph capture (the warm-up before a capture builds it)."""

    def __init__(self, key: PlanKey) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"no cuDNN attention plan for {key}: plans must be built before graph capture "
                               "(run the same shapes once eagerly first)")
        cudnn = _cudnn()
        self.key = key
        self.device = torch.device("cuda", key.device)
        self.row_strides = key.row_strides
        self.handle = _handle(key.device)
        offsets = offsets_dtype(cudnn.backend_version())
        graph = build_graph(cudnn, key, self.handle, offsets)
        graph.validate()
        graph.build_operation_graph()
        # The frontend's own Python (CuTe DSL) engines need packages not installed with it; the
        # backend's engines are what this module runs and what its measurements are of.
        graph.deselect_engines([PYTHON_ENGINES])
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=self.device)
        b = key.segments
        self.seq_len = torch.zeros(b, dtype=torch.int32, device=self.device)
        self.offsets = torch.zeros((len(self.row_strides), b + 1), dtype=offsets, device=self.device)
        row = {stride: self.offsets[i].data_ptr() for i, stride in enumerate(self.row_strides)}
        self.pack = {
            _SEQ_Q: self.seq_len.data_ptr(), _SEQ_KV: self.seq_len.data_ptr(),
            _OFF_Q: row[key.q_strides[0]], _OFF_K: row[key.k_strides[0]], _OFF_V: row[key.v_strides[0]],
            _OFF_O: row[key.heads * key.head_dim],
        }
        self.filled_from = PerForward()

    def fill(self, cu_seqlens: torch.Tensor) -> None:
        """The lengths and offsets of `cu_seqlens`, unless this forward already filled them from it
        (`models.forward_scope.one_forward`: the blocks of one forward share their boundaries)."""
        if not self.filled_from.filled(cu_seqlens):
            fill_ragged_metadata(cu_seqlens, self.seq_len, self.offsets, self.row_strides)
            self.filled_from.fill(cu_seqlens)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        n, h, d = q.shape
        out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
        if n == 0:
            return out
        self.fill(cu_seqlens)
        pack = dict(self.pack)
        pack.update({_Q: q.data_ptr(), _K: k.data_ptr(), _V: v.data_ptr(), _O: out.data_ptr()})
        stream = torch.cuda.current_stream(self.device).cuda_stream  # the capture stream while capturing
        cudnn = _cudnn()
        with _lock:
            cudnn.set_stream(self.handle, stream)
            # bare addresses throughout: the frontend then inspects no tensor (no DLPack export)
            self.graph.execute(pack, self.workspace.data_ptr(), handle=self.handle)
        return out


def get_plan(key: PlanKey) -> CudnnPlan:
    plan = _plans.get(key)
    if plan is None:
        with _build_lock:
            plan = _plans.get(key)
            if plan is None:
                plan = _plans[key] = CudnnPlan(key)
    return plan


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim] on one CUDA device; cu_seqlens: int32 [segments + 1],
    padded with repeats. Rows outside every segment are left unspecified."""
    return get_plan(plan_key(q, k, v, cu_seqlens, max_seqlen))(q, k, v, cu_seqlens)


def plan_count() -> int:
    return len(_plans)
